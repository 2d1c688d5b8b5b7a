#!/bin/bash
# Reference solution (the oracle agent runs it in /app).
set -e
cd /app
python3 - <<'EOF'
import json
s = json.load(open('/app/settings.json'))
s.update(debug=False, log_level='warning')
json.dump(s, open('/app/settings.json', 'w'), indent=2)
EOF
