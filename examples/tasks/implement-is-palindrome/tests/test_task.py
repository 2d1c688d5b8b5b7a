# The checks of this task; run by test.sh in /app.
import sys
sys.path.insert(0, '/app')
from pal import is_palindrome
assert is_palindrome('A man, a plan, a canal: Panama') is True
assert is_palindrome('abc') is False
assert is_palindrome('') is True
assert is_palindrome('No lemon, no melon') is True
print('all checks passed')
