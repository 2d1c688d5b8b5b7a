# The checks of this task; run by test.sh in /app.
import sys
sys.path.insert(0, '/app')
import math
math.gcd = None
from numtheory import gcd
assert gcd(12, 18) == 6
assert gcd(0, 5) == 5
assert gcd(0, 0) == 0
assert gcd(17, 4) == 1
print('all checks passed')
