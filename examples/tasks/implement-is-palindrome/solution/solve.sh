#!/bin/bash
# Reference solution (the oracle agent runs it in /app).
set -e
cd /app
cat > /app/pal.py <<'EOF'
def is_palindrome(text):
    """Palindrome, ignoring case and non-alphanumerics."""
    kept = [c.lower() for c in text if c.isalnum()]
    return kept == kept[::-1]
EOF
