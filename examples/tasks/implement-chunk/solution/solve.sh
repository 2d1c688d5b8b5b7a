#!/bin/bash
# Reference solution (the oracle agent runs it in /app).
set -e
cd /app
cat > /app/chunks.py <<'EOF'
def chunk(items, size):
    if size < 1:
        raise ValueError('size must be >= 1')
    return [items[i:i + size] for i in range(0, len(items), size)]
EOF
