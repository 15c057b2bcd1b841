#!/bin/bash
got=$(tr -d "[:space:]" < /logs/artifacts/answer.txt 2>/dev/null)
echo "got=$got expected=42"
if [ "$got" = "42" ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
