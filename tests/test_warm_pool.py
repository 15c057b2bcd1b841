"""The warm pool's rules on the fake runtime (``harbor_exec.trial.warm``): what it makes,
for whom, within which bounds, and when it lets go. The same on the real engine, through
trials and the served path: ``tests/test_warm_pool_docker.py``."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from harbor_exec.container.exchange import RELAY_DIR
from harbor_exec.sandbox.runtime import LABEL_ROLLOUT, LABEL_TRIAL, ContainerSpec, Mount
from harbor_exec.trial.warm import (
    LABEL_WARM,
    WarmClaim,
    WarmPool,
    WarmSettings,
    spares_for,
    template_key,
)
from tests.fake_runtime import FakeRuntime
from tests.server_utils import wait_until

SETTINGS = WarmSettings(containers=4, memory_mb=8192, idle_sec=30.0)


def spec_for(relay_dir: Path, *, rollout: str = "r-1", memory_mb: int = 512) -> ContainerSpec:
    return ContainerSpec(
        image="harbor-exec/env:abc",
        name=f"hx-{rollout}",
        labels={
            LABEL_TRIAL: f"trial-{rollout}",
            LABEL_ROLLOUT: rollout,
            "harbor-exec.task": "t",
            "harbor-exec.kind": "trial",
        },
        env={"TASK_SETTING": "1"},
        memory_mb=memory_mb,
        mounts=(Mount(str(relay_dir), RELAY_DIR), Mount("/srv/trust", "/etc/trust")),
    )


def relay_dir(tmp_path: Path, name: str) -> Path:
    """A rollout's relay directory with its socket in it, as the executor makes one."""
    directory = tmp_path / name
    directory.mkdir()
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(directory / "relay.sock"))
    sock.close()
    return directory


@pytest.fixture
def runtime() -> FakeRuntime:
    return FakeRuntime(images={"harbor-exec/env:abc"})


@pytest.fixture
def pool(runtime: FakeRuntime) -> Iterator[WarmPool]:
    pool = WarmPool(runtime, SETTINGS)
    yield pool
    pool.close()


def warm_ids(runtime: FakeRuntime) -> list[str]:
    return [
        cid
        for cid, c in runtime.containers.items()
        if LABEL_WARM in c.spec.labels and not c.removed
    ]


def test_the_template_is_the_spec_without_what_belongs_to_a_rollout(tmp_path: Path) -> None:
    one, two = spec_for(tmp_path / "a", rollout="a"), spec_for(tmp_path / "b", rollout="b")
    assert template_key(one) == template_key(two)
    # Everything else counts: the image, the environment, the limits, other mounts.
    assert template_key(one) != template_key(replace(one, env={"TASK_SETTING": "2"}))
    assert template_key(one) != template_key(replace(one, memory_mb=1024))
    assert template_key(one) != template_key(replace(one, image="other"))
    other_mount = replace(one, mounts=(one.mounts[0], Mount("/srv/other", "/etc/trust")))
    assert template_key(one) != template_key(other_mount)


def test_a_miss_then_a_warm_container_carrying_only_the_next_rollouts_socket(
    tmp_path: Path, runtime: FakeRuntime, pool: WarmPool
) -> None:
    first = pool.claim(spec_for(relay_dir(tmp_path, "a"), rollout="a"), SETTINGS)
    assert first.container_id is None and first.cold  # nothing made ahead of the first
    pool.created(first)
    # A task asked for once gets nothing ahead (a dataset's task run once would waste it).
    assert not wait_until(lambda: warm_ids(runtime), timeout=0.3)
    pool.release(first)  # one trial at a time: one container ahead
    again = pool.claim(spec_for(relay_dir(tmp_path, "a2"), rollout="a2"), SETTINGS)
    assert again.container_id is None
    assert warm_ids(runtime) == []  # nothing is made while a trial creates its own
    pool.created(again)
    assert wait_until(lambda: pool.stats().idle == 1)
    (warm_id,) = warm_ids(runtime)
    warm = runtime.containers[warm_id]
    assert warm.running  # started ahead, with only its keep-alive
    # Nothing of a rollout's: no trial or rollout label, no socket yet, no forwarder.
    assert LABEL_ROLLOUT not in warm.spec.labels and LABEL_TRIAL not in warm.spec.labels
    assert warm.spec.before_keep_alive == ()
    warm_relay = {m.target: Path(m.source) for m in warm.spec.mounts}[RELAY_DIR]
    assert list(warm_relay.iterdir()) == []

    second_dir = relay_dir(tmp_path, "b")
    second = pool.claim(spec_for(second_dir, rollout="b"), SETTINGS)
    assert second.container_id == warm_id
    # Its relay directory now holds the second rollout's own socket (the same inode).
    (entry,) = warm_relay.iterdir()
    assert entry.name == "relay.sock"
    assert os.stat(entry).st_ino == os.stat(second_dir / "relay.sock").st_ino
    assert pool.stats().hits == 1 and pool.stats().misses == 2
    pool.release(second)
    assert not warm_relay.exists()  # the claim's directories go with it
    pool.release(again)


def test_a_trial_in_its_teardown_is_not_counted_as_running(
    tmp_path: Path, runtime: FakeRuntime, pool: WarmPool
) -> None:
    """A trial gives its slot back once its reward is read, so with one slot the next
    trial claims while the last one's container is still being removed: the pool sizes
    for the trials running (one), not for the removals (it made two before)."""
    previous: WarmClaim | None = None
    for n in range(4):
        claim = pool.claim(spec_for(relay_dir(tmp_path, f"r{n}"), rollout=f"r{n}"), SETTINGS)
        pool.created(claim)
        if previous is not None:
            pool.release(previous)  # the last trial's container is removed only now
        expected = 1 if n else 0  # the first trial: asked for once, nothing made ahead
        assert wait_until(lambda want=expected: pool.stats().idle == want, timeout=2)
        pool.finished(claim)  # its reward is read: its teardown begins
        previous = claim
    assert not wait_until(lambda: pool.stats().idle > 1, timeout=0.3)
    assert pool.stats().idle == 1 and pool.stats().hits == 2
    assert previous is not None
    pool.release(previous)


def test_the_target_adds_what_arrives_while_one_container_is_made(
    tmp_path: Path, runtime: FakeRuntime, pool: WarmPool
) -> None:
    """The sizing rule: the most trials at once, plus spares for the arrivals while one
    container is made (Poisson at rate times make time: more than the spares under a
    one-in-ten chance)."""
    claim = pool.claim(spec_for(relay_dir(tmp_path, "a"), rollout="a"), SETTINGS)
    pool.created(claim)
    pool.release(claim)
    (demand,) = pool._demand.values()
    now = time.monotonic()
    # Five claims at 4/s, one trial at a time.
    demand.samples.clear()
    demand.samples.extend((now - 1.0 + i * 0.25, 1) for i in range(5))
    pool._make_sec = None
    assert pool._target(demand, now) == 1  # no make timed yet: the peak alone
    pool._make_sec = 0.02  # 0.08 arrivals while one is made: one or more in 7.7%
    assert pool._target(demand, now) == 1
    pool._make_sec = 0.1  # 0.4: one or more in 33%, two or more in 6.2%
    assert pool._target(demand, now) == 2
    pool._make_sec = 0.6  # 2.4: five or more in 9.6%
    assert pool._target(demand, now) == 5
    assert spares_for(2.4, most=3) == 3  # never beyond the pool's bound
    assert spares_for(0.0, most=4) == 0
    # Claims at one instant are a burst (the peak counts them), not a rate.
    demand.samples.clear()
    demand.samples.extend([(now, 1), (now + 1e-6, 2)])
    assert pool._target(demand, now) == 2 + spares_for(0.6, most=4)


def test_arrivals_that_come_early_still_find_a_warm_container(
    tmp_path: Path, runtime: FakeRuntime
) -> None:
    """A make takes 0.15 s (the engine's create and start, simulated) and a task's trials
    come at 4/s on average, every other one 0.03 s after the last: the pool holds one more
    than run at once, so the early ones hit too (holding what ran at once, one, every
    early arrival missed: its container was still being made)."""
    create = runtime.create

    def slow_create(spec: ContainerSpec) -> str:
        time.sleep(0.15)
        return create(spec)

    runtime.create = slow_create  # type: ignore[method-assign]
    pool = WarmPool(runtime, SETTINGS)
    hits: list[bool] = []
    try:
        for n in range(16):
            claim = pool.claim(spec_for(relay_dir(tmp_path, f"r{n}"), rollout=f"r{n}"), SETTINGS)
            hits.append(claim.container_id is not None)
            pool.created(claim)
            pool.finished(claim)
            pool.release(claim)
            time.sleep(0.03 if n % 2 == 0 else 0.47)  # the arrivals' schedule
    finally:
        pool.close()
    assert hits[8:].count(False) <= 1, hits


def test_a_container_goes_to_one_trial_only(
    tmp_path: Path, runtime: FakeRuntime, pool: WarmPool
) -> None:
    claims = []
    handed: list[str] = []
    for n in range(6):
        claim = pool.claim(spec_for(relay_dir(tmp_path, f"r{n}"), rollout=f"r{n}"), SETTINGS)
        claims.append(claim)
        if claim.container_id is not None:
            handed.append(claim.container_id)
        pool.created(claim)
        wait_until(lambda: pool.stats().idle >= 1, timeout=2)
    assert len(handed) >= 4 and len(set(handed)) == len(handed)
    for claim in claims:
        pool.release(claim)


def test_the_pool_holds_no_more_than_its_bounds(tmp_path: Path, runtime: FakeRuntime) -> None:
    pool = WarmPool(runtime, SETTINGS)
    try:
        tight = WarmSettings(containers=2, memory_mb=8192, idle_sec=30.0)
        # Four trials of the task at once: the target is 4, the bound 2.
        claims = [
            pool.claim(spec_for(relay_dir(tmp_path, f"r{n}"), rollout=f"r{n}"), tight)
            for n in range(4)
        ]
        for claim in claims:
            pool.created(claim)
        assert wait_until(lambda: pool.stats().idle == 2)
        assert not wait_until(lambda: pool.stats().idle > 2, timeout=0.3)
        # A memory bound below two containers' limits: a hit leaves one idle, none is made.
        hit = pool.claim(
            spec_for(relay_dir(tmp_path, "m"), rollout="m"), replace(tight, memory_mb=600)
        )
        assert hit.container_id is not None
        assert not wait_until(lambda: pool.stats().idle > 1, timeout=0.3)
        assert pool.stats().idle == 1
    finally:
        pool.close()


def test_idle_containers_age_out_and_go_when_the_pool_closes(
    tmp_path: Path, runtime: FakeRuntime
) -> None:
    pool = WarmPool(runtime, SETTINGS)
    short = WarmSettings(containers=4, memory_mb=8192, idle_sec=2.0)
    claims = [pool.claim(spec_for(relay_dir(tmp_path, f"a{n}")), short) for n in range(2)]
    for claim in claims:
        pool.created(claim)
    assert wait_until(lambda: pool.stats().idle >= 1)
    assert wait_until(lambda: pool.stats().idle == 0, timeout=15)  # aged out
    made = [cid for cid, c in runtime.containers.items() if LABEL_WARM in c.spec.labels]
    # Out of the pool first, then removed (outside its lock): wait for the removal.
    assert made and wait_until(lambda: all(runtime.containers[cid].removed for cid in made))
    assert pool.stats().expired >= 1 and pool.stats().idle_container_seconds > 0
    for claim in claims:
        pool.release(claim)

    # Closing removes what is idle, and whatever the pool was still making.
    for n in range(2):
        again = pool.claim(spec_for(relay_dir(tmp_path, f"b{n}"), rollout=f"b{n}"), SETTINGS)
        pool.created(again)
    assert wait_until(lambda: pool.stats().idle >= 1)
    pool.close()
    assert warm_ids(runtime) == []
    assert (
        pool.claim(spec_for(relay_dir(tmp_path, "c"), rollout="c"), SETTINGS).container_id is None
    )


def test_a_warm_container_that_died_is_never_handed_over(
    tmp_path: Path, runtime: FakeRuntime, pool: WarmPool
) -> None:
    firsts = [pool.claim(spec_for(relay_dir(tmp_path, f"a{n}")), SETTINGS) for n in range(2)]
    for first in firsts:
        pool.created(first)
    assert wait_until(lambda: pool.stats().idle == 2)
    assert not wait_until(lambda: pool.stats().idle > 2, timeout=0.2)
    for warm_id in warm_ids(runtime):
        runtime.containers[warm_id].running = False  # its init was killed, or the engine restarted
    dead = warm_ids(runtime)
    second = pool.claim(spec_for(relay_dir(tmp_path, "b"), rollout="b"), SETTINGS)
    assert second.container_id is None and second.cold
    assert sum(runtime.containers[cid].removed for cid in dead) == 1
    for claim in [*firsts, second]:
        pool.release(claim)


def test_off_makes_nothing(tmp_path: Path, runtime: FakeRuntime, pool: WarmPool) -> None:
    off = WarmSettings(containers=0)
    claim = pool.claim(spec_for(relay_dir(tmp_path, "a")), off)
    pool.created(claim)
    assert not wait_until(lambda: runtime.containers, timeout=0.3)
    pool.release(claim)


def test_a_served_task_takes_warm_containers_and_health_says_so(tmp_path: Path) -> None:
    """Behind the real server (fake engine): the first two rollouts of a task are cold,
    the next ones take the container the pool made meanwhile, each its own; ``/health``
    counts them and nothing of the pool is left once the server stops."""
    import asyncio

    import httpx

    from harbor_exec.client import RolloutClient
    from tests.server_utils import CHAT_URL, PROMPT
    from tests.test_harbor_backend_fake import served

    runtime = FakeRuntime()

    async def three(url: str) -> dict[str, object]:
        async with httpx.AsyncClient(timeout=30) as http:
            client = RolloutClient(url=url, http_client=http)
            for n in range(4):
                result = await client.run_rollout(PROMPT, CHAT_URL, rollout_id=f"w-{n}")
                assert result.status == "success", result
                if n >= 1:  # asked for twice: the next one's container is made ahead
                    await asyncio.to_thread(wait_until, lambda: warm_ids(runtime) != [])
            health: dict[str, object] = (await http.get(f"{url}/health")).json()
            return health

    with served(tmp_path, runtime) as (_backend, url):
        health = asyncio.run(three(url))
    figures = health["warm_containers"]
    assert isinstance(figures, dict)
    assert figures["hits"] == 2 and figures["misses"] == 2, figures
    solved_in = [e.container_id for e in runtime.execs if "/solution/solve.sh" in e.script]
    assert len(set(solved_in)) == 4  # one container per trial
    assert sum(LABEL_WARM in runtime.containers[cid].spec.labels for cid in solved_in) == 2
    assert all(c.removed for c in runtime.containers.values())  # after the server stopped


def test_a_clusters_pools_sum_to_one_figure() -> None:
    """A Ray cluster's nodes each report their pool; ``/health`` shows their sum."""
    from harbor_exec.trial.warm import WarmStats, summed

    assert summed([]) is None
    total = summed(
        [
            WarmStats(idle=1, hits=3, misses=1, made=4, idle_container_seconds=1.5,
                      claim_seconds_p50=0.002),
            WarmStats(idle=2, hits=0, misses=2, made=2, expired=1, idle_container_seconds=0.25),
            WarmStats(idle=0, hits=5, misses=0, made=5, claim_seconds_p50=0.004),
        ]
    )  # fmt: skip
    assert total == WarmStats(
        idle=3, hits=8, misses=3, made=11, expired=1, idle_container_seconds=1.75,
        claim_seconds_p50=0.004,
    )  # fmt: skip
    assert total is not None and total.hit_rate == 8 / 11


def test_rollouts_queued_for_a_task_get_containers_made_while_they_wait(
    tmp_path: Path, runtime: FakeRuntime, pool: WarmPool
) -> None:
    first = pool.claim(spec_for(relay_dir(tmp_path, "a"), rollout="a"), SETTINGS)
    pool.created(first)
    pool.release(first)  # asked for once: nothing ahead, unless the server says more come
    assert not wait_until(lambda: warm_ids(runtime), timeout=0.3)
    waiting = [pool.expect("t", queued=True) for _ in range(3)]
    assert wait_until(lambda: pool.stats().idle == 3)
    # The first takes its slot: its trial's claim is a hit, and it is coming no more.
    waiting[0].took_its_slot()
    hit = pool.claim(spec_for(relay_dir(tmp_path, "b"), rollout="b"), SETTINGS)
    assert hit.container_id is not None and hit.container_id in warm_ids(runtime)
    pool.release(hit)
    # The other two leave (cancelled while queued): what was made for them goes, down to
    # the task's own recent peak (one at a time: one).
    waiting[1].left()
    waiting[2].left()
    waiting[2].left()  # idempotent
    assert wait_until(lambda: pool.stats().idle == 1)
    assert pool.stats().hits == 1


def test_a_group_that_names_its_size_gets_its_rest_made_ahead(
    tmp_path: Path, runtime: FakeRuntime, pool: WarmPool
) -> None:
    # A hint for a task no trial ran (its template unknown) makes nothing.
    pool.expect("another", queued=True, group=("g", 8)).left()
    assert not wait_until(lambda: warm_ids(runtime), timeout=0.3)
    first = pool.claim(spec_for(relay_dir(tmp_path, "a"), rollout="a"), SETTINGS)
    pool.created(first)
    pool.release(first)
    # The group's first member runs now (not queued) and claims: its three others are
    # coming, and each member counts until its own claim.
    pool.expect("t", queued=False, group=("step-7/prompt-3", 4))
    lead = pool.claim(spec_for(relay_dir(tmp_path, "lead"), rollout="lead"), SETTINGS)
    pool.created(lead)
    assert wait_until(lambda: pool.stats().idle == 3)
    taken = [lead]
    for n in range(3):
        pool.expect("t", queued=False, group=("step-7/prompt-3", 4))
        claim = pool.claim(spec_for(relay_dir(tmp_path, f"g{n}"), rollout=f"g{n}"), SETTINGS)
        assert claim.container_id is not None, n
        taken.append(claim)
    made_ahead = {c.container_id for c in taken[1:]}
    assert len(made_ahead) == 3 and lead.container_id not in made_ahead
    for claim in taken:
        pool.release(claim)


def test_the_group_size_is_read_from_the_requests_metadata() -> None:
    from harbor_exec.protocol import group_hint, group_of

    assert group_hint({"group_id": "p-1", "group_size": 8}) == ("p-1", 8)
    assert group_of({"group": 17}) == "17" and group_hint({"group": 17, "group_size": 2}) == (
        "17",
        2,
    )
    # No group named, a size below two, not a whole number: no hint; a huge one is capped.
    assert group_hint({"group_size": 8}) is None
    assert group_hint({"group_id": "p", "group_size": 1}) is None
    assert group_hint({"group_id": "p", "group_size": "8"}) is None
    assert group_hint({"group_id": "p", "group_size": True}) is None
    assert group_hint({"group_id": "p", "group_size": 10**9}) == ("p", 1024)
    assert group_hint({"group_id": "p"}) is None
    assert group_hint(None) is None


def test_a_served_task_warms_for_its_queue_and_its_group(tmp_path: Path) -> None:
    """Behind the real server (fake engine), one trial slot: while the first rollout
    runs, the two queued behind it get containers made for them (each a hit, where the
    task's recent peak alone would have made none); then a group naming its size gets
    its other members' containers made once its first ran (the peak alone: one)."""
    import asyncio

    import httpx

    from harbor_exec.client import RolloutClient
    from tests.server_utils import CHAT_URL, PROMPT
    from tests.test_harbor_backend_fake import held_runtime, served, wait_held, wait_queued

    runtime = held_runtime()

    async def scenario(backend: object, url: str) -> dict[str, object]:
        async with httpx.AsyncClient(timeout=30) as http:
            client = RolloutClient(url=url, http_client=http)

            def rollout(rid: str, **metadata: object) -> asyncio.Task[object]:
                return asyncio.create_task(
                    client.run_rollout(PROMPT, CHAT_URL, rollout_id=rid, metadata=metadata)
                )

            first = rollout("q-0")
            await wait_held(runtime, 1)
            queued = [rollout(f"q-{n}") for n in range(1, 3)]
            await wait_queued(backend, 2)  # type: ignore[arg-type]
            # Made for the two queued (the task's memory limit is 4096 MB, the pool's
            # bound 8192 MB), where the task's one claim so far would have made none.
            assert await asyncio.to_thread(wait_until, lambda: len(warm_ids(runtime)) == 2)
            runtime.gate.open()
            for done in await asyncio.gather(first, *queued):
                assert getattr(done, "status", None) == "success", done
            # A group of three: its first runs alone, the other two arrive together.
            lead = await rollout("g-0", group_id="step-1/p-9", group_size=3)
            assert getattr(lead, "status", None) == "success", lead
            # Two made for the group's other two (the task's peak alone: one).
            assert await asyncio.to_thread(wait_until, lambda: len(warm_ids(runtime)) == 2)
            rest = [rollout(f"g-{n}", group_id="step-1/p-9", group_size=3) for n in (1, 2)]
            for done in await asyncio.gather(*rest):
                assert getattr(done, "status", None) == "success", done
            health: dict[str, object] = (await http.get(f"{url}/health")).json()
            return health

    with served(tmp_path, runtime, max_concurrent_trials=1) as (backend, url):
        health = asyncio.run(scenario(backend, url))
    figures = health["warm_containers"]
    assert isinstance(figures, dict)
    # One trial at a time, in this order: q-0, q-1, q-2, g-0, then g-1 and g-2. The
    # queued ones and the group's rest each ran in a container made ahead for them.
    solved_in = [e.container_id for e in runtime.execs if "/solution/solve.sh" in e.script]
    assert len(solved_in) == len(set(solved_in)) == 6  # one container per trial
    warm = [LABEL_WARM in runtime.containers[cid].spec.labels for cid in solved_in]
    assert warm[1:3] == [True, True] and warm[4:] == [True, True], warm
    assert figures["hits"] >= 4, figures
    assert all(c.removed for c in runtime.containers.values())
