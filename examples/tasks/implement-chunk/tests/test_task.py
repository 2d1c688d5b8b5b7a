# The checks of this task; run by test.sh in /app.
import sys
sys.path.insert(0, '/app')
from chunks import chunk
assert chunk([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]
assert chunk([], 3) == []
try:
    chunk([1], 0)
except ValueError:
    pass
else:
    raise AssertionError('size 0 accepted')
print('all checks passed')
