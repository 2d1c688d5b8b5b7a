#!/bin/bash
# Reference solution (the oracle agent runs it in /app).
set -e
cd /app
cat > /app/fb.py <<'EOF'
def fizzbuzz(n):
    out = []
    for i in range(1, n + 1):
        out.append('FizzBuzz' if i % 15 == 0 else 'Fizz' if i % 3 == 0 else 'Buzz' if i % 5 == 0 else str(i))
    return out
EOF
