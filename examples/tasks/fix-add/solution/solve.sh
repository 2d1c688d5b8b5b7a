#!/bin/bash
# Reference solution (the oracle agent runs it in /app).
set -e
cd /app
sed -i 's/return a - b/return a + b/' /app/calc.py
