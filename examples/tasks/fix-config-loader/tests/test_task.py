# The checks of this task; run by test.sh in /app.
import sys
sys.path.insert(0, '/app')
import json
from loader import load_port
json.dump({'port': '9001'}, open('/tmp/a.json', 'w'))
json.dump({}, open('/tmp/b.json', 'w'))
assert load_port('/tmp/a.json') == 9001
assert load_port('/tmp/b.json') == 8000
print('all checks passed')
