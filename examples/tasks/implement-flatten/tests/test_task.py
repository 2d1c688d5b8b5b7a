# The checks of this task; run by test.sh in /app.
import sys
sys.path.insert(0, '/app')
from nested import flatten
assert flatten([1, [2, [3, []], 4]]) == [1, 2, 3, 4]
assert flatten([]) == []
assert flatten([[['a']], 'b']) == ['a', 'b']
print('all checks passed')
