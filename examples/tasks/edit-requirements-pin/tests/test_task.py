# The checks of this task; run by test.sh in /app.
lines = [l.strip() for l in open('/app/requirements.txt') if l.strip()]
assert sorted(lines) == sorted(['numpy>=1.26', 'requests==2.31.0', 'pyyaml==6.0.1', 'attrs>=23.1']), lines
print('all checks passed')
