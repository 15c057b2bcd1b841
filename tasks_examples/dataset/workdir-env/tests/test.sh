#!/bin/bash
echo "pwd=$(pwd)"
if [ "$(pwd)" = "/srv/project" ] && [ "$(cat /srv/project/greeting.txt)" = "$EXPECTED" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
