"""Repeated trials of a task that installs packages, through the package cache: the
k-th trial's time and verifier phase against the first's (ratios).

    flock /tmp/docker-tests.lock .venv/bin/python bench/bench_package_cache.py [--trials 4]

The task is the real-Docker test's (tests/test_package_cache_docker.py): its test.sh
runs ``apt-get update && apt-get install``, ``pip install --require-hashes`` and an
HTTPS download, against local upstreams on 127.0.0.1 made to look distant
(``--latency-ms`` before each answer, ``--mbps`` of bandwidth) and artifacts of
``--size-mb``. The first trial fills the cache (every byte from the upstream, as
without a cache); later ones are served from it. Prints each trial's seconds, its
verifier phase, and both as ratios to the first (targets: <= 0.4 per trial, <= 0.3
for the verifier).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harbor_exec.sandbox.docker import DockerRuntime
from harbor_exec.sandbox.egress.ca import LocalCA
from harbor_exec.sandbox.egress.service import PackageCacheConfig, PackageCacheService
from harbor_exec.trial.results import TrialResult
from tests.package_upstream import serve_upstream, sni_context
from tests.test_package_cache_docker import (
    TARBALL,
    Mirror,
    _run,
    _task,
)


def _seconds(result: TrialResult) -> tuple[float, float]:
    assert result.started_at and result.finished_at and result.verifier
    assert result.verifier.started_at and result.verifier.finished_at
    total = (result.finished_at - result.started_at).total_seconds()
    verifier = (result.verifier.finished_at - result.verifier.started_at).total_seconds()
    return total, verifier


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--latency-ms", type=float, default=150.0)
    parser.add_argument("--mbps", type=float, default=4.0, help="megabytes a second")
    parser.add_argument("--size-mb", type=float, default=8.0, help="the HTTPS download's size")
    args = parser.parse_args()
    runtime = DockerRuntime()
    with tempfile.TemporaryDirectory(prefix="hx-bench-pc-") as scratch:
        tmp = Path(scratch)
        upstream_ca = LocalCA(tmp / "public-ca")
        context = sni_context(upstream_ca)
        with serve_upstream(context) as https, serve_upstream() as http:
            mirror = Mirror(https, http, tmp)
            mirror.tarball = os.urandom(int(args.size_mb * 1024 * 1024))
            https.set(TARBALL, mirror.tarball, headers={"Cache-Control": "max-age=3600"})
            for upstream in (https, http):
                upstream.latency_sec = args.latency_ms / 1000
                upstream.bytes_per_sec = args.mbps * 1024 * 1024
            # Room for the download (one object may take a quarter of the bound).
            service = PackageCacheService(
                PackageCacheConfig(
                    root=tmp / "server-cache",
                    max_bytes=max(64, int(args.size_mb * 8)) * 1024 * 1024,
                    upstream_ca_bundle=upstream_ca.cert_path,
                )
            )
            try:
                # The oracle does nothing: every download is the verifier's (test.sh).
                task = _task(tmp, mirror, b"bench", solve="true")
                rows = []
                for index in range(args.trials):
                    result, _dir = _run(runtime, task, tmp / "trials", service, mirror)
                    if result.reward != 1.0:
                        raise SystemExit(f"trial {index + 1}: reward {result.reward}")
                    rows.append(_seconds(result))
            finally:
                service.close()
                runtime.remove_owned()
    first_total, first_verifier = rows[0]
    print(f"{'trial':>5} {'seconds':>8} {'verifier':>9} {'x first':>8} {'verifier x first':>17}")
    for index, (total, verifier) in enumerate(rows, 1):
        print(
            f"{index:>5} {total:8.2f} {verifier:9.2f} {total / first_total:8.2f} "
            f"{verifier / first_verifier:17.2f}"
        )
    later = rows[1:]
    if later:
        worst_total = max(t for t, _ in later) / first_total
        worst_verifier = max(v for _, v in later) / first_verifier
        print(f"worst later trial: {worst_total:.2f}x the first (target <= 0.4)")
        print(f"worst later verifier: {worst_verifier:.2f}x the first (target <= 0.3)")


if __name__ == "__main__":
    main()
