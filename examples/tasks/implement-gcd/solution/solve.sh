#!/bin/bash
# Reference solution (the oracle agent runs it in /app).
set -e
cd /app
cat > /app/numtheory.py <<'EOF'
def gcd(a, b):
    while b:
        a, b = b, a % b
    return a
EOF
