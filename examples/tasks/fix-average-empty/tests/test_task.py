# The checks of this task; run by test.sh in /app.
import sys
sys.path.insert(0, '/app')
from stats import average
assert average([]) == 0.0
assert average([1, 2, 3]) == 2
assert average([5]) == 5
print('all checks passed')
