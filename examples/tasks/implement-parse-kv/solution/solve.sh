#!/bin/bash
# Reference solution (the oracle agent runs it in /app).
set -e
cd /app
cat > /app/kv.py <<'EOF'
def parse_pairs(text):
    out = {}
    for part in text.split(';'):
        if not part.strip():
            continue
        key, _, value = part.partition('=')
        out[key.strip()] = value.strip()
    return out
EOF
