#!/bin/bash
# Reference solution (the oracle agent runs it in /app).
set -e
cd /app
printf '#!/bin/bash\nwc -l < "$1"\n' > /app/count.sh
