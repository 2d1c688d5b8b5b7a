# The checks of this task; run by test.sh in /app.
import sys
sys.path.insert(0, '/app')
from merge import deep_merge
b = {'a': 1, 'n': {'x': 1, 'y': 2}}
o = {'n': {'y': 3, 'z': 4}, 'b': 2}
assert deep_merge(b, o) == {'a': 1, 'b': 2, 'n': {'x': 1, 'y': 3, 'z': 4}}
assert b == {'a': 1, 'n': {'x': 1, 'y': 2}}
assert deep_merge({}, {}) == {}
assert deep_merge({'a': {'b': 1}}, {'a': 5}) == {'a': 5}
print('all checks passed')
