# The checks of this task; run by test.sh in /app.
import sys
sys.path.insert(0, '/app')
from people import sort_people
assert sort_people([('a', 30), ('b', 20), ('c', 30), ('d', 10)]) == [('d', 10), ('b', 20), ('a', 30), ('c', 30)]
assert sort_people([]) == []
print('all checks passed')
