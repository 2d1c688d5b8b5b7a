#!/bin/bash
# Reference solution (the oracle agent runs it in /app).
set -e
cd /app
sed -i '0,/^port = 8000/s//port = 8080/' /app/config.ini
