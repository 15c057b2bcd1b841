"""``RayExecutor`` on a real multi-node Ray cluster on this machine.

Ray advertises the machine's interface address even when told 127.0.0.1, so the
cluster, the ``serve --ray`` servers and their clients run inside a network
namespace with only loopback up (created here, deleted at the end); the Docker
engine is reached through its unix socket. One cluster per module: a head without
trial slots and two workers with ``harbor_exec_trial`` slots (``tests/ray_cluster.py``),
all sharing the local Docker engine. Without Ray or Docker these tests fail.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import pytest

from harbor_exec.backends.harbor.planner import prepare_bundle
from harbor_exec.sandbox.docker import DockerRuntime
from harbor_exec.sandbox.runtime import LABEL_OWNER, LABEL_ROLLOUT

ROOT = Path(__file__).resolve().parents[1]
DATASET = ROOT / "tasks_examples" / "dataset"
TEMPLATE = ROOT / "tasks_examples" / "template"
PROJECT = ROOT / "tasks_examples" / "workflow_project"
#: osmosis-ai's layout: workflow, grader and both configs in one module.
ONE_MODULE_PROJECT = ROOT / "tasks_examples" / "osmosis_one_module_project"
ONE_MODULE = "one_arith.main"
KEY = "sk-ray-secret-" + uuid.uuid4().hex

# engine_lane: its cluster runs its own tasks and counts only its own containers.
pytestmark = [
    pytest.mark.docker,
    pytest.mark.ray,
    pytest.mark.engine_lane("b"),  # the third lane (conftest.py): the lanes end together
    pytest.mark.usefixtures("base_images"),
]


def _read_json_line(stream: IO[str], timeout: float) -> dict[str, Any]:
    selector = selectors.DefaultSelector()
    selector.register(stream, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if selector.select(timeout=max(0.0, deadline - time.monotonic())):
            line = stream.readline()
            if not line:
                raise AssertionError("the process ended before answering")
            if line.startswith("{"):
                return dict(json.loads(line))
    raise AssertionError(f"no answer within {timeout:g}s")


@dataclass
class RayCluster:
    netns: str
    process: subprocess.Popen[str]
    address: str
    nodes: list[str]
    session: str
    servers: list[subprocess.Popen[str]] = field(default_factory=list)

    def run(self, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *argv]

    def command(self, line: str, timeout: float = 60) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()
        return _read_json_line(self.process.stdout, timeout)

    def serve(self, tmp: Path, *args: str) -> str:
        """Start ``serve --ray`` in the namespace; returns its URL once it answers."""
        port = 18000 + len(self.servers) + (os.getpid() % 500) * 8
        server = subprocess.Popen(
            self.run(
                sys.executable,
                "-m",
                "harbor_exec.cli",
                "serve",
                "--ray",
                self.address,
                "--port",
                str(port),
                "--trials-dir",
                str(tmp / "trials"),
                "--artifact-root",
                str(tmp / "sa"),
                *args,
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "HARBOR_EXEC_DATA_DIR": str(tmp / "data")},
        )
        self.servers.append(server)
        assert server.stdout is not None
        deadline = time.monotonic() + 180
        seen: list[str] = []
        while time.monotonic() < deadline:
            line = server.stdout.readline()
            if not line:
                raise AssertionError("serve --ray exited:\n" + "".join(seen))
            seen.append(line)
            if "Uvicorn running" in line or "Application startup complete" in line:
                return f"http://127.0.0.1:{port}"
        raise AssertionError("serve --ray never started:\n" + "".join(seen))

    def client(
        self,
        url: str,
        rollouts: list[dict[str, Any]],
        timeout: float = 240,
        script: list[str] | None = None,
    ) -> Any:
        spec = json.dumps({"url": url, "key": KEY, "rollouts": rollouts, "script": script})
        done = subprocess.run(
            self.run(sys.executable, "-m", "tests.ray_client", spec),
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert done.returncode == 0, done.stderr[-4000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    def http(self, method: str, url: str, body: Any = None) -> tuple[int, str]:
        """One request from inside the namespace: (status, body text)."""
        script = (
            "import httpx, json, sys\n"
            "body = json.loads(sys.argv[3])\n"
            "r = httpx.request(sys.argv[1], sys.argv[2], json=body, timeout=30)\n"
            "print(json.dumps([r.status_code, r.text]))\n"
        )
        done = subprocess.run(
            self.run(sys.executable, "-c", script, method, url, json.dumps(body)),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        status, text = json.loads(done.stdout.strip().splitlines()[-1])
        return int(status), str(text)

    def stop_servers(self) -> None:
        for server in self.servers:
            if server.poll() is None:
                server.send_signal(signal.SIGTERM)
        for server in self.servers:
            try:
                server.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
        self.servers.clear()


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[RayCluster]:
    try:
        import ray  # noqa: F401
    except ImportError as exc:
        pytest.fail(f"these tests need Ray (pip install -e '.[dev]'): {exc}", pytrace=False)
    # The namespace has no way out: the example project's bundle (pip fetches its
    # dependencies' wheels) is built here first, into the cache serve then reuses.
    prepare_bundle(
        "arith_agent.workflow:ArithWorkflow",
        grader="arith_agent.grader:ArithGrader",
        workflow_config="arith_agent.workflow:workflow_config",
        grader_config="arith_agent.grader:grader_config",
        code_dir=PROJECT,
    )
    prepare_bundle(
        f"{ONE_MODULE}:ArithWorkflow",
        grader=f"{ONE_MODULE}:ArithGrader",
        workflow_config=f"{ONE_MODULE}:workflow_config",
        grader_config=f"{ONE_MODULE}:grader_config",
        code_dir=ONE_MODULE_PROJECT,
    )
    netns = f"hx-ray-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", netns], check=True)
    try:
        subprocess.run(["ip", "-n", netns, "link", "set", "lo", "up"], check=True)
        process = subprocess.Popen(
            ["ip", "netns", "exec", netns, sys.executable, str(ROOT / "tests" / "ray_cluster.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert process.stdout is not None
        started = _read_json_line(process.stdout, 120)
        cluster = RayCluster(
            netns, process, started["address"], list(started["nodes"]), started["session"]
        )
        try:
            yield cluster
        finally:
            cluster.stop_servers()
            with_timeout = time.monotonic() + 60
            with contextlib.suppress(AssertionError, OSError, ValueError):
                cluster.command("quit", timeout=60)
            while process.poll() is None and time.monotonic() < with_timeout:
                time.sleep(0.2)
    finally:
        # Everything left in the namespace was started by this fixture.
        pids = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True)
        for pid in pids.stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        subprocess.run(["ip", "netns", "delete", netns], check=False)


def _find(tree: Any, key: str) -> Any:
    if isinstance(tree, dict):
        if tree.get(key):
            return tree[key]
        for value in tree.values():
            found = _find(value, key)
            if found is not None:
                return found
    return None


def _warm_figures(tree: Any) -> Any:
    """The one ``warm_containers`` in ``tree`` that is a dict of figures."""
    if isinstance(tree, dict):
        if isinstance(tree.get("warm_containers"), dict):
            return tree["warm_containers"]
        tree = list(tree.values())
    if isinstance(tree, list):
        for value in tree:
            found = _warm_figures(value)
            if found is not None:
                return found
    return None


def _nodes_of(trials: Path) -> set[str]:
    nodes = set()
    for result in trials.glob("*/result.json"):
        data = json.loads(result.read_text())
        nodes.add(data["config"]["node"]["ray_node_id"])
    return nodes


def _ours(runtime: DockerRuntime, rollout_ids: list[str]) -> list[Any]:
    return [
        c
        for c in runtime.our_containers()
        if (c.get("Labels") or {}).get(LABEL_ROLLOUT) in rollout_ids
    ]


def test_oracle_and_workflow_rollouts_land_on_several_nodes(
    ray_cluster: RayCluster, tmp_path: Path
) -> None:
    tasks = sorted(p.name for p in DATASET.iterdir() if (p / "task.toml").is_file())
    url = ray_cluster.serve(
        tmp_path / "oracle",
        "--tasks-dir",
        str(DATASET),
        "--task-mode",
        "dataset",
        "--agent",
        "oracle",
        "--max-concurrent-trials",
        "8",
    )
    rollouts = [{"metadata": {"harbor_task_id": t}} for t in tasks + tasks[:3]]
    out = ray_cluster.client(url, rollouts)
    got = [(r["status"], r["reward"]) for r in out["results"]]
    # As with the local executor: word-stats writes no 'reward' key, so a trainer gets none.
    expected = [
        ("failure", None) if r["metadata"]["harbor_task_id"] == "word-stats" else ("success", 1.0)
        for r in rollouts
    ]
    assert got == expected, [r["err_message"] for r in out["results"]]
    nodes = _find(out["health"], "nodes")
    assert {n["node_id"] for n in nodes} == set(ray_cluster.nodes), nodes
    # Trials landed on more than one node.
    assert sum(1 for n in nodes if n["trials"] > 0) >= 2, nodes
    # Each node's warm pool, as its trials reported it, is in the server's /health (per
    # node and summed: every trial asked its node's pool once) and /metrics.
    assert all(n["warm_containers"] is not None for n in nodes if n["trials"] > 0), nodes
    summed = _warm_figures(out["health"])  # the nodes' own are counts of idle ones
    assert summed is not None, out["health"]
    assert summed["hits"] + summed["misses"] >= len(rollouts), summed
    assert any(line.startswith("harbor_exec_node_warm_claims{") for line in out["node_warm"])

    workflow_url = ray_cluster.serve(
        tmp_path / "workflow",
        "--tasks-dir",
        str(TEMPLATE),
        "--agent",
        "arith_agent.workflow:ArithWorkflow",
        "--grader",
        "arith_agent.grader:ArithGrader",
        "--workflow-config",
        "arith_agent.workflow:workflow_config",
        "--grader-config",
        "arith_agent.grader:grader_config",
        "--code-dir",
        str(PROJECT),
    )
    # A project as osmosis-ai's docs lay one out (one module) runs unchanged; its
    # grader verifies (the template's own tests read an answer file it never writes).
    graded = tmp_path / "graded-template"
    shutil.copytree(TEMPLATE, graded, ignore=shutil.ignore_patterns("tests"))
    one_module_url = ray_cluster.serve(
        tmp_path / "one-module",
        "--tasks-dir",
        str(graded),
        "--agent",
        f"{ONE_MODULE}:ArithWorkflow",
        "--grader",
        f"{ONE_MODULE}:ArithGrader",
        "--workflow-config",
        f"{ONE_MODULE}:workflow_config",
        "--grader-config",
        f"{ONE_MODULE}:grader_config",
        "--code-dir",
        str(ONE_MODULE_PROJECT),
    )
    question = [{"role": "user", "content": "What is 6 * 7?"}]
    wf = ray_cluster.client(
        workflow_url,
        [{"prompt": question, "label": "42"}] * 3 + [{"prompt": question, "label": "41"}],
    )
    assert [(r["status"], r["reward"]) for r in wf["results"]] == [("success", 1.0)] * 3 + [
        ("success", 0.0)
    ], wf["results"]
    one = ray_cluster.client(
        one_module_url, [{"prompt": question, "label": "42"}, {"prompt": question, "label": "41"}]
    )
    assert [(r["status"], r["reward"]) for r in one["results"]] == [
        ("success", 1.0),
        ("success", 0.0),
    ], one["results"]
    assert _nodes_of(tmp_path / "one-module" / "trials") <= set(ray_cluster.nodes)
    ray_cluster.stop_servers()
    # The LLM key never reached Ray's logs, object store spill files or dashboard.
    leaked = subprocess.run(
        ["grep", "-rl", "--binary-files=text", KEY, ray_cluster.session],
        capture_output=True,
        text=True,
    )
    assert leaked.stdout == "", f"the key is in {leaked.stdout}"


def test_terminus_2_rollouts_on_ray_nodes(ray_cluster: RayCluster, tmp_path: Path) -> None:
    """Harbor's terminus-2 runs on the node that runs the trial, dialling that node's
    relay for the rollout: the model sees the token, the endpoint the real key."""
    from tests.fake_chat import terminus_reply

    url = ray_cluster.serve(
        tmp_path / "terminus",
        "--tasks-dir",
        str(DATASET),
        "--task-mode",
        "dataset",
        "--agent",
        "terminus-2",
        "--agent-kwarg",
        "max_turns=5",
    )
    script = [
        terminus_reply(keystrokes=["echo 'Hello, world!' > /app/hello.txt\n"]),
        terminus_reply(task_complete=True),
        terminus_reply(task_complete=True),
    ]
    # One at a time: the scripted model's replies are one sequence.
    out = ray_cluster.client(url, [{"metadata": {"harbor_task_id": "hello-shell"}}], script=script)
    assert [(r["status"], r["reward"]) for r in out["results"]] == [("success", 1.0)], out
    assert out["authorization"] == [f"Bearer {KEY}"] * 3
    ray_cluster.stop_servers()
    nodes = _find(out["health"], "nodes")
    assert sum(n["trials"] for n in nodes) >= 1, nodes  # it ran on a trial node
    (kept,) = (tmp_path / "terminus" / "sa").glob("*/atif-trajectory.json")
    assert json.loads(kept.read_text())["agent"]["name"] == "terminus-2"
    leaked = subprocess.run(
        ["grep", "-rl", "--binary-files=text", KEY, ray_cluster.session, str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert leaked.stdout == "", f"the key is in {leaked.stdout}"


def _slow_dataset(root: Path, seconds: int) -> Path:
    """hello-shell whose oracle sleeps first: trials stay in the agent phase a while."""
    import shutil

    task = root / "slow"
    shutil.copytree(DATASET / "hello-shell", task)
    solve = task / "solution" / "solve.sh"
    solve.write_text(f"#!/bin/bash\nsleep {seconds}\n" + solve.read_text().split("\n", 1)[1])
    return root


def test_node_loss_cancel_and_a_joining_node(
    ray_cluster: RayCluster, tmp_path: Path, docker_runtime: DockerRuntime
) -> None:
    dataset = _slow_dataset(tmp_path / "slow-dataset", 12)
    url = ray_cluster.serve(
        tmp_path / "srv",
        "--tasks-dir",
        str(dataset),
        "--task-mode",
        "dataset",
        "--agent",
        "oracle",
        "--max-concurrent-trials",
        "8",
        # Each rollout's container is found by its rollout's label: a warm container,
        # made before its rollout arrived, carries the task's only.
        "--warm-containers",
        "0",
    )
    ids = [uuid.uuid4().hex for _ in range(6)]
    spec = json.dumps(
        {
            "url": url,
            "key": KEY,
            "rollouts": [{"rollout_id": i, "metadata": {"harbor_task_id": "slow"}} for i in ids],
        }
    )
    client = subprocess.Popen(
        ray_cluster.run(sys.executable, "-m", "tests.ray_client", spec),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    # Wait until all six run (three per node), then kill the first worker node.
    deadline = time.monotonic() + 60
    while len(_ours(docker_runtime, ids)) < 6 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(_ours(docker_runtime, ids)) == 6
    # /queue and /metrics show each node's slots in use (three trials per node).
    status, text = ray_cluster.http("GET", f"{url}/queue")
    queue = json.loads(text)
    assert status == 200 and queue["running"] == 6, queue
    in_use = {n["node"]: n["in_use"] for n in queue["nodes"]}
    assert in_use == {n[:12]: 3 for n in ray_cluster.nodes}, queue
    assert all(n["slots"] == 4 and n["alive"] for n in queue["nodes"]), queue
    status, metrics = ray_cluster.http("GET", f"{url}/metrics")
    for node in ray_cluster.nodes:
        assert (
            f'harbor_exec_node_slots_in_use{{address="127.0.0.1",node="{node[:12]}"}} 3.0'
            in metrics
        ), metrics
        assert f'harbor_exec_node_up{{address="127.0.0.1",node="{node[:12]}"}} 1.0' in metrics
    time.sleep(2.0)  # well into the agent phase (the oracle sleeps 12 s)
    lost = ray_cluster.nodes[0]  # named w0
    ray_cluster.command(f"remove {lost}")
    removed_at = time.monotonic()
    stdout, stderr = client.communicate(timeout=180)
    assert client.returncode == 0, stderr[-3000:]
    results = json.loads(stdout.strip().splitlines()[-1])["results"]
    lost_ones = [r for r in results if r["status"] != "success"]
    assert lost_ones and len(lost_ones) < len(results), results
    for r in lost_ones:
        assert r["err_category"] == "internal_error", r
        assert f"Ray node {lost[:12]}" in r["err_message"], r
        assert "was lost during the agent phase" in r["err_message"], r
    # Each lost rollout ended within the lease, long before its trial would have.
    assert all(r["seconds"] < 40 for r in lost_ones), results
    assert time.monotonic() - removed_at < 60
    # The dead node's containers carry its name in their owner label: the other
    # node's reaper (every 5 s) leaves them alone, as it would another machine's...
    time.sleep(7.0)
    left = _ours(docker_runtime, ids)
    assert left, "the lost node's containers were removed by another node"
    assert all("/ray-node:w0/" in c["Labels"][LABEL_OWNER] for c in left), left
    # ...and the node, when it returns (same name, new Ray node id), reaps them.
    joined = ray_cluster.command("add w0", timeout=120)["node"]
    deadline = time.monotonic() + 30
    while _ours(docker_runtime, ids) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _ours(docker_runtime, ids)

    # A node that joins takes trials without a restart.
    ray_cluster.nodes[0] = joined
    time.sleep(3.0)  # the server re-reads the node table every second
    out = ray_cluster.client(url, [{"metadata": {"harbor_task_id": "slow"}} for _ in range(8)])
    assert [r["status"] for r in out["results"]] == ["success"] * 8, out["results"]
    nodes = {n["node_id"]: n for n in _find(out["health"], "nodes")}
    assert nodes[joined]["alive"] and nodes[joined]["trials"] > 0, nodes
    assert not nodes[lost]["alive"], nodes

    # Cancel reaches a trial on any node and frees its container within 2 s.
    cancel_id = uuid.uuid4().hex
    spec = json.dumps(
        {
            "url": url,
            "key": KEY,
            "rollouts": [
                {"rollout_id": cancel_id, "metadata": {"harbor_task_id": "slow"}, "cancel_after": 6}
            ],
        }
    )
    client = subprocess.Popen(
        ray_cluster.run(sys.executable, "-m", "tests.ray_client", spec),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    deadline = time.monotonic() + 60
    while not _ours(docker_runtime, [cancel_id]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _ours(docker_runtime, [cancel_id]), "the trial never started"
    while _ours(docker_runtime, [cancel_id]) and time.monotonic() < deadline:
        time.sleep(0.05)
    gone_at = time.time()
    stdout, stderr = client.communicate(timeout=120)
    result = json.loads(stdout.strip().splitlines()[-1])["results"][0]
    assert result["status"] in ("cancelled", "failure"), result
    assert gone_at - result["cancelled_at"] < 2.0, (gone_at, result)


def _stats_shape(job_result: Path) -> dict[str, Any]:
    """A job's stats with trial names replaced by counts (names are random)."""
    stats = json.loads(job_result.read_text())["stats"]
    shape: dict[str, Any] = {
        k: stats[k] for k in ("n_completed_trials", "n_errored_trials", "n_cancelled_trials")
    }
    for name, evals in stats["evals"].items():
        shape[name] = {
            "n_trials": evals["n_trials"],
            "n_errors": evals["n_errors"],
            "metrics": evals["metrics"],
            "pass_at_k": evals["pass_at_k"],
            "rewards": {
                k: {v: len(t) for v, t in d.items()} for k, d in evals["reward_stats"].items()
            },
            "exceptions": {k: len(t) for k, t in evals["exception_stats"].items()},
        }
    return shape


def test_validate_and_prewarm_on_ray_match_a_local_run(
    ray_cluster: RayCluster, tmp_path: Path
) -> None:
    prewarm = subprocess.run(
        ray_cluster.run(
            sys.executable,
            "-m",
            "harbor_exec.cli",
            "prewarm",
            str(DATASET),
            "--ray",
            ray_cluster.address,
        ),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert prewarm.returncode == 0, prewarm.stdout + prewarm.stderr
    for node in ray_cluster.nodes:
        assert f"on node {node[:12]}" in prewarm.stdout, prewarm.stdout
    runs = {}
    for where in ("ray", "local"):
        ray_args = ["--ray", ray_cluster.address] if where == "ray" else []
        argv = [
            sys.executable,
            "-m",
            "harbor_exec.cli",
            "validate",
            str(DATASET),
            "-n",
            "4",
            "--jobs-dir",
            str(tmp_path / where),
            "--job-name",
            "job",
            *ray_args,
        ]
        done = subprocess.run(
            ray_cluster.run(*argv) if where == "ray" else argv,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        runs[where] = _stats_shape(tmp_path / where / "job" / "result.json")
    assert runs["ray"] == runs["local"]
    nodes = set()
    for result in (tmp_path / "ray" / "job").glob("*/result.json"):
        nodes.add(json.loads(result.read_text())["config"]["node"]["ray_node_id"])
    assert len(nodes) >= 2, nodes


def test_cluster_unreachable_after_start_then_back(ray_cluster: RayCluster, tmp_path: Path) -> None:
    """The head's GCS stops answering under a running server: /health says why and
    admissions get 503; the server keeps answering, and admits again once it is back.
    (Last in the module: it freezes the shared cluster's GCS for a while.)"""
    url = ray_cluster.serve(
        tmp_path / "srv",
        "--tasks-dir",
        str(DATASET),
        "--task-mode",
        "dataset",
        "--agent",
        "oracle",
    )
    server = ray_cluster.servers[-1]
    status, text = ray_cluster.http("GET", f"{url}/health")
    assert status == 200 and json.loads(text)["status"] == "ok", text
    body = {
        "rollout_id": "while-down",
        "initial_messages": [],
        "chat_completions_url": "http://127.0.0.1:9/v1",
        "metadata": {"harbor_task_id": "hello-shell"},
    }
    ray_cluster.command("gcs stop")
    try:
        deadline = time.monotonic() + 20
        health: dict[str, Any] = {}
        while time.monotonic() < deadline:
            status, text = ray_cluster.http("GET", f"{url}/health")
            assert status == 200, text
            health = json.loads(text)
            if health["status"] != "ok":
                break
            time.sleep(0.5)
        reason = str(_find(health, "docker_reason"))
        assert health["status"] == "degraded", health
        assert f"the Ray cluster at {ray_cluster.address}" in reason, health
        assert "has not answered" in reason, health
        status, text = ray_cluster.http("POST", f"{url}/rollout", body)
        assert status == 503, text
        assert "Ray cluster" in json.loads(text)["detail"], text
        time.sleep(3.0)
        assert server.poll() is None, "the server died with the cluster away"
    finally:
        ray_cluster.command("gcs cont")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        status, text = ray_cluster.http("GET", f"{url}/health")
        if json.loads(text)["status"] == "ok":
            break
        time.sleep(0.5)
    assert json.loads(text)["status"] == "ok", text
    out = ray_cluster.client(url, [{"metadata": {"harbor_task_id": "hello-shell"}}])
    assert [r["status"] for r in out["results"]] == ["success"], out["results"]
    assert server.poll() is None


def _ray_gateways(runtime: DockerRuntime) -> list[dict[str, Any]]:
    """Build gateways (the package cache's) whose owner is a test cluster node."""
    from harbor_exec.network.packages.build_gateway import KIND
    from harbor_exec.sandbox.runtime import LABEL_KIND

    return [
        c
        for c in runtime.our_containers()
        if (c.get("Labels") or {}).get(LABEL_KIND) == KIND
        and "/ray-node:w" in (c.get("Labels") or {}).get(LABEL_OWNER, "")
    ]


# A hostile agent on a Ray node (no Python in its image): every file it can read, and
# every process's environment, searched for each "half:half" pair of HX_NEEDLE_PAIRS
# joined; a control string it writes itself must be found, so the search really ran.
CA_KEY_SCAN_SH = r"""
search() {
  grep -rlF --exclude-dir=proc --exclude-dir=sys --exclude-dir=dev -e "$1" / 2>/dev/null
  for f in /proc/[0-9]*/environ; do grep -qF -e "$1" "$f" 2>/dev/null && echo "$f"; done
}
control="hx-control-$$"; echo "$control-x" > /tmp/hx-control
found=""
for pair in $HX_NEEDLE_PAIRS; do found="$found$(search "${pair%%:*}${pair#*:}")"; done
{ search "$control-x" | grep -q /tmp/hx-control && echo control:found
  echo "keys:${found:-none}"; } > /logs/agent/ca-scan.txt
"""


def test_package_cache_on_ray_nodes(ray_cluster: RayCluster, tmp_path: Path) -> None:
    """``prewarm --ray --package-cache`` builds on every node through that node's own
    cache (the Dockerfile fails without the proxy arguments), and ``serve --ray
    --package-cache`` trials use the node's cache (``package-cache.json`` comes back);
    the server runs none of its own; every node's gateway is gone at the end."""
    from harbor_exec.network.packages.ca import CA_KEY, LocalCA
    from harbor_exec.network.packages.session import RESULT_FILE
    from harbor_exec.tasks.task import load_task
    from harbor_exec.trial.trial import image_tag_for
    from tests.task_factory import make_task

    nonce = uuid.uuid4().hex
    dataset = tmp_path / "tasks"
    task_dir = make_task(
        dataset,
        "ray-cached",
        dockerfile=f'FROM debian:bookworm-slim\nRUN echo {nonce} && test -n "$HTTP_PROXY"\n',
    )
    # Its verifier writes no reward: a failed trial, whose directory the server keeps.
    # Its agent looks for the nodes' CA keys everywhere it can read, as root.
    kept = make_task(
        dataset,
        "ray-kept",
        solve=CA_KEY_SCAN_SH,
        test="true",
        dockerfile=(task_dir / "environment" / "Dockerfile").read_text(),
    )
    tags = {image_tag_for(load_task(task_dir)), image_tag_for(load_task(kept))}
    root = tmp_path / "pc"
    runtime = DockerRuntime()
    try:
        prewarm = subprocess.run(
            ray_cluster.run(
                sys.executable,
                "-m",
                "harbor_exec.cli",
                "prewarm",
                str(dataset),
                "--ray",
                ray_cluster.address,
                "--package-cache",
                "--package-cache-dir",
                str(root),
            ),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert prewarm.returncode == 0, prewarm.stdout + prewarm.stderr
        # Both nodes share this engine: one built it, through its cache; the other found it.
        assert prewarm.stdout.count("ray-cached on node") == 2, prewarm.stdout
        assert prewarm.stdout.count("ray-kept on node") == 2, prewarm.stdout
        assert "built ray-cached" in prewarm.stdout, prewarm.stdout
        built_by = [n for n in ("w0", "w1") if (root / "ray-nodes" / n / "package-cache").is_dir()]
        assert built_by, list(root.rglob("*"))
        assert (root / "ray-nodes" / built_by[0] / "package-cache-ca").is_dir()
        assert not (root / "package-cache").exists()  # the driver ran no cache
        assert _ray_gateways(runtime) == []  # closed with the nodes' actors
        for tag in tags:
            runtime.remove_image(tag)  # the trials build them again, through the cache
        # Each node's CA (the one a node that found the image has yet to make is made
        # here, where the node will find it); the scanning agent gets a line of each key,
        # in two halves so that no environment holds it whole.
        pairs = []
        for node in ("w0", "w1"):
            ca = LocalCA(root / "ray-nodes" / node / "package-cache-ca")
            line = (ca.directory / CA_KEY).read_text().splitlines()[2]
            pairs.append(f"{line[:20]}:{line[20:]}")
        toml = (kept / "task.toml").read_text()
        (kept / "task.toml").write_text(
            f'{toml}\n[environment.env]\nHX_NEEDLE_PAIRS = "{" ".join(pairs)}"\n'
        )
        url = ray_cluster.serve(
            tmp_path / "serve",
            "--tasks-dir",
            str(dataset),
            "--task-mode",
            "dataset",
            "--agent",
            "oracle",
            "--package-cache",
            "--package-cache-dir",
            str(root),
        )
        rollouts = [
            {"metadata": {"harbor_task_id": t}} for t in ("ray-cached",) * 2 + ("ray-kept",)
        ]
        out = ray_cluster.client(url, rollouts)
        # The images built again in the trials, on the nodes: through their caches.
        assert [(r["status"], r["reward"]) for r in out["results"]] == [("success", 1.0)] * 2 + [
            ("failure", None)
        ], [r["err_message"] for r in out["results"]]
        [result] = (tmp_path / "serve" / "trials").glob("*/result.json")  # the failed one's
        scan = (result.parent / "agent" / "ca-scan.txt").read_text()
        assert "control:found" in scan and "keys:none" in scan, scan
        stats = json.loads((result.parent / RESULT_FILE).read_text())
        assert stats["requests"] == 0 and stats["upstream_errors"] == 0, stats
        # The server's /metrics has each node's cache, by node, as the node reported it.
        status, metrics = ray_cluster.http("GET", f"{url}/metrics")
        assert status == 200, metrics
        bounds = re.findall(
            r'^harbor_exec_package_cache_bound_bytes\{node="(w[01])"\} (\S+)$', metrics, re.M
        )
        assert bounds and all(float(v) == 20 * 1024**3 for _, v in bounds), metrics
        for node, _bound in bounds:
            assert f'harbor_exec_package_cache_requests_total{{node="{node}"}} 0.0' in metrics
        # Hits, misses and bytes by node match the trials' records: these trials and
        # their builds fetch nothing, so each node's figures are the kept record's (0).
        for key, metric in (
            ("hits", 'hits_total{{node="{}"}}'),
            ("misses", 'misses_total{{node="{}"}}'),
            ("bytes_from_cache", 'bytes_total{{node="{}",source="cache"}}'),
            ("bytes_from_upstream", 'bytes_total{{node="{}",source="upstream"}}'),
        ):
            for node, _bound in bounds:
                line = f"harbor_exec_package_cache_{metric.format(node)} {float(stats[key])}"
                assert line in metrics, (line, metrics)
        assert 'harbor_exec_package_cache_requests_total{node="server"} 0.0' in metrics
        ray_cluster.stop_servers()
        assert not (root / "package-cache").exists()
        assert _ray_gateways(runtime) == []
    finally:
        ray_cluster.stop_servers()
        for tag in tags:
            if runtime.image_exists(tag):
                runtime.remove_image(tag)
