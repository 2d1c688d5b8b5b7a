# The checks of this task; run by test.sh in /app.
import sys
sys.path.insert(0, '/app')
from fb import fizzbuzz
assert fizzbuzz(5) == ['1', '2', 'Fizz', '4', 'Buzz']
assert fizzbuzz(15)[-1] == 'FizzBuzz'
assert fizzbuzz(0) == []
print('all checks passed')
