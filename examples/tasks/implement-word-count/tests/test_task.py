# The checks of this task; run by test.sh in /app.
import sys
sys.path.insert(0, '/app')
from words import word_count
assert word_count('The cat and the hat.') == {'the': 2, 'cat': 1, 'and': 1, 'hat': 1}
assert word_count('') == {}
assert word_count('a1a') == {'a': 2}
print('all checks passed')
