#!/usr/bin/env bash
# The static checks CI runs before the tests (and .pre-commit-config.yaml runs on commit):
# mypy --strict over the package and the tests, ruff's lint rules (the Docker SDK only in
# the adapter among them), and ruff's formatting.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=.venv/bin
"$PY/mypy"
"$PY/ruff" check .
"$PY/ruff" format --check .
