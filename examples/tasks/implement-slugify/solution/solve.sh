#!/bin/bash
# Reference solution (the oracle agent runs it in /app).
set -e
cd /app
cat > /app/text_utils.py <<'EOF'
import re


def slugify(text):
    """Lower-case, non-alphanumeric runs to '-', stripped."""
    return re.sub(r'[^a-z0-9]+', '-', text.lower()).strip('-')
EOF
