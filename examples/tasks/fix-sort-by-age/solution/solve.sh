#!/bin/bash
# Reference solution (the oracle agent runs it in /app).
set -e
cd /app
sed -i 's/, reverse=True//' /app/people.py
