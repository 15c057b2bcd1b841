#!/bin/bash
if [ "$(tr '\n' ' ' < /app/sorted.txt)" = "1 3 5 11 " ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
