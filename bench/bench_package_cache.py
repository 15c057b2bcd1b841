"""Repeated trials of a task that installs packages, through the package cache: the
k-th trial's time and verifier phase against the first's (ratios).

    flock /tmp/docker-tests.lock .venv/bin/python bench/bench_package_cache.py [--trials 4]

The task is the real-Docker test's (tests/test_package_cache_docker.py): its test.sh
runs ``apt-get update && apt-get install`` (curl too), ``pip install``, ``uv`` and an
HTTPS download, against local upstreams on 127.0.0.1 made to look distant
(``--latency-ms`` before each answer, ``--mbps`` of bandwidth) and artifacts of
``--size-mb``. The first trial fills the cache (every byte from the upstream, as
without a cache); later ones are served from it. Prints each trial's seconds, its
verifier phase, and both as ratios to the first (targets: <= 0.4 per trial, <= 0.3
for the verifier).

    flock /tmp/docker-tests.lock .venv/bin/python bench/bench_package_cache.py --prewarm 20

Cold prewarm of ``--prewarm`` tasks sharing a base (debian:bookworm-slim) and an apt
package of ``--deb-mb`` (tests/test_build_cache_docker.py's tasks: each build runs
``apt-get update && apt-get install`` against the local mirror), once through the
package cache and once without it (the same build gateway and proxy, straight to the
upstream), each cold (new images, empty cache); prints both and the ratio (target
<= 0.6).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harbor_exec.jobs.prewarm import prewarm_tasks
from harbor_exec.network.egress.proxy import DirectUpstream
from harbor_exec.network.packages.build_gateway import BuildGateway
from harbor_exec.network.packages.ca import LocalCA
from harbor_exec.network.packages.service import PackageCacheConfig, PackageCacheService
from harbor_exec.sandbox.docker import DockerRuntime
from harbor_exec.sandbox.runtime import LABEL_KIND
from harbor_exec.tasks.task import Task
from harbor_exec.trial.results import TrialResult
from harbor_exec.trial.trial import image_tag_for
from tests.package_upstream import Upstream, serve_upstream, sni_context
from tests.test_build_cache_docker import build_tasks
from tests.test_package_cache_docker import (
    TARBALL,
    Mirror,
    _egress,
    _run,
    _task,
)


def trial_seconds(result: TrialResult) -> tuple[float, float]:
    """A trial's wall time and its verifier phase's (bench_package_corpus too)."""
    assert result.started_at and result.finished_at and result.verifier
    verifier = result.verifier.seconds
    assert verifier is not None
    return (result.finished_at - result.started_at).total_seconds(), verifier


def _service(tmp: Path, upstream_ca: LocalCA, object_mb: float) -> PackageCacheService:
    """A cold cache with room for an object of ``object_mb`` (one object may take a
    quarter of the bound)."""
    return PackageCacheService(
        PackageCacheConfig(
            root=tmp / "server-cache",
            max_bytes=max(64, int(object_mb * 8)) * 1024 * 1024,
            upstream_ca_bundle=upstream_ca.cert_path,
        )
    )


def _distant(upstreams: tuple[Upstream, ...], args: argparse.Namespace) -> None:
    for upstream in upstreams:
        upstream.latency_sec = args.latency_ms / 1000
        upstream.bytes_per_sec = args.mbps * 1024 * 1024


def _remove_images(runtime: DockerRuntime, tasks: list[Task]) -> None:
    for task in tasks:
        if runtime.image_exists(image_tag_for(task)):
            runtime.remove_image(image_tag_for(task))


def _cold_prewarm(runtime: DockerRuntime, args: argparse.Namespace) -> None:
    """Cold prewarm of ``args.prewarm`` tasks, with and without the cache."""
    with tempfile.TemporaryDirectory(prefix="hx-bench-pcb-") as scratch:
        tmp = Path(scratch)
        upstream_ca = LocalCA(tmp / "public-ca")
        with serve_upstream(sni_context(upstream_ca)) as https, serve_upstream() as http:
            mirror = Mirror(https, http, tmp, deb_padding=int(args.deb_mb * 1024 * 1024))
            _distant((https, http), args)
            egress = _egress(mirror)
            seconds: dict[str, float] = {}
            for mode in ("without", "with"):
                tasks = build_tasks(tmp / mode, uuid.uuid4().hex, args.prewarm)
                started = time.monotonic()
                try:
                    if mode == "with":
                        service = _service(tmp, upstream_ca, args.deb_mb)
                        try:
                            outcomes = prewarm_tasks(
                                runtime, tasks, jobs=args.jobs, package_cache=service, egress=egress
                            )
                        finally:
                            service.close()
                        failed = [o.reason for o in outcomes if o.status != "built"]
                        if failed:
                            raise SystemExit(f"prewarm through the cache: {failed[0]}")
                    else:
                        gateway = BuildGateway(
                            runtime, DirectUpstream(), overrides=egress.overrides, dns=False
                        )
                        try:
                            for task in tasks:
                                runtime.ensure_image(
                                    context_dir=task.environment_dir,
                                    tag=image_tag_for(task),
                                    timeout_sec=600,
                                    labels={LABEL_KIND: "task-env"},
                                    **gateway.route.build_options(),
                                )
                        finally:
                            gateway.close()
                    seconds[mode] = time.monotonic() - started
                finally:
                    _remove_images(runtime, tasks)
            debs = http.count("/debian/pool/main/h/hxdemo/hxdemo_1.0_all.deb", 200, "GET")
    print(f"cold prewarm of {args.prewarm} tasks, a {args.deb_mb:g} MB package each")
    print(f"without the cache: {seconds['without']:7.2f} s")
    print(f"with the cache:    {seconds['with']:7.2f} s")
    print(f"package downloads from the upstream: {debs} ({args.prewarm} without + 1 with)")
    ratio = seconds["with"] / seconds["without"]
    print(f"ratio: {ratio:.2f}x (target <= 0.6)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--latency-ms", type=float, default=150.0)
    parser.add_argument("--mbps", type=float, default=4.0, help="megabytes a second")
    parser.add_argument("--size-mb", type=float, default=8.0, help="the HTTPS download's size")
    parser.add_argument(
        "--prewarm", type=int, default=0, help="cold prewarm of this many tasks, +/- cache"
    )
    parser.add_argument("--deb-mb", type=float, default=8.0, help="with --prewarm")
    parser.add_argument("--jobs", type=int, default=2, help="with --prewarm: builds at once")
    args = parser.parse_args()
    runtime = DockerRuntime()
    if args.prewarm:
        try:
            _cold_prewarm(runtime, args)
        finally:
            runtime.remove_owned()
        return
    with tempfile.TemporaryDirectory(prefix="hx-bench-pc-") as scratch:
        tmp = Path(scratch)
        upstream_ca = LocalCA(tmp / "public-ca")
        context = sni_context(upstream_ca)
        with serve_upstream(context) as https, serve_upstream() as http:
            mirror = Mirror(https, http, tmp)
            mirror.tarball = os.urandom(int(args.size_mb * 1024 * 1024))
            https.set(TARBALL, mirror.tarball, headers={"Cache-Control": "max-age=3600"})
            _distant((https, http), args)
            service = _service(tmp, upstream_ca, args.size_mb)
            try:
                # The oracle does nothing: every download is the verifier's (test.sh).
                task = _task(tmp, mirror, b"bench", solve="true")
                rows = []
                for index in range(args.trials):
                    result, _dir = _run(runtime, task, tmp / "trials", service, mirror)
                    if result.reward != 1.0:
                        raise SystemExit(f"trial {index + 1}: reward {result.reward}")
                    rows.append(trial_seconds(result))
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
