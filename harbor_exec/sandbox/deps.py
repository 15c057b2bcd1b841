"""The bundle's dependency layer: its wheelhouse in a venv, on top of a task image.

Keyed by (task image, requirement set), built once per tag and kept, so that a
trial only adds the user's small unpacked wheel. A plain value (``DepsLayer``)
says what to build; ``ensure_deps_image`` builds it on whichever engine runs
the trial (this machine's, or a Ray node's).
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from harbor_exec.sandbox.runtime import LABEL_KIND, ContainerRuntime

DEPS_BUILD_TIMEOUT_SEC = 900.0

_DOCKERFILE = """\
# harbor-exec dependency layer: the bundle's wheelhouse in a venv, on top of the task image.
FROM {image}
USER root
COPY wheelhouse /opt/harbor-exec/wheelhouse
RUN set -e; \\
    die() {{ echo "harbor-exec: $*" >&2; exit 1; }}; \\
    PY="$(command -v python3 || true)"; \\
    [ -n "$PY" ] || die "this task image has no python3; bundled workflows need Python 3.11+"; \\
    "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \\
      || die "this task image's python3 is older than 3.11"; \\
    "$PY" -m venv --without-pip /opt/harbor-exec/venv; \\
    wh=/opt/harbor-exec/wheelhouse; \\
    /opt/harbor-exec/venv/bin/python "$wh/{pip}/pip" install --quiet --no-index --no-deps \\
      --no-cache-dir --disable-pip-version-check "$wh"/*.whl; \\
    rm -rf "$wh"
USER {user}
"""


@dataclass(frozen=True)
class DepsLayer:
    """What a bundle needs in the image: its wheelhouse, installed with its pip wheel."""

    wheelhouse: Path
    pip_wheel: str
    requirements_digest: str

    def tag_for(self, task_image: str) -> str:
        key = hashlib.sha256(f"{task_image}\0{self.requirements_digest}".encode()).hexdigest()
        return f"harbor-exec/deps:{key[:32]}"


def ensure_deps_image(
    runtime: ContainerRuntime, task_image: str, layer: DepsLayer
) -> tuple[str, bool]:
    """The dependency layer FROM ``task_image``; returns ``(tag, built_now)``.

    The runtime builds one tag at a time, so concurrent callers (prewarm, trials)
    build each layer once; different layers build in parallel.
    """
    tag = layer.tag_for(task_image)
    if runtime.image_exists(tag):
        return tag, False
    user = runtime.image_user(task_image) or "root"
    with tempfile.TemporaryDirectory(prefix="hx-deps-") as scratch:
        context = Path(scratch)
        shutil.copytree(layer.wheelhouse, context / "wheelhouse")
        (context / "Dockerfile").write_text(
            _DOCKERFILE.format(image=task_image, pip=layer.pip_wheel, user=user)
        )
        result = runtime.ensure_image(
            context_dir=context,
            tag=tag,
            timeout_sec=DEPS_BUILD_TIMEOUT_SEC,
            labels={LABEL_KIND: "deps"},
        )
    return tag, result.built


__all__ = ["DepsLayer", "ensure_deps_image"]
