#!/bin/bash
# Reference solution (the oracle agent runs it in /app).
set -e
cd /app
cat > /app/sum.sh <<'EOF'
#!/bin/bash
total=0
while read -r n; do
  [ -n "$n" ] && total=$((total + n))
done < "$1"
echo "$total"
EOF
