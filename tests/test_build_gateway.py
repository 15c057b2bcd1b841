"""Builds through the package cache, on the fake runtime: which builds get the proxy
build arguments, and the build gateway container's shape and life (the real engine:
tests/test_build_cache_docker.py)."""

from __future__ import annotations

from pathlib import Path

from harbor_exec.container.forward import main as forward_main
from harbor_exec.sandbox.egress.build_gateway import KIND, build_proxy_args
from harbor_exec.sandbox.egress.container import EGRESS_MOUNT
from harbor_exec.sandbox.egress.service import PackageCacheConfig, PackageCacheService
from harbor_exec.sandbox.runtime import LABEL_KIND
from harbor_exec.trial.task import load_task
from harbor_exec.trial.trial import SandboxPolicy, ensure_task_image
from tests.fake_runtime import FakeRuntime
from tests.task_factory import make_task


def test_the_proxy_build_args_are_dockers_predefined_ones() -> None:
    url = "http://192.0.2.10:3128"
    assert build_proxy_args("192.0.2.10") == {
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
    policy = SandboxPolicy(package_cache=service)
    out = load_task(
        make_task(tmp_path, "out", toml="[metadata]\nharbor_exec_package_cache = false\n")
    )
    cached = load_task(make_task(tmp_path, "in", dockerfile="FROM debian:bookworm-slim\nRUN x\n"))
    try:
        tag, built = ensure_task_image(runtime, out, policy)
        assert built and runtime.build_args[tag] == {}
        assert runtime.containers == {}  # no gateway for a build that does not use it
        tag, built = ensure_task_image(runtime, cached, policy)
        assert built and runtime.build_args[tag] == build_proxy_args("192.0.2.10")
        assert ensure_task_image(runtime, cached, policy) == (tag, False)
        [(gateway_id, gateway)] = runtime.containers.items()
        spec = gateway.spec
        assert spec.labels[LABEL_KIND] == KIND and spec.network == "bridge"
        assert [(m.target, m.read_only) for m in spec.mounts] == [(EGRESS_MOUNT, True)]
        assert Path(spec.mounts[0].source, "egress.sock").exists()
        assert any(e.container_id == gateway_id for e in runtime.execs)  # the forwarder
        assert not gateway.removed
    finally:
        service.close()
    assert gateway.removed
    assert not Path(spec.mounts[0].source).exists()
