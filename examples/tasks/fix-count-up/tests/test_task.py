# The checks of this task; run by test.sh in /app.
import sys
sys.path.insert(0, '/app')
from counting import count_up
assert count_up(3) == [1, 2, 3]
assert count_up(1) == [1]
assert count_up(0) == []
print('all checks passed')
