"""Containers created and started ahead of the trials that will use them (``WarmPool``).

A trial's container is the same for every rollout of a task but for a few things
bound to the rollout: its name and labels, the egress proxy's and the model relay's
sockets, the forwarder started with it, the files put into it. The pool makes a
container of a task's *template* (the spec a trial of it asked for, without those) in
the background, started with only its init, keep-alive and command server running, and
hands it to the next trial of that task that asks (``claim``). The trial then binds its
rollout's state: the sockets are hard-linked into the directories the warm container
was made with (mounted read-only at the same places a cold one mounts them), its files
are put as for a cold container and the forwarder starts in its first phase. A
container goes to one trial only and is removed with it.

How many to hold: for each task asked for at least twice over the last ``idle_sec``,
the most trials of it that ran at once then (what the executor sees of arrivals; one in
its teardown no longer counts: ``finished``), plus spares for those that arrive while
one container is made (``spares_for``: their rate times how long a make takes); more
when the server says more are coming (``expect``): its rollouts of the task queued for a
trial slot, and the rest of a group whose request named its size
(``metadata.group_size``, as a GRPO step sends a prompt's samples). All within the
operator's bound on containers and on their memory limits summed; a hint counts only
for a task a trial has run of (its template is what the pool makes).
Real trials win: nothing is made while a trial is creating a container of its own or
the engine is away, and a trial never waits for the pool (a miss is the cold path, with
no extra call). An idle container is removed after ``idle_sec``, and all of them when
the pool closes (the engine's reaper removes those of a process that died: they carry
its owner label).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import math
import os
import secrets
import shutil
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, TypeVar

from harbor_exec.container.exchange import RELAY_DIR
from harbor_exec.network.egress.container import EGRESS_MOUNT
from harbor_exec.network.egress.plan import EGRESS_ROOT
from harbor_exec.sandbox.runtime import (
    LABEL_KIND,
    LABEL_ROLLOUT,
    LABEL_TASK,
    LABEL_TRIAL,
    ContainerEngine,
    ContainerSpec,
    Mount,
)

logger = logging.getLogger(__name__)

#: Mounts whose directory is the rollout's own (its relay, its trial's egress proxy):
#: a warm container mounts an empty directory there, filled when a trial claims it.
LATE_BOUND_TARGETS: Final = frozenset({RELAY_DIR, EGRESS_MOUNT})
#: The label that marks a container made ahead of its trial.
LABEL_WARM: Final = "harbor-exec.warm"
#: After a failed make, a template is left alone this long.
_FAILED_BACKOFF_SEC: Final = 10.0
#: How often the pool looks at ages and demand when nothing wakes it.
_TICK_SEC: Final = 1.0
#: A rollout that took its trial slot is still expected this long, until its claim.
_HEADING_SEC: Final = 30.0
#: The weight of the latest make in the pool's moving average of how long one takes.
_MAKE_WEIGHT: Final = 0.3
#: The shortest time over which a template's arrival rate is reckoned.
_RATE_SPAN_SEC: Final = 1.0
#: Spares are held until more arrivals than them during one make are this unlikely.
MISS_CHANCE: Final = 0.1


def spares_for(arrivals: float, *, most: int) -> int:
    """Spare containers for a template whose trials arrive ``arrivals`` times on average
    while one container is made: the fewest that more arrivals than them (Poisson) are
    less likely than ``MISS_CHANCE`` to outnumber; at most ``most``."""
    spares, term = 0, math.exp(-arrivals)
    held = term  # the chance that at most ``spares`` arrive
    while 1.0 - held >= MISS_CHANCE and spares < most:
        spares += 1
        term *= arrivals / spares
        held += term
    return spares


@dataclass(frozen=True)
class WarmSettings:
    """The operator's bounds (``SandboxPolicy.warm_*``)."""

    containers: int = 4  # most warm containers held at once; 0: none
    memory_mb: int = 8192  # most memory their limits may sum to
    idle_sec: float = 60.0  # an idle one is removed after this; demand is remembered as long

    @property
    def enabled(self) -> bool:
        return self.containers > 0


class _Metrics:
    """Process-wide, as the package cache's (every pool of this process adds to them);
    on ``/metrics`` through prometheus-client's default registry."""

    def __init__(self) -> None:
        from prometheus_client import REGISTRY, Counter, Gauge, Histogram  # the server extra

        self.idle = Gauge(
            "harbor_exec_warm_containers", "Warm containers idle now.", registry=REGISTRY
        )
        self.claims = Counter(
            "harbor_exec_warm_claims",
            "Containers trials asked the pool for, by outcome (hit: a warm one).",
            ["outcome"],
            registry=REGISTRY,
        )
        self.claim_seconds = Histogram(
            "harbor_exec_warm_claim_seconds",
            "Time a hit took to hand its warm container over (the sockets bound).",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
            registry=REGISTRY,
        )
        self.idle_seconds = Counter(
            "harbor_exec_warm_idle_container_seconds",
            "Seconds warm containers spent idle (until claimed or removed).",
            registry=REGISTRY,
        )
        self.made = Counter(
            "harbor_exec_warm_made",
            "Warm containers made, by fate (idle, expired, closed, dead).",
            ["fate"],
            registry=REGISTRY,
        )


_T = TypeVar("_T")
_MADE: dict[type, object] = {}
_MADE_LOCK = threading.Lock()


def _once(kind: type[_T]) -> _T | None:
    """This process's one ``kind()`` (its metrics, registered once); None without
    prometheus-client (the server extra)."""
    with _MADE_LOCK:
        if kind not in _MADE:
            try:
                _MADE[kind] = kind()
            except ImportError:
                _MADE[kind] = None
        made = _MADE[kind]
    return made if isinstance(made, kind) else None


def _metrics() -> _Metrics | None:
    """The process's warm-pool metrics (None without prometheus-client)."""
    return _once(_Metrics)


@dataclass(frozen=True)
class WarmStats:
    """One pool's figures (``/health``)."""

    idle: int = 0
    hits: int = 0
    misses: int = 0
    made: int = 0
    expired: int = 0
    idle_container_seconds: float = 0.0
    claim_seconds_p50: float | None = None

    @property
    def hit_rate(self) -> float | None:
        asked = self.hits + self.misses
        return self.hits / asked if asked else None


def summed(stats: Sequence[WarmStats]) -> WarmStats | None:
    """Several pools' figures as one (a Ray cluster's nodes): counts summed, the median
    claim the middle of theirs. None for none."""
    if not stats:
        return None
    claims = sorted(s.claim_seconds_p50 for s in stats if s.claim_seconds_p50 is not None)
    return WarmStats(
        idle=sum(s.idle for s in stats),
        hits=sum(s.hits for s in stats),
        misses=sum(s.misses for s in stats),
        made=sum(s.made for s in stats),
        expired=sum(s.expired for s in stats),
        idle_container_seconds=round(sum(s.idle_container_seconds for s in stats), 3),
        claim_seconds_p50=claims[len(claims) // 2] if claims else None,
    )


class NodeWarmGauges:
    """Each Ray node's warm pool as it last reported it (with each finished trial), in
    the server's ``/metrics``, labelled by node: its pool's figures stay on the node's
    own process otherwise."""

    def __init__(self) -> None:
        from prometheus_client import REGISTRY, Gauge  # the server extra

        self.idle = Gauge(
            "harbor_exec_node_warm_containers",
            "Warm containers idle on a Ray node, as it last reported.",
            ["node"],
            registry=REGISTRY,
        )
        self.claims = Gauge(
            "harbor_exec_node_warm_claims",
            "Containers a Ray node's trials asked its pool for so far, by outcome.",
            ["node", "outcome"],
            registry=REGISTRY,
        )
        self.idle_seconds = Gauge(
            "harbor_exec_node_warm_idle_container_seconds",
            "Seconds a Ray node's warm containers spent idle so far.",
            ["node"],
            registry=REGISTRY,
        )

    def report(self, node: str, stats: WarmStats) -> None:
        self.idle.labels(node).set(stats.idle)
        self.claims.labels(node, "hit").set(stats.hits)
        self.claims.labels(node, "miss").set(stats.misses)
        self.idle_seconds.labels(node).set(stats.idle_container_seconds)


def report_node(node: str, stats: WarmStats) -> None:
    """A Ray node's latest figures into this process's ``/metrics``."""
    gauges = _once(NodeWarmGauges)
    if gauges is not None:
        gauges.report(node, stats)


def template_key(spec: ContainerSpec) -> str:
    """What two trials' containers must share for one to take the other's warm
    container: the whole spec but its name, its trial's labels, the forwarder started
    with it and the sources of the rollout's own mounts."""
    labels = {k: v for k, v in spec.labels.items() if k not in (LABEL_TRIAL, LABEL_ROLLOUT)}
    mounts = [
        Mount("", m.target, m.read_only) if m.target in LATE_BOUND_TARGETS else m
        for m in spec.mounts
    ]
    normal = dataclasses.replace(
        spec, name="", labels=labels, mounts=tuple(mounts), before_keep_alive=()
    )
    return json.dumps(dataclasses.asdict(normal), sort_keys=True, default=str)


@dataclass
class _Warm:
    container_id: str
    key: str
    dirs: dict[str, Path]  # late-bound mount target -> its host directory
    memory_mb: int
    made_at: float


@dataclass
class WarmClaim:
    """A trial's ask for one container: ``container_id`` is a warm, started one (None:
    the trial creates its own); ``WarmPool.release`` it once the container is gone."""

    key: str
    container_id: str | None = None
    warm: _Warm | None = field(default=None, repr=False)
    cold: bool = False  # counted among the trials creating a container now
    running: bool = True  # counted among its template's trials running now
    released: bool = False


@dataclass
class _Group:
    """A group of rollouts of one task whose size the requests named."""

    size: int
    seen: int = 0
    at: float = 0.0  # its last arrival


@dataclass
class _Demand:
    template: ContainerSpec
    running: int = 0
    #: (when, trials of it running then), at each claim: the recent peak is the target.
    samples: deque[tuple[float, int]] = field(default_factory=deque)
    failed_at: float = -1e9


class WarmPool:
    """One engine's warm containers (each executor, each Ray node, its own)."""

    def __init__(self, runtime: ContainerEngine, settings: WarmSettings | None = None) -> None:
        self.runtime = runtime
        self.settings = settings or WarmSettings()
        self._cond = threading.Condition()
        self._idle: dict[str, list[_Warm]] = {}
        self._demand: dict[str, _Demand] = {}
        self._making: dict[str, int] = {}
        self._making_mb = 0
        self._cold_creating = 0
        self._closed = False
        self._thread: threading.Thread | None = None
        self._hits = self._misses = self._made = self._expired = 0
        self._idle_seconds = 0.0
        self._claim_times: deque[float] = deque(maxlen=256)
        #: How long making one container takes lately (a moving average; None: none yet).
        self._make_sec: float | None = None
        self._root: Path | None = None
        self._arrivals: dict[str, list[Arrival]] = {}  # task -> rollouts said coming
        self._groups: dict[tuple[str, str], _Group] = {}  # (task, group id) -> the group

    # ----------------------------------------------------------------- trials

    def claim(self, spec: ContainerSpec, settings: WarmSettings) -> WarmClaim:
        """Note a trial's demand for ``spec``'s template and hand it a warm container of
        it if one is idle, its rollout's sockets bound; never waits for one."""
        key = template_key(spec)
        started = time.monotonic()
        with self._cond:
            if self._closed:
                return WarmClaim(key)
            self.settings = settings
            demand = self._demand.get(key)
            if demand is None:
                demand = self._demand[key] = _Demand(spec)
            demand.template = spec
            demand.running += 1
            if spec.labels.get(LABEL_KIND) == "trial":  # a trial's own (not its verifier's)
                arrivals = self._arrivals.get(spec.labels.get(LABEL_TASK, ""), ())
                heading = [a for a in arrivals if a.heading]
                if heading:  # the oldest on its way from its slot: this claim is its trial's
                    self._arrival_ended(heading[0])
            demand.samples.append((started, demand.running))
            idle = self._idle.get(key) or []
            warm = idle.pop() if idle else None  # the newest: the oldest age out
            if warm is None:
                self._cold_creating += 1
            self._start_filler()
            self._cond.notify_all()
        if warm is None:
            self._count_miss()
            return WarmClaim(key, cold=True)
        claim = WarmClaim(key, warm.container_id, warm)
        self._observe(lambda m: m.idle.dec())
        self._idle_seconds_add(started - warm.made_at)
        if not self._bind(spec, warm):
            # Already out of the idle count: removed as any discarded one is.
            self._discard(warm, started, "dead", counted=False)
            claim.container_id, claim.warm, claim.cold = None, None, True
            with self._cond:
                self._cold_creating += 1
            self._count_miss()
            return claim
        elapsed = time.monotonic() - started
        with self._cond:
            self._hits += 1
            self._claim_times.append(elapsed)
        metrics = _metrics()
        if metrics is not None:
            metrics.claims.labels("hit").inc()
            metrics.claim_seconds.observe(elapsed)
        return claim

    def created(self, claim: WarmClaim) -> None:
        """The trial's own container (a miss) is created and started: fills may go on."""
        with self._cond:
            if claim.cold:
                claim.cold = False
                self._cold_creating -= 1
                self._cond.notify_all()

    def finished(self, claim: WarmClaim) -> None:
        """The claim's trial has its reward (its teardown began): it no longer counts as
        running, as it holds no slot (the next trial may claim while it is removed)."""
        with self._cond:
            if not claim.running:
                return
            claim.running = False
            demand = self._demand.get(claim.key)
            if demand is not None:
                demand.running = max(0, demand.running - 1)

    def release(self, claim: WarmClaim) -> None:
        """The trial is done with the claim's container (the trial removed it)."""
        self.created(claim)
        self.finished(claim)
        with self._cond:
            if claim.released:
                return
            claim.released = True
        if claim.warm is not None:
            _remove_dirs(claim.warm)

    def _bind(self, spec: ContainerSpec, warm: _Warm) -> bool:
        """Hard-link the rollout's sockets (and whatever else its late-bound mounts
        hold) into the warm container's directories; False when one cannot be (another
        filesystem) or the container is gone."""
        try:
            for mount in spec.mounts:
                target_dir = warm.dirs.get(mount.target)
                if target_dir is None:
                    continue
                for entry in os.scandir(mount.source):
                    os.link(entry.path, target_dir / entry.name, follow_symlinks=False)
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                logger.warning("a warm container could not take its trial's sockets: %s", exc)
            return False
        return self.runtime.container_running(warm.container_id)

    @staticmethod
    def _observe(update: Callable[[_Metrics], object]) -> None:
        metrics = _metrics()
        if metrics is not None:
            update(metrics)

    def _count_miss(self) -> None:
        with self._cond:
            self._misses += 1
        self._observe(lambda m: m.claims.labels("miss").inc())

    def _idle_seconds_add(self, seconds: float) -> None:
        with self._cond:
            self._idle_seconds += seconds
        self._observe(lambda m: m.idle_seconds.inc(max(0.0, seconds)))

    # ----------------------------------------------------------------- hints

    def expect(self, task: str, *, queued: bool, group: tuple[str, int] | None = None) -> Arrival:
        """A rollout of ``task`` arrived (the server's). ``queued``: it waits for a
        trial slot; the pool holds a warm container more of the task's templates for it
        until its trial claims one (``Arrival.took_its_slot``, then the claim) or it
        leaves (``Arrival.left``). ``group``: (its group's id, the group's size): the
        rest of the group, not arrived yet, counts as coming for ``idle_sec`` after its
        last arrival."""
        if not queued and group is None:
            return Arrival()  # it runs at once and says nothing of others
        now = time.monotonic()
        arrival = Arrival(self, task)
        if not queued:
            # A group's member that runs at once: it stops counting in the group's rest
            # now, so it counts as on its way until its claim (else what was made for it
            # could be trimmed just before it takes it).
            arrival.heading, arrival._since = True, now
        with self._cond:
            if self._closed:
                return Arrival()
            if group is not None:
                known = self._groups.setdefault((task, group[0]), _Group(group[1]))
                known.seen, known.at = known.seen + 1, now
            self._arrivals.setdefault(task, []).append(arrival)
            self._start_filler()
            self._cond.notify_all()
        return arrival

    def _arrival_ended(self, arrival: Arrival) -> None:
        """``arrival`` left, or its trial claimed: it is coming no more."""
        arrivals = self._arrivals.get(arrival.task, [])
        if arrival in arrivals:
            arrivals.remove(arrival)
        if not arrivals:
            self._arrivals.pop(arrival.task, None)

    def _coming(self, task: str | None, now: float) -> int:
        """Rollouts of ``task`` the server said are coming: queued, on their way from
        their slot to their claim, or the rest of their groups (a group heard of within
        ``idle_sec``)."""
        if task is None:
            return 0
        rest = sum(
            max(0, group.size - group.seen)
            for (of, _id), group in self._groups.items()
            if of == task and now - group.at < self.settings.idle_sec
        )
        arrivals = self._arrivals.get(task, ())
        return rest + sum(1 for a in arrivals if a.coming(now))

    # ----------------------------------------------------------------- filling

    def _start_filler(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._fill_forever, name="warm-pool", daemon=True
            )
            self._thread.start()

    def _target(self, demand: _Demand, now: float) -> int:
        """The most trials of the template at once lately, plus spares for the trials
        that arrive while one container is made (``spares_for``: a refill that takes
        about as long as the gap between arrivals misses every arrival that comes a
        little early); or the rollouts of its task the server says are coming if more.
        Nothing for a template asked for once and not said to come again (a dataset's
        task run once would leave its warm container unused)."""
        window = self.settings.idle_sec
        while demand.samples and demand.samples[0][0] < now - window:
            demand.samples.popleft()
        coming = self._coming(demand.template.labels.get(LABEL_TASK), now)
        if len(demand.samples) < 2:
            return coming
        peak = max(running for _when, running in demand.samples)
        span = demand.samples[-1][0] - demand.samples[0][0]
        during_a_make = 0
        if self._make_sec is not None:
            # Per second over a second at least: claims at one instant are a burst, which
            # the peak counts, not a rate.
            rate = (len(demand.samples) - 1) / max(span, _RATE_SPAN_SEC)
            during_a_make = spares_for(rate * self._make_sec, most=self.settings.containers)
        return max(coming, peak + during_a_make)

    def _next_make(self, now: float) -> tuple[str, ContainerSpec] | None:
        """The template most short of its target, if the bounds allow one more."""
        if self._cold_creating > 0 or not self.settings.enabled:
            return None
        if not self.runtime.engine_available:
            return None  # nothing is made for an engine that is away
        held = sum(map(len, self._idle.values())) + sum(self._making.values())
        if held >= self.settings.containers:
            return None
        held_mb = self._making_mb + sum(w.memory_mb for ws in self._idle.values() for w in ws)
        best: tuple[int, str, ContainerSpec] | None = None
        for key, demand in self._demand.items():
            if now - demand.failed_at < _FAILED_BACKOFF_SEC:
                continue
            short = (
                self._target(demand, now) - len(self._idle.get(key, ())) - self._making.get(key, 0)
            )
            memory = demand.template.memory_mb or 0
            fits = short > 0 and held_mb + memory <= self.settings.memory_mb
            if fits and (best is None or short > best[0]):
                best = (short, key, demand.template)
        return None if best is None else (best[1], best[2])

    def _expired_now(self, now: float) -> list[_Warm]:
        """Idle containers past their age, or of a template no trial asked for lately,
        or beyond a lowered bound: taken out of the pool (the caller removes them)."""
        out: list[_Warm] = []
        for key, idle in list(self._idle.items()):
            demand = self._demand.get(key)
            target = self._target(demand, now) if demand is not None else 0
            keep = [w for w in idle if now - w.made_at < self.settings.idle_sec]
            out += [w for w in idle if w not in keep]
            while len(keep) > target:
                out.append(keep.pop(0))
            if keep:
                self._idle[key] = keep
            else:
                del self._idle[key]
        for key, demand in list(self._demand.items()):
            unused = not demand.samples and demand.running == 0 and key not in self._making
            if unused and not self._coming(demand.template.labels.get(LABEL_TASK), now):
                del self._demand[key]
        for arrivals in list(self._arrivals.values()):
            for arrival in [a for a in arrivals if not a.coming(now)]:
                self._arrival_ended(arrival)  # on its way too long: its trial failed early
        for at, group in list(self._groups.items()):
            if group.seen >= group.size or now - group.at >= self.settings.idle_sec:
                del self._groups[at]
        return out

    def _fill_forever(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                now = time.monotonic()
                expired = self._expired_now(now)
                job = None if expired else self._next_make(now)
                if job is None and not expired:
                    self._cond.wait(_TICK_SEC)
                    continue
                if job is not None:
                    key, template = job
                    self._making[key] = self._making.get(key, 0) + 1
                    self._making_mb += template.memory_mb or 0
            for warm in expired:
                self._discard(warm, now, "expired")
            if job is not None:
                self._make(key, template)

    def _make(self, key: str, template: ContainerSpec) -> None:
        warm: _Warm | None = None
        started = time.monotonic()
        try:
            warm = self._create(key, template)
        except Exception as exc:  # the engine's or the image's: the trials will say it
            logger.warning("a warm container of %s could not be made: %s", template.image, exc)
        took = time.monotonic() - started
        with self._cond:
            if warm is not None:
                last = self._make_sec
                self._make_sec = took if last is None else last + _MAKE_WEIGHT * (took - last)
            self._making[key] -= 1
            if not self._making[key]:
                del self._making[key]
            self._making_mb -= template.memory_mb or 0
            demand = self._demand.get(key)
            if warm is None:
                if demand is not None:
                    demand.failed_at = time.monotonic()
                return
            self._made += 1
            if not self._closed:
                self._idle.setdefault(key, []).append(warm)
                metrics = _metrics()
                if metrics is not None:
                    metrics.idle.inc()
                    metrics.made.labels("idle").inc()
                self._cond.notify_all()
                return
        self._discard(warm, time.monotonic(), "closed", counted=False)

    def _create(self, key: str, template: ContainerSpec) -> _Warm:
        root = self._dirs_root()
        dirs: dict[str, Path] = {}
        mounts: list[Mount] = []
        try:
            for mount in template.mounts:
                if mount.target in LATE_BOUND_TARGETS:
                    directory = Path(tempfile.mkdtemp(prefix="w-", dir=root))
                    directory.chmod(0o755)  # every user of the container reaches the socket
                    dirs[mount.target] = directory
                    mount = Mount(str(directory), mount.target, mount.read_only)
                mounts.append(mount)
            labels = {
                k: v for k, v in template.labels.items() if k not in (LABEL_TRIAL, LABEL_ROLLOUT)
            }
            spec = dataclasses.replace(
                template,
                name=f"hx-warm-{secrets.token_hex(6)}",
                labels={**labels, LABEL_WARM: "true"},
                mounts=tuple(mounts),
                before_keep_alive=(),
            )
            container_id = self.runtime.create(spec)
        except BaseException:
            for directory in dirs.values():
                shutil.rmtree(directory, ignore_errors=True)
            raise
        warm = _Warm(container_id, key, dirs, template.memory_mb or 0, 0.0)
        try:
            # The image's accounts, read (once per image) before anything runs in it: a
            # trial resolves its users against them.
            self.runtime.image_accounts(template.image, container_id)
            self.runtime.start(container_id)
        except BaseException:
            self.runtime.remove(container_id)
            _remove_dirs(warm)
            raise
        warm.made_at = time.monotonic()
        return warm

    def _dirs_root(self) -> Path:
        # Beside the egress proxies' sockets: one filesystem to link from, and the one
        # directory a containerised harbor-exec already shares with the host.
        if self._root is None:
            EGRESS_ROOT.mkdir(mode=0o711, exist_ok=True)
            self._root = EGRESS_ROOT
        return self._root

    def _discard(self, warm: _Warm, now: float, fate: str, *, counted: bool = True) -> None:
        if counted:
            self._observe(lambda m: m.idle.dec())
            with self._cond:
                self._expired += 1
            self._idle_seconds_add(now - warm.made_at)
        self._observe(lambda m: m.made.labels(fate).inc())
        with contextlib.suppress(Exception):  # never fails: the reaper owes what is left
            self.runtime.remove(warm.container_id)
        _remove_dirs(warm)

    # ----------------------------------------------------------------- the rest

    def stats(self) -> WarmStats:
        with self._cond:
            times = sorted(self._claim_times)
            return WarmStats(
                idle=sum(map(len, self._idle.values())),
                hits=self._hits,
                misses=self._misses,
                made=self._made,
                expired=self._expired,
                idle_container_seconds=round(self._idle_seconds, 3),
                claim_seconds_p50=times[len(times) // 2] if times else None,
            )

    def close(self) -> None:
        """Remove every idle container (one being made is removed as it is done)."""
        with self._cond:
            self._closed = True
            idle = [w for ws in self._idle.values() for w in ws]
            self._idle.clear()
            self._cond.notify_all()
            thread = self._thread
        now = time.monotonic()
        for warm in idle:
            self._discard(warm, now, "closed")
        if thread is not None:
            # A make in flight discards its container when it ends (the engine may be
            # away: never hold a shutdown for it; the reaper owes what is left).
            thread.join(timeout=5)


class Arrival:
    """A rollout the server told the pool of (``WarmPool.expect``); without a pool
    (``Arrival()``) its calls do nothing."""

    def __init__(self, pool: WarmPool | None = None, task: str = "") -> None:
        self.pool = pool
        self.task = task
        self.heading = False  # it took its slot: its trial claims next
        self._since = 0.0

    def coming(self, now: float) -> bool:
        """Still expected (the pool's lock held): queued, or on its way to its claim
        for less than ``_HEADING_SEC``."""
        return not self.heading or now - self._since < _HEADING_SEC

    def took_its_slot(self) -> None:
        """It leaves the queue for its trial, whose claim ends it."""
        if self.pool is not None:
            with self.pool._cond:
                if not self.heading:
                    self.heading, self._since = True, time.monotonic()

    def left(self) -> None:
        """It ended before taking a slot (cancelled, refused); nothing after one."""
        if self.pool is not None:
            with self.pool._cond:
                if not self.heading:
                    self.pool._arrival_ended(self)


def _remove_dirs(warm: _Warm) -> None:
    for directory in warm.dirs.values():
        shutil.rmtree(directory, ignore_errors=True)


__all__: Sequence[str] = [
    "LABEL_WARM",
    "LATE_BOUND_TARGETS",
    "Arrival",
    "WarmClaim",
    "WarmPool",
    "WarmSettings",
    "WarmStats",
    "report_node",
    "summed",
    "template_key",
]
