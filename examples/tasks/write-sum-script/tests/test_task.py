# The checks of this task; run by test.sh in /app.
import subprocess
out = subprocess.run(['bash', '/app/sum.sh', '/app/numbers.txt'], capture_output=True, text=True, check=True).stdout
assert out.strip() == '16', out
open('/tmp/n.txt', 'w').write('-5\n5\n7\n')
out = subprocess.run(['bash', '/app/sum.sh', '/tmp/n.txt'], capture_output=True, text=True, check=True).stdout
assert out.strip() == '7', out
print('all checks passed')
