# The checks of this task; run by test.sh in /app.
pairs = dict(l.strip().split('=', 1) for l in open('/app/app.conf') if l.strip() and not l.startswith('#'))
assert pairs == {'NAME': 'svc', 'TIMEOUT_S': '30', 'VERBOSE': '0', 'MAX_RETRIES': '4'}, pairs
print('all checks passed')
