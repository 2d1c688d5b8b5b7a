#!/bin/bash
# Reference solution (the oracle agent runs it in /app).
set -e
cd /app
printf '#!/bin/bash\necho "Hello, ${1:-world}!"\n' > /app/greet.sh
