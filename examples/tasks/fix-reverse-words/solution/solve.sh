#!/bin/bash
# Reference solution (the oracle agent runs it in /app).
set -e
cd /app
sed -i "s/return sentence\[::-1\]/return ' '.join(reversed(sentence.split(' ')))/" /app/rev.py
