# The checks of this task; run by test.sh in /app.
import subprocess
open('/tmp/five.txt', 'w').write('1\n2\n3\n4\n5\n')
out = subprocess.run(['bash', '/app/count.sh', '/tmp/five.txt'], capture_output=True, text=True, check=True).stdout
assert out.strip() == '5', out
out = subprocess.run(['bash', '/app/count.sh', '/app/sample.txt'], capture_output=True, text=True, check=True).stdout
assert out.strip() == '3', out
print('all checks passed')
