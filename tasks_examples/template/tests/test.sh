#!/bin/bash
# Expected answer: the rollout's label when harbor-exec provides one, else 5.
expected=$(python3 -c '
import json, pathlib
p = pathlib.Path("/tests/rollout.json")
label = json.loads(p.read_text()).get("label") if p.exists() else None
print(label if label is not None else 5)
')
got=$(tr -d "[:space:]" < /logs/artifacts/answer.txt 2>/dev/null)
echo "expected=$expected got=$got"
if python3 -c 'import sys; sys.exit(abs(float(sys.argv[1]) - float(sys.argv[2])) > 1e-6)' "$expected" "$got" 2>/dev/null; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
