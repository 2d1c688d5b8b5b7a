# The checks of this task; run by test.sh in /app.
import sys
sys.path.insert(0, '/app')
import runpy
from median import median
assert median([4, 1, 3, 2]) == 2.5
assert median([1]) == 1
assert median([5, 1, 9]) == 5
assert median([1, 2]) == 1.5
print('all checks passed')
