# The checks of this task; run by test.sh in /app.
import json
s = json.load(open('/app/settings.json'))
assert s == {'debug': False, 'log_level': 'warning', 'workers': 4, 'name': 'demo'}, s
print('all checks passed')
