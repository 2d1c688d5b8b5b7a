#!/bin/bash
# Reference solution (the oracle agent runs it in /app).
set -e
cd /app
sed -i 's/range(1, n)/range(1, n + 1)/' /app/counting.py
