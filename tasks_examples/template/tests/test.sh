#!/bin/bash
# Expected answer: the rollout's label when harbor-exec provides one (/tests/rollout.json),
# else 5, the answer to the instruction this template ships with.
python3 - <<'PY'
import json
import pathlib

rollout = pathlib.Path("/tests/rollout.json")
label = json.loads(rollout.read_text()).get("label") if rollout.exists() else None
expected = float(label if label is not None else 5)
answer = pathlib.Path("/logs/artifacts/answer.txt")
try:
    got = float(answer.read_text().strip())
except (OSError, ValueError):
    got = None
print(f"expected={expected:g} got={got}")
correct = got is not None and abs(got - expected) <= 1e-6
pathlib.Path("/logs/verifier/reward.txt").write_text("1\n" if correct else "0\n")
PY
