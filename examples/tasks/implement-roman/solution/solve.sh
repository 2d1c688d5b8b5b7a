#!/bin/bash
# Reference solution (the oracle agent runs it in /app).
set -e
cd /app
cat > /app/roman.py <<'EOF'
VALUES = {'I': 1, 'V': 5, 'X': 10, 'L': 50, 'C': 100, 'D': 500, 'M': 1000}


def roman_to_int(numeral):
    total = 0
    for i, c in enumerate(numeral):
        v = VALUES[c]
        if i + 1 < len(numeral) and VALUES[numeral[i + 1]] > v:
            total -= v
        else:
            total += v
    return total
EOF
