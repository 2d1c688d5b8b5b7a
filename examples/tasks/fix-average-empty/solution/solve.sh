#!/bin/bash
# Reference solution (the oracle agent runs it in /app).
set -e
cd /app
cat > /app/stats.py <<'EOF'
def average(values):
    """Arithmetic mean of `values`; 0.0 for an empty list."""
    if not values:
        return 0.0
    return sum(values) / len(values)
EOF
