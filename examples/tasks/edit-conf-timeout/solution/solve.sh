#!/bin/bash
# Reference solution (the oracle agent runs it in /app).
set -e
cd /app
sed -i 's/^TIMEOUT_S=5$/TIMEOUT_S=30/' /app/app.conf
echo 'MAX_RETRIES=4' >> /app/app.conf
