"""A cached ``build_bundle`` call against the cold build it saves, and a 50 ms floor.

    .venv/bin/python bench/bench_bundle_cache.py [--calls 50]

Builds the example project (``tasks_examples/workflow_project``) once cold in a
fresh cache directory (pip against the package index: tens of seconds), then
times ``--calls`` cached calls with the same arguments, each of which must answer
from the cache. Prints the cold time, the cached median and p90, the cached median
as a ratio of the 50 ms target (under 1 passes), and the speed-up over the cold
build.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from harbor_exec.bundler import build_bundle

REPO_ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_DIR = REPO_ROOT / "tasks_examples" / "workflow_project"
EXAMPLE_REFS = {
    "workflow": "arith_agent.workflow:ArithWorkflow",
    "grader": "arith_agent.grader:ArithGrader",
    "workflow_config": "arith_agent.workflow:workflow_config",
    "grader_config": "arith_agent.grader:grader_config",
}
CACHED_TARGET_SEC = 0.050  # a cached call, at the median


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=50, help="cached calls (default 50)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="hx-bench-bundle-") as scratch:
        cache = Path(scratch)
        started = time.perf_counter()
        cold = build_bundle(EXAMPLE_DIR, cache_dir=cache, **EXAMPLE_REFS)
        cold_sec = time.perf_counter() - started
        timings = []
        for _ in range(args.calls):
            started = time.perf_counter()
            again = build_bundle(EXAMPLE_DIR, cache_dir=cache, **EXAMPLE_REFS)
            timings.append(time.perf_counter() - started)
            if not again.cached or again.root != cold.root:
                raise SystemExit("a call with the same arguments did not answer from the cache")
    median = statistics.median(timings)
    p90 = sorted(timings)[int(0.9 * (len(timings) - 1))]
    print(f"cold build     {cold_sec:.2f} s")
    print(f"cached call    median {median * 1000:.2f} ms   p90 {p90 * 1000:.2f} ms")
    target_ms = CACHED_TARGET_SEC * 1000
    print(f"cached/target  {median / CACHED_TARGET_SEC:.2f}x the {target_ms:g} ms target")
    print(f"cold/cached    {cold_sec / median:.0f}x")


if __name__ == "__main__":
    main()
