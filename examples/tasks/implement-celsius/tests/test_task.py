# The checks of this task; run by test.sh in /app.
import sys
sys.path.insert(0, '/app')
from temps import c_to_f, f_to_c
assert c_to_f(100) == 212
assert c_to_f(0) == 32
assert abs(f_to_c(212) - 100) < 1e-9
assert abs(f_to_c(-40) + 40) < 1e-9
print('all checks passed')
