"""The package cache with no option given (real engine; issue 36's point 2).

``harbor-exec validate TASK -k 4 -n 1`` of a task whose ``test.sh`` runs
``apt-get update && apt-get install`` against a local mirror stand-in made distant
(150 ms a request, 3 MB/s): the command line names no cache option, yet trials 2-4
fetch from the cache, their verifier phases shorter than the mirror's transfer alone
and typically (their median) at most 0.4x the first's. Meanwhile a
server's cache (what ``serve`` and ``HarborBackend`` start, on by default too) holds
the default store and runs a trial of its own: both use a cache, each its own store,
one CA. The only test-side setting is the network's (the mirror's name mapped to
127.0.0.1, as DNS would), which is no cache option.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import statistics
import threading
from collections.abc import Iterator
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from harbor_exec.backends.harbor.config import SandboxConfig
from harbor_exec.cli.app import app
from harbor_exec.network.egress.plan import EgressSettings
from harbor_exec.network.packages.config import PackageCacheConfig
from harbor_exec.network.packages.service import PackageCacheService
from harbor_exec.network.packages.session import RESULT_FILE
from harbor_exec.sandbox.docker import DockerRuntime
from harbor_exec.tasks.task import load_task
from harbor_exec.trial.factory import run_trial
from harbor_exec.trial.policy import SandboxPolicy
from harbor_exec.trial.results import TrialResult
from harbor_exec.trial.spec import TrialSpec
from harbor_exec.trial.trial import TrialRequest
from tests.package_upstream import AptSigner, Upstream, deb_stanza, release_file, serve_upstream
from tests.task_factory import make_task
from tests.test_package_cache_docker import KEYRING, _deb, apt_preamble

pytestmark = [pytest.mark.docker, pytest.mark.engine_lane]

#: The package's size and the mirror's pace: the first verifier waits on the mirror.
PADDING = 6 * 1024 * 1024
LATENCY_SEC = 0.15
BYTES_PER_SEC = 3 * 1024 * 1024


@pytest.fixture
def mirror(tmp_path: Path, apt_signer: AptSigner) -> Iterator[tuple[Upstream, str]]:
    """A signed apt repository under a path of its own (nothing of it is in any store
    yet, whatever earlier runs left), served slowly on 127.0.0.1."""
    root = f"/debian-{secrets.token_hex(4)}"
    deb = _deb(tmp_path, padding=PADDING)
    pool = f"{root}/pool/main/h/hxdemo/hxdemo_1.0_all.deb"
    control = "Package: hxdemo\nVersion: 1.0\nArchitecture: all\nMaintainer: t <t@t>\n"
    packages = deb_stanza(deb, pool.removeprefix(f"{root}/"), control + "Description: test")
    release = release_file("stable", [("main/binary-amd64/Packages", packages)])
    with serve_upstream() as http:
        http.set(pool, deb)
        http.set(f"{root}/dists/stable/main/binary-amd64/Packages", packages)
        http.set(f"{root}/dists/stable/Release", release)
        http.set(f"{root}/dists/stable/InRelease", apt_signer.inrelease(release))
        http.set(f"{root}/dists/stable/Release.gpg", apt_signer.detached(release))
        http.latency_sec = LATENCY_SEC
        http.bytes_per_sec = BYTES_PER_SEC
        yield http, root


def _task(tmp_path: Path, root: str, keyring: bytes) -> Path:
    test = f"""{apt_preamble(root)}apt-get install -y --no-install-recommends hxdemo || fail apt-get install
grep -q 'from the mirror' /usr/share/hxdemo/ok || fail deb content
echo 1 > /logs/verifier/reward.txt
"""
    task = make_task(
        tmp_path / "tasks",
        f"apt-{root.rsplit('-', 1)[1]}",
        test=test,
        toml="[verifier]\ntimeout_sec = 300.0\n",
        dockerfile=f"FROM python:3.11-slim-bookworm\nCOPY hx-test-repo.gpg {KEYRING}\n",
    )
    (task / "environment" / "hx-test-repo.gpg").write_bytes(keyring)
    return task


def _digest(root: str) -> str:
    """The cache's key of the package (an artifact: its URL alone)."""
    url = f"http://deb.test:80{root}/pool/main/h/hxdemo/hxdemo_1.0_all.deb"
    return hashlib.sha256(f"{url}\n".encode()).hexdigest()


def _verifier_seconds(result: dict[str, Any]) -> float:
    timing = result["verifier"]
    started = datetime.fromisoformat(timing["started_at"])
    return (datetime.fromisoformat(timing["finished_at"]) - started).total_seconds()


def test_validate_uses_the_cache_with_no_option_beside_a_server(
    docker_runtime: DockerRuntime,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    mirror: tuple[Upstream, str],
    apt_signer: AptSigner,
) -> None:
    http, root = mirror
    egress = EgressSettings(overrides={"deb.test:80": ("127.0.0.1", http.port)}, dns=False)
    real_policy = SandboxConfig.policy

    def with_the_mirror(self: SandboxConfig, **kwargs: Any) -> SandboxPolicy:
        return replace(real_policy(self, **kwargs), egress=egress)

    monkeypatch.setattr(SandboxConfig, "policy", with_the_mirror)
    task = _task(tmp_path, root, apt_signer.keyring)

    # A server's cache (HarborBackend's default, as `serve` starts it) holds the default
    # store while validate runs, and a trial of the server's runs at the same time.
    server_cache = PackageCacheService(PackageCacheConfig())
    server_results: list[TrialResult] = []

    def server_trial() -> None:
        policy = SandboxPolicy(egress=egress)
        spec = TrialSpec(load_task(task), tmp_path / "server-trials", policy=policy)
        request = TrialRequest(spec, package_cache=server_cache)
        server_results.append(run_trial(docker_runtime, request))

    beside = threading.Thread(target=server_trial)
    try:
        beside.start()
        ran = CliRunner().invoke(
            app,
            ["validate", str(task), "-k", "4", "-n", "1", "--jobs-dir", str(tmp_path / "jobs")],
            env={"COLUMNS": "200"},
        )
        beside.join(300)
        assert ran.exit_code == 0, ran.output
        # The server's trial used its cache, from its store: validate took another one.
        [server] = server_results
        assert server.reward_valid and server.reward == 1.0, server.exception_info
        server_dir = tmp_path / "server-trials" / server.trial_name
        assert json.loads((server_dir / RESULT_FILE).read_text())["misses"] >= 1
        # The package is in the server's own store (validate's is another one: below).
        server_objects = server_cache.slot.path / "objects"
        assert (server_objects / f"{_digest(root)}.body").stat().st_size >= PADDING
    finally:
        server_cache.close()

    [job] = list((tmp_path / "jobs").iterdir())
    trials = [
        (json.loads((d / "result.json").read_text()), d)
        for d in job.iterdir()
        if d.is_dir() and (d / "result.json").exists()
    ]
    # In the order their agents ran (validate starts the next trials ahead of their slot:
    # the order they began in is not the order they fetched in).
    trials.sort(key=lambda pair: str(pair[0]["agent_execution"]["started_at"]))
    assert len(trials) == 4
    stats = [json.loads((d / RESULT_FILE).read_text()) for _, d in trials]
    # Each trial went through the cache: the first fetched the package, the rest did not.
    assert stats[0]["misses"] >= 1 and stats[0]["bytes_from_upstream"] >= PADDING
    for later in stats[1:]:
        assert later["misses"] == 0 and later["bytes_from_cache"] >= PADDING, later
    # The package crossed from the mirror once for validate (into its store) and once
    # for the server's: nothing the first trial stored was fetched again.
    pool = f"{root}/pool/main/h/hxdemo/hxdemo_1.0_all.deb"
    assert http.count(pool, 200, "GET") == 2
    seconds = [_verifier_seconds(result) for result, _ in trials]
    # The mirror alone needs PADDING / BYTES_PER_SEC for the package: the first verifier
    # waited on it, the later ones finished sooner than the mirror could have sent it
    # (a fixed bound, not a ratio of the first: a loaded machine slows dpkg, not the mirror).
    mirror_sec = PADDING / BYTES_PER_SEC
    assert seconds[0] >= mirror_sec, seconds
    assert all(later < mirror_sec for later in seconds[1:]), seconds
    # And typically at most 0.4x the first (the median: one may share the two cores with
    # the next trial's start ahead of its slot).
    assert statistics.median(seconds[1:]) <= 0.4 * seconds[0], seconds
