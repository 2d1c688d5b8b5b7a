# The checks of this task; run by test.sh in /app.
import sys
sys.path.insert(0, '/app')
from text_utils import slugify
assert slugify('Hello, World!') == 'hello-world'
assert slugify('  A  b--C ') == 'a-b-c'
assert slugify('x') == 'x'
assert slugify('!!') == ''
print('all checks passed')
