#!/bin/bash
# Reference solution (the oracle agent runs it in /app).
set -e
cd /app
cat > /app/loader.py <<'EOF'
import json


def load_port(path):
    with open(path) as f:
        data = json.load(f)
    return int(data.get('port', 8000))
EOF
