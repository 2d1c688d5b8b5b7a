# The checks of this task; run by test.sh in /app.
import sys
sys.path.insert(0, '/app')
from cipher import caesar
assert caesar('abc xyz', 2) == 'cde zab'
assert caesar('Hello, World!', 13) == 'Uryyb, Jbeyq!'
assert caesar('a', -1) == 'z'
print('all checks passed')
