#!/bin/bash
# no-network means the container has only the loopback interface.
echo "interfaces: $(tr '\n' ' ' < /app/interfaces.txt)"
if [ "$(cat /app/interfaces.txt)" = "lo" ] && [ "$(ls /sys/class/net)" = "lo" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
