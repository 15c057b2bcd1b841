#!/usr/bin/env bash
# Make the base images the example tasks build on (see images/README.md).
# Thin wrapper: the logic lives in `harbor-exec images bootstrap`; its options pass
# through (images/bootstrap.sh --mirror URL: the Debian mirror for debootstrap, default
# the one the host's apt sources name; or set HARBOR_EXEC_DEBIAN_MIRROR).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
exec "${here}/.venv/bin/harbor-exec" images bootstrap "$@"
