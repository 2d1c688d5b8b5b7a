#!/bin/bash
# Reference solution (the oracle agent runs it in /app).
set -e
cd /app
cat > /app/cipher.py <<'EOF'
def caesar(text, shift):
    out = []
    for c in text:
        if 'a' <= c <= 'z' or 'A' <= c <= 'Z':
            base = ord('a') if c.islower() else ord('A')
            out.append(chr(base + (ord(c) - base + shift) % 26))
        else:
            out.append(c)
    return ''.join(out)
EOF
