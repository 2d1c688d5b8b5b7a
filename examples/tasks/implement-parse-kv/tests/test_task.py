# The checks of this task; run by test.sh in /app.
import sys
sys.path.insert(0, '/app')
from kv import parse_pairs
assert parse_pairs('a=1; b = 2') == {'a': '1', 'b': '2'}
assert parse_pairs('') == {}
assert parse_pairs('x=;;y=z') == {'x': '', 'y': 'z'}
print('all checks passed')
