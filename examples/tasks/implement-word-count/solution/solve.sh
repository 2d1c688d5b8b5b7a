#!/bin/bash
# Reference solution (the oracle agent runs it in /app).
set -e
cd /app
cat > /app/words.py <<'EOF'
import collections
import re


def word_count(text):
    return dict(collections.Counter(re.findall(r'[a-z]+', text.lower())))
EOF
