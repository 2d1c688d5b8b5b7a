#!/bin/bash
# Reference solution (the oracle agent runs it in /app).
set -e
cd /app
sed -i 's#datas/#data/#' /app/backup.sh
