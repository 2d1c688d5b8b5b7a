#!/bin/bash
# Reference solution (the oracle agent runs it in /app).
set -e
cd /app
cat > /app/median.py <<'EOF'
def median(values):
    ordered = sorted(values)
    mid = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[mid]
    return (ordered[mid - 1] + ordered[mid]) / 2
EOF
