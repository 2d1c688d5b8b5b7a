# The checks of this task; run by test.sh in /app.
import subprocess
import os
subprocess.run(['bash', 'backup.sh'], cwd='/app', check=True)
assert open('/app/backup/a.txt').read() == 'alpha\n'
assert open('/app/backup/b.txt').read() == 'beta\n'
assert not os.path.exists('/app/backup/c.log')
print('all checks passed')
