"""Repeated trials of real public Harbor tasks whose verifiers install packages, through
the package cache, against local upstreams serving the real packages: per task, the
k-th trial's time and verifier phase against the first (cold cache) trial's.

    flock /tmp/docker-tests.lock .venv/bin/python bench/bench_package_corpus.py --prepare  # once
    flock /tmp/docker-tests.lock .venv/bin/python bench/bench_package_corpus.py [--trials 3]

The corpus is ``bench/corpus/`` (sources and every change in its README). Preparation
runs each task's oracle and verifier once with the local upstreams in recording mode:
what apt, pip, uv and curl ask for (``deb.debian.org``, ``pypi.org``,
``files.pythonhosted.org``) is fetched from the real registry on the host and stored in
``--store``; ``astral.sh``'s installer is a stand-in that installs uv from its PyPI wheel
(``bench/package_corpus.py``). The measurement serves only the stored bytes, from
127.0.0.1 under the real names (the egress overrides; DNS off, so nothing else
resolves), made distant: ``--latency-ms`` before every answer and ``--mbps`` per
connection.

The cache runs with its defaults (``PackageCacheConfig()``, as every command has it
with no option): only its store's place and the upstreams' CA (the stand-in for the
public roots) are set. The uncached baseline for time is each task's first trial on an
empty cache (a new cache per task): every byte comes from the upstream through the same
proxy, as without a cache, plus the cost of storing it.

Then each task runs once with the cache off (``--no-off`` skips it), to check that the
cache changes no reward: the task opted out of the cache, allowlisted to the corpus's
names (so that its proxy, now without a cache behind it, reaches the same local
upstreams) and its image trusting the upstreams' CA the way images trust the public
roots (the CA in the system bundle, which pip, uv and curl are pointed at). Its
rewards must equal the cached trials'.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pip

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_package_cache import trial_seconds
from bench.package_corpus import Corpus, serve_corpus
from harbor_exec.network.egress.plan import EgressSettings
from harbor_exec.network.packages.ca import LocalCA
from harbor_exec.network.packages.service import PackageCacheConfig, PackageCacheService
from harbor_exec.network.packages.session import RESULT_FILE
from harbor_exec.sandbox.docker import DockerRuntime
from harbor_exec.sandbox.runtime import LABEL_KIND
from harbor_exec.tasks.task import Task, load_task
from harbor_exec.trial.factory import run_trial
from harbor_exec.trial.policy import SandboxPolicy
from harbor_exec.trial.results import TrialResult
from harbor_exec.trial.spec import TrialSpec
from harbor_exec.trial.trial import TrialRequest, image_tag_for
from tests.package_upstream import sni_context

CORPUS = Path(__file__).resolve().parent / "corpus"
DEFAULT_STORE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / (
    "harbor-exec-bench/package-corpus"
)
HTTPS_NAMES = ("pypi.org", "files.pythonhosted.org", "astral.sh")


def _materialize(root: Path, names: list[str]) -> list[Path]:
    """The corpus tasks under ``root``; the local python:3.11 stand-in has no pip, so a
    Dockerfile that copies one gets this interpreter's (as the docker tests do)."""
    tasks = []
    for name in names:
        target = root / name
        shutil.copytree(CORPUS / name, target)
        if "COPY pip " in (target / "environment" / "Dockerfile").read_text():
            shutil.copytree(
                Path(pip.__file__).parent,
                target / "environment" / "pip",
                ignore=shutil.ignore_patterns("__pycache__"),
            )
        tasks.append(target)
    return tasks


PROFILE_PREAMBLE = "exec 2>&1; PS4='+ $(date +%s.%N) '; set -x\n"


def _profile(task_dir: Path) -> None:
    """Traces every command of ``test.sh`` with a timestamp (``--profile``)."""
    test = task_dir / "tests" / "test.sh"
    lines = test.read_text().splitlines(keepends=True)
    test.write_text(lines[0] + PROFILE_PREAMBLE + "".join(lines[1:]))


def _profile_report(log: Path, top: int = 8) -> str:
    """The slowest commands of a traced ``test.sh`` (time to the next trace line)."""
    marks = []
    for line in log.read_text(errors="replace").splitlines():
        parts = line.split(" ", 2)
        if len(parts) == 3 and parts[0].startswith("+") and parts[1].replace(".", "").isdigit():
            marks.append((float(parts[1]), parts[2][:70]))
    spans = [(b[0] - a[0], a[1]) for a, b in itertools.pairwise(marks)]
    spans.sort(reverse=True)
    return "\n".join(f"    {sec:6.2f} s  {cmd}" for sec, cmd in spans[:top])


SEEN_KEYS = ("host", "path", "status", "bytes", "source", "method", "sec")


def _log(
    log: Path, task: str, trial: int, seen: list[tuple[str, str, int, int, str, str, float]]
) -> None:
    with log.open("a") as out:
        for request in seen:
            record = {"task": task, "trial": trial, **dict(zip(SEEN_KEYS, request, strict=True))}
            out.write(json.dumps(record) + "\n")


def _egress(https_port: int, http_port: int) -> EgressSettings:
    overrides = {name: ("127.0.0.1", https_port) for name in HTTPS_NAMES}
    overrides["deb.debian.org:80"] = ("127.0.0.1", http_port)
    return EgressSettings(overrides=overrides, dns=False)


def _passed(result: TrialResult) -> bool:
    rewards = (result.verifier_result.rewards or {}) if result.verifier_result else {}
    return bool(rewards) and all(float(v) == 1.0 for v in rewards.values())


def _build(runtime: DockerRuntime, task: Task) -> None:
    runtime.ensure_image(
        context_dir=task.environment_dir,
        tag=image_tag_for(task),
        timeout_sec=600,
        labels={LABEL_KIND: "task-env"},
    )


def _trial(
    runtime: DockerRuntime,
    task: Task,
    trials: Path,
    service: PackageCacheService,
    egress: EgressSettings,
) -> tuple[TrialResult, dict[str, int]]:
    result = run_trial(
        runtime,
        TrialRequest(
            TrialSpec(task=task, trials_dir=trials, policy=SandboxPolicy(egress=egress)),
            package_cache=service,
        ),
    )
    trial_dir = trials / result.trial_name
    if not _passed(result):
        log = trial_dir / "verifier" / "test-stdout.txt"
        tail = log.read_text()[-2500:] if log.exists() else ""
        raise SystemExit(
            f"{task.name}: rewards {result.verifier_result}\n{result.exception_info}\n{tail}"
        )
    stats = json.loads((trial_dir / RESULT_FILE).read_text())
    return result, stats


def cache_service(
    root: Path, public_ca: LocalCA, index_fresh_sec: float | None = None
) -> PackageCacheService:
    """A new, empty cache under ``root`` with the defaults, whose upstream TLS is the
    local upstreams' (``index_fresh_sec``: the default unless given)."""
    config = PackageCacheConfig(root=root, upstream_ca_bundle=public_ca.cert_path)
    if index_fresh_sec is not None:
        config = dataclasses.replace(config, index_fresh_sec=index_fresh_sec)
    return PackageCacheService(config)


#: What the uncached copy of a task adds to its image: the upstreams' CA in the system
#: bundle (kept by ``update-ca-certificates``), and the tools pointed at that bundle.
_TRUSTED_IMAGE = """
COPY hx-bench-public-ca.pem /usr/local/share/ca-certificates/hx-bench-public-ca.crt
RUN cd /usr/local/share/ca-certificates \\
    && cat hx-bench-public-ca.crt >> /etc/ssl/certs/ca-certificates.crt
ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt \\
    REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt \\
    CURL_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt \\
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt
"""


def uncached_copy(task_dir: Path, public_ca: LocalCA) -> Path:
    """``task_dir`` as it runs without the cache: opted out, allowlisted to the corpus's
    names in both phases, its image trusting the upstreams' CA."""
    target = task_dir.with_name(task_dir.name + "-uncached")
    shutil.copytree(task_dir, target)
    environment = target / "environment"
    shutil.copy(public_ca.cert_path, environment / "hx-bench-public-ca.pem")
    dockerfile = environment / "Dockerfile"
    dockerfile.write_text(dockerfile.read_text().rstrip("\n") + "\n" + _TRUSTED_IMAGE)
    hosts = json.dumps([*HTTPS_NAMES, "deb.debian.org"])
    allowlist = f'network_mode = "allowlist"\nallowed_hosts = {hosts}\n'
    toml = target / "task.toml"
    text = toml.read_text()
    for table, lines in (
        ("[metadata]", "harbor_exec_package_cache = false\n"),
        ("[verifier]", allowlist),
        ("[environment]", allowlist),
    ):
        assert f"\n{table}\n" in text, f"{toml}: no {table} table"
        text = text.replace(f"\n{table}\n", f"\n{table}\n{lines}", 1)
    toml.write_text(text)
    return target


def uncached_rewards(
    runtime: DockerRuntime, task_dir: Path, public_ca: LocalCA, tmp: Path, egress: EgressSettings
) -> dict[str, float | int]:
    """The rewards of one trial of ``task_dir`` with the cache off."""
    task = load_task(uncached_copy(task_dir, public_ca))
    _build(runtime, task)
    spec = TrialSpec(task=task, trials_dir=tmp / "trials-off", policy=SandboxPolicy(egress=egress))
    result = run_trial(runtime, TrialRequest(spec))
    rewards = (result.verifier_result.rewards if result.verifier_result else None) or {}
    if result.exception_info is not None or not rewards:
        log = tmp / "trials-off" / result.trial_name / "verifier" / "test-stdout.txt"
        tail = log.read_text()[-2500:] if log.exists() else ""
        raise SystemExit(f"{task.name} without the cache: {result.exception_info}\n{tail}")
    if not _passed(result):
        log = tmp / "trials-off" / result.trial_name / "verifier" / "test-stdout.txt"
        print(log.read_text()[-3000:] if log.exists() else "(no test-stdout.txt)")
    return dict(rewards)


def corpus_of(args: argparse.Namespace) -> Corpus:
    """The stored answers (``--store``), made distant unless recording."""
    corpus = Corpus(args.store, record=args.prepare)
    if not args.prepare:
        if not args.store.exists():
            raise SystemExit(f"{args.store}: no recorded packages; run with --prepare first")
        corpus.latency_sec = args.latency_ms / 1000
        corpus.bytes_per_sec = args.mbps * 1024 * 1024
    return corpus


@contextmanager
def upstreams(corpus: Corpus, tmp: Path) -> Iterator[tuple[LocalCA, EgressSettings]]:
    """The local upstreams serving ``corpus`` on 127.0.0.1 (their CA standing in for
    the public roots) and the egress settings that reach them under the real names."""
    public_ca = LocalCA(tmp / "public-ca")
    with serve_corpus(corpus, sni_context(public_ca)) as (https_port, http_port):
        yield public_ca, _egress(https_port, http_port)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options both corpus benches take."""
    parser.add_argument("--store", type=Path, default=DEFAULT_STORE)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--latency-ms", type=float, default=150.0)
    parser.add_argument("--mbps", type=float, default=4.0, help="megabytes a second")
    parser.add_argument("--tasks", nargs="*", help="corpus task names (default: all)")


def task_names(args: argparse.Namespace) -> list[str]:
    return args.tasks or sorted(p.name for p in CORPUS.iterdir() if (p / "task.toml").exists())


def trial_line(name: str, index: int, total: float, verifier: float, stats: dict[str, int]) -> str:
    """One trial's figures, as both corpus benches print them."""
    return (
        f"{name} trial {index + 1}: {total:6.2f} s, verifier {verifier:6.2f} s, hits "
        f"{stats['hits']}, revalidated {stats['revalidated']}, misses {stats['misses']}, "
        f"passthrough {stats['passthrough']}, from upstream "
        f"{stats['upstream_bytes_sent'] / 1e6:.1f} MB"
    )


def ours(
    runtime: DockerRuntime,
    task: Task,
    trials: Path,
    service: PackageCacheService,
    egress: EgressSettings,
    corpus: Corpus,
) -> tuple[TrialResult, float, float, dict[str, int]]:
    """One harbor-exec trial through ``service``: result, seconds, verifier seconds,
    the cache's record plus ``upstream_bytes_sent`` (what the upstreams sent)."""
    before = len(corpus.seen)
    result, stats = _trial(runtime, task, trials, service, egress)
    total, verifier = trial_seconds(result)
    stats["upstream_bytes_sent"] = sum(s[3] for s in corpus.seen[before:])
    return result, total, verifier, stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prepare", action="store_true", help="record the real packages")
    add_arguments(parser)
    parser.add_argument(
        "--index-fresh-sec",
        type=float,
        default=None,
        help="PackageCacheConfig.index_fresh_sec (default: the cache's default)",
    )
    parser.add_argument(
        "--no-off",
        dest="off",
        action="store_false",
        help="skip the trial of each task with the cache off (the rewards' check)",
    )
    parser.add_argument("--profile", action="store_true", help="time test.sh's commands")
    parser.add_argument("--log", type=Path, help="append every upstream request (JSON lines)")
    args = parser.parse_args()
    corpus = corpus_of(args)
    runtime = DockerRuntime()
    rows: dict[str, list[tuple[float, float, dict[str, int]]]] = {}
    rewards: dict[str, tuple[dict[str, float | int], dict[str, float | int]]] = {}
    with tempfile.TemporaryDirectory(prefix="hx-bench-corpus-") as scratch:
        tmp = Path(scratch)
        with upstreams(corpus, tmp) as (public_ca, egress):
            try:
                for path in _materialize(tmp / "tasks", task_names(args)):
                    if args.profile:
                        _profile(path)
                    task = load_task(path)
                    _build(runtime, task)
                    service = cache_service(
                        tmp / "cache" / path.name, public_ca, args.index_fresh_sec
                    )
                    try:
                        for index in range(1 if args.prepare else args.trials):
                            before = len(corpus.seen)
                            result, total, verifier, stats = ours(
                                runtime, task, tmp / "trials", service, egress, corpus
                            )
                            if args.profile:
                                log = (
                                    tmp
                                    / "trials"
                                    / result.trial_name
                                    / "verifier"
                                    / "test-stdout.txt"
                                )
                                print(_profile_report(log), flush=True)
                            if args.log:
                                _log(args.log, path.name, index + 1, corpus.seen[before:])
                            rows.setdefault(path.name, []).append((total, verifier, stats))
                            print(trial_line(path.name, index, total, verifier, stats), flush=True)
                            cached = (
                                result.verifier_result.rewards if result.verifier_result else None
                            )
                    finally:
                        service.close()
                    if args.off and not args.prepare:
                        off = uncached_rewards(runtime, path, public_ca, tmp, egress)
                        rewards[path.name] = (dict(cached or {}), off)
                        print(f"{path.name} with the cache off: rewards {off}", flush=True)
            finally:
                runtime.remove_owned()
    if corpus.refused:
        print("not in the corpus (404):", *sorted(set(corpus.refused))[:20], sep="\n  ")
    if args.prepare:
        print(f"stored {corpus.bytes_stored() / 1e6:.1f} MB under {args.store}")
        return
    _report(rows, args)
    if rewards:
        differ = {name: pair for name, pair in rewards.items() if pair[0] != pair[1]}
        print(
            f"rewards with the cache on and off: {len(rewards) - len(differ)} of "
            f"{len(rewards)} tasks the same"
            + "".join(f"\n  {name}: on {on}, off {off}" for name, (on, off) in differ.items())
        )


def _report(
    rows: dict[str, list[tuple[float, float, dict[str, int]]]], args: argparse.Namespace
) -> None:
    print(
        f"\nlatency {args.latency_ms:g} ms a request, {args.mbps:g} MB/s a connection; "
        f"{args.trials} trials a task, a new cache per task with the defaults"
        + ("" if args.index_fresh_sec is None else f", index_fresh_sec {args.index_fresh_sec:g}")
    )
    print(
        f"{'task':28} {'first s':>8} {'later s':>8} {'ratio':>6} "
        f"{'verif 1st':>9} {'later':>7} {'ratio':>6}"
    )
    totals = []
    verifiers = []
    firsts, laters, vfirsts, vlaters = [], [], [], []
    for name, trials in rows.items():
        first_total, first_verifier, _ = trials[0]
        later_total = statistics.mean(t for t, _, _ in trials[1:])
        later_verifier = statistics.mean(v for _, v, _ in trials[1:])
        totals.append(later_total / first_total)
        verifiers.append(later_verifier / first_verifier)
        firsts.append(first_total)
        laters.append(later_total)
        vfirsts.append(first_verifier)
        vlaters.append(later_verifier)
        print(
            f"{name:28} {first_total:8.2f} {later_total:8.2f} {totals[-1]:6.2f} "
            f"{first_verifier:9.2f} {later_verifier:7.2f} {verifiers[-1]:6.2f}"
        )
    print(
        f"{'all (sums)':28} {sum(firsts):8.2f} {sum(laters):8.2f} {sum(laters) / sum(firsts):6.2f} "
        f"{sum(vfirsts):9.2f} {sum(vlaters):7.2f} {sum(vlaters) / sum(vfirsts):6.2f}"
    )
    print(
        f"worst task: trial {max(totals):.2f}x the first (target <= 0.4), "
        f"verifier {max(verifiers):.2f}x (target <= 0.3)"
    )


if __name__ == "__main__":
    main()
