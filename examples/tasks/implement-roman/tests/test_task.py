# The checks of this task; run by test.sh in /app.
import sys
sys.path.insert(0, '/app')
from roman import roman_to_int
assert roman_to_int('MCMXCIV') == 1994
assert roman_to_int('III') == 3
assert roman_to_int('XLII') == 42
assert roman_to_int('IX') == 9
print('all checks passed')
