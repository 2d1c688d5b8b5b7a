#!/bin/bash
# Reference solution (the oracle agent runs it in /app).
set -e
cd /app
sed -i 's/^requests$/requests==2.31.0/' /app/requirements.txt
echo 'attrs>=23.1' >> /app/requirements.txt
