#!/bin/bash
# Harbor verifier: reward 1 when the checks pass, else 0.
cd /app || exit 1
if python3 /tests/test_task.py; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
