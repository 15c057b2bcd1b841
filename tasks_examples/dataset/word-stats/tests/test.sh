#!/bin/bash
count=0; longest=0
[ "$(cat /app/count.txt 2>/dev/null)" = "10" ] && count=1
[ "$(cat /app/longest.txt 2>/dev/null)" = "extraordinarily" ] && longest=1
printf '{"count": %s, "longest": %s}\n' "$count" "$longest" > /logs/verifier/reward.json
