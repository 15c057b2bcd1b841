"""Builds through the package cache, on the fake runtime: which builds get the proxy
build arguments and the gateway's network, the build gateway container's shape and
life, and which Dockerfiles stay with BuildKit (the real engine:
tests/test_build_cache_docker.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from harbor_exec.container.forward import main as forward_main
from harbor_exec.network.egress.container import EGRESS_MOUNT
from harbor_exec.network.packages.build_gateway import KIND, build_proxy_args
from harbor_exec.network.packages.build_route import build_cache
from harbor_exec.network.packages.build_trust import (
    TRUST_CONTEXT_DIR,
    rewrite_dockerfile,
    trust_context_files,
)
from harbor_exec.network.packages.service import PackageCacheConfig, PackageCacheService
from harbor_exec.network.packages.trust import trust_env
from harbor_exec.sandbox.dockerfile_syntax import buildkit_only_syntax
from harbor_exec.sandbox.runtime import LABEL_KIND
from harbor_exec.tasks.task import load_task
from harbor_exec.trial.trial import ensure_task_image
from tests.fake_runtime import FakeRuntime
from tests.task_factory import make_task


def test_the_proxy_build_args_are_dockers_predefined_ones() -> None:
    url = "http://127.0.0.1:3128"
    assert build_proxy_args() == {
        "HTTP_PROXY": url,
        "http_proxy": url,
        "HTTPS_PROXY": url,
        "https_proxy": url,
        "NO_PROXY": "localhost,127.0.0.1,::1",
        "no_proxy": "localhost,127.0.0.1,::1",
    }


def test_the_forwarder_refuses_a_missing_socket_on_any_host(tmp_path: Path) -> None:
    missing = str(tmp_path / "none.sock")
    assert forward_main(["--socket", missing, "--host", "0.0.0.0", "--port", "0"]) == 2


def test_builds_get_the_gateway_unless_the_task_opts_out(tmp_path: Path) -> None:
    runtime = FakeRuntime()
    service = PackageCacheService(PackageCacheConfig(root=tmp_path / "cache"))
    cache = build_cache(service)
    out = load_task(
        make_task(tmp_path, "out", toml="[metadata]\nharbor_exec_package_cache = false\n")
    )
    cached = load_task(make_task(tmp_path, "in", dockerfile="FROM debian:bookworm-slim\nRUN x\n"))
    try:
        tag, built = ensure_task_image(runtime, out, cache)
        assert built and runtime.build_args[tag] == {} and runtime.build_networks[tag] is None
        assert runtime.gateways == {}  # no gateway for a build that does not use it
        assert runtime.build_context_files[tag] == {}
        tag, built = ensure_task_image(runtime, cached, cache)
        # The proxy arguments, and the CA's for the steps (ARGs, with the public trust
        # files and the rewritten Dockerfile in the context: build_trust).
        assert built and runtime.build_args[tag] == {**build_proxy_args(), **trust_env()}
        files = runtime.build_context_files[tag]
        assert cached.dockerfile is not None
        assert files.pop("Dockerfile") == rewrite_dockerfile(cached.dockerfile.read_text()).encode()
        assert files == trust_context_files(service.trust_dir)
        assert ensure_task_image(runtime, cached, cache) == (tag, False)
        [(gateway_id, gateway)] = runtime.gateways.items()
        # The build's RUN steps share the gateway's namespace: loopback and the proxy.
        assert runtime.build_networks[tag] == f"container:{gateway_id}"
        spec = gateway.spec
        assert spec.labels[LABEL_KIND] == KIND and spec.network == "none"
        assert [(m.target, m.read_only) for m in spec.mounts] == [(EGRESS_MOUNT, True)]
        assert Path(spec.mounts[0].source, "egress.sock").exists()
        assert any(e.container_id == gateway_id for e in runtime.gateway_execs)  # the forwarder
        assert not gateway.removed
    finally:
        service.close()
    assert gateway.removed
    assert not Path(spec.mounts[0].source).exists()


def test_a_buildkit_only_dockerfile_builds_outside_the_cache(tmp_path: Path) -> None:
    runtime = FakeRuntime()
    service = PackageCacheService(PackageCacheConfig(root=tmp_path / "cache"))
    mounts = "FROM debian:bookworm-slim\nRUN --mount=type=cache,target=/var/cache/apt true\n"
    task = load_task(make_task(tmp_path, "mounts", dockerfile=mounts))
    try:
        tag, built = ensure_task_image(runtime, task, build_cache(service))
        assert built and runtime.build_args[tag] == {} and runtime.build_networks[tag] is None
        assert runtime.gateways == {}
    finally:
        service.close()


@pytest.mark.parametrize(
    ("dockerfile", "context_dir"),
    [
        ("FROM debian:bookworm-slim\nENV SSL_CERT_FILE=/etc/ssl/mine.pem\nRUN x\n", None),
        ("FROM debian:bookworm-slim\nRUN x\n", TRUST_CONTEXT_DIR),
    ],
)
def test_a_build_that_cannot_trust_the_cache_builds_outside_it(
    tmp_path: Path, dockerfile: str, context_dir: str | None
) -> None:
    """An ENV of a CA variable would win over the build argument (its tool would reject
    the cache's certificates); a context with a trust directory of its own would be
    shadowed: both build as without the cache."""
    runtime = FakeRuntime()
    service = PackageCacheService(PackageCacheConfig(root=tmp_path / "cache"))
    root = make_task(tmp_path, "conflict", dockerfile=dockerfile)
    if context_dir is not None:
        (root / "environment" / context_dir).mkdir()
        (root / "environment" / context_dir / "ca-bundle.pem").write_text("the task's own\n")
    try:
        tag, built = ensure_task_image(runtime, load_task(root), build_cache(service))
        assert built and runtime.build_args[tag] == {} and runtime.build_networks[tag] is None
        assert runtime.build_context_files[tag] == {} and runtime.gateways == {}
    finally:
        service.close()


@pytest.mark.parametrize(
    ("dockerfile", "found"),
    [
        ("# syntax=docker/dockerfile:1\nFROM x\n", "the '# syntax=docker/dockerfile:1'"),
        ("FROM x\nRUN --mount=type=secret,id=a cat /run/secrets/a\n", "line 2: RUN --mount"),
        ("FROM x\nRUN \\\n  --network=none true\n", "line 2: RUN --network"),
        ("FROM x AS a\nFROM y\nCOPY --link --from=a /a /a\n", "line 3: COPY --link"),
        ("FROM x\nADD --chmod=644 a /a\n", "line 2: ADD --chmod"),
        ("FROM x\nRUN <<EOF\napt-get update\nEOF\n", "line 2: a heredoc in RUN"),
        ("FROM x\nCOPY <<-'END' /etc/a\nhi\nEND\n", "line 2: a heredoc in COPY"),
    ],
)
def test_buildkit_only_syntax_is_named(dockerfile: str, found: str) -> None:
    reason = buildkit_only_syntax(dockerfile)
    assert reason is not None and reason.startswith(found), reason


@pytest.mark.parametrize(
    "dockerfile",
    [
        "FROM --platform=linux/amd64 debian:bookworm-slim\nRUN apt-get update\n",
        "FROM x\n# RUN --mount=type=cache in a comment\nRUN cat <<< 'here-string'\n",
        "FROM x\nCOPY --from=builder --chown=1:1 /a /a\nRUN echo --mount\n",
        "FROM x\nRUN a \\\n  # comment inside\n  && b --network\n",
    ],
)
def test_legacy_buildable_dockerfiles_pass(dockerfile: str) -> None:
    assert buildkit_only_syntax(dockerfile) is None
