#!/usr/bin/env bash
# Make the base images the example tasks build on (see images/README.md).
# Thin wrapper: the logic lives in `harbor-exec images bootstrap`.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
exec "${here}/.venv/bin/harbor-exec" images bootstrap "$@"
