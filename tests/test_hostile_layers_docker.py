"""A root agent attacks the read-only volumes harbor-exec mounts into its container: the
runtime, a bundle's dependency environment and an agent's layer (mini-swe-agent's, with
the forwarder's launchers). Each is shared by every later trial of the machine, so one
write would reach them all: none may succeed, and the next trial sees the same bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harbor_exec.agents.native.layer import AgentLayer
from harbor_exec.agents.oracle import OracleAgentSpec
from harbor_exec.bundler import build_bundle
from harbor_exec.bundler.agent_wheels import prepare_agent_layer
from harbor_exec.container.exchange import AGENT_MOUNT, DEPS_MOUNT, RUNTIME_MOUNT
from harbor_exec.sandbox.deps import DepsLayer
from harbor_exec.sandbox.docker import DockerRuntime
from harbor_exec.tasks.task import load_task
from harbor_exec.trial.factory import run_trial
from harbor_exec.trial.spec import TrialSpec
from harbor_exec.trial.trial import TrialRequest
from tests.bundle_utils import EXAMPLE_DIR, EXAMPLE_REFS
from tests.task_factory import make_task

# engine_lane: its own tasks and layers; no engine-wide counts or timing bounds.
pytestmark = [pytest.mark.docker, pytest.mark.engine_lane, pytest.mark.usefixtures("base_images")]

MOUNTS = (RUNTIME_MOUNT, DEPS_MOUNT, AGENT_MOUNT)
PATHS = " ".join(MOUNTS)

# Digest of every file under the mounts, then each attack's outcome ("ok" = it worked).
ATTACK = f"""
digest() {{ find {PATHS} -type f -print0 2>/dev/null | sort -z | xargs -0 sha256sum | sha256sum | cut -c1-64; }}
try() {{ if ( eval "$2" ) >/dev/null 2>&1; then echo "\\"$1\\": \\"ok\\","; else echo "\\"$1\\": \\"refused\\","; fi; }}
{{
  echo '{{"before": "'"$(digest)"'",'
  mkdir -p /tmp/control && echo data > /tmp/control/file
  for m in {PATHS} /tmp/control; do
    victim=$(find "$m" -type f | head -n 1)
    try "$m: create" "echo planted > $m/planted"
    try "$m: append" "echo planted >> $victim"
    try "$m: replace" "cp /bin/true $victim"
    try "$m: chmod" "chmod 777 $victim"
    try "$m: remove" "rm -f $victim && [ ! -e $victim ]"
    try "$m: remount" "mount -o remount,rw $m"
    try "$m: bind over" "mkdir -p /tmp/x && mount --bind /tmp/x $m"
  done
  echo '"after": "'"$(digest)"'"}}'
}} > /logs/agent/attack.json
"""


class OracleWithLayer(OracleAgentSpec):
    """Harbor's oracle, with a prepared agent layer that the trial mounts."""

    def __init__(self, layer: AgentLayer) -> None:
        self._layer = layer

    @property
    def layer(self) -> AgentLayer | None:
        return self._layer


SURVEY = f"""
digest() {{ find {PATHS} -type f -print0 2>/dev/null | sort -z | xargs -0 sha256sum | sha256sum | cut -c1-64; }}
echo "{{\\"digest\\": \\"$(digest)\\", \\"files\\": $(find {PATHS} -type f | wc -l)}}" > /logs/agent/survey.json
"""


def test_a_root_agent_cannot_change_the_runtime_the_deps_or_an_agent_layer(
    docker_runtime: DockerRuntime, tmp_path: Path
) -> None:
    bundle = build_bundle(EXAMPLE_DIR, cache_dir=tmp_path / "bundles", **EXAMPLE_REFS)
    deps = DepsLayer(bundle.wheelhouse, bundle.manifest.pip_wheel, bundle.requirements_digest)
    layer = prepare_agent_layer("mini-swe-agent")
    trials = tmp_path / "trials"

    def oracle(name: str, solve: str) -> dict[str, object]:
        task = make_task(tmp_path / "tasks", name, solve=solve)
        agent = OracleWithLayer(layer)  # the oracle, with a native agent's layer mounted
        spec = TrialSpec(task=load_task(task), trials_dir=trials, agent=agent, deps=deps)
        request = TrialRequest(spec)
        result = run_trial(docker_runtime, request)
        assert result.exception_info is None, result.exception_info
        out = trials / result.trial_name / "agent"
        found: dict[str, object] = json.loads(next(out.glob("*.json")).read_text())
        return found

    attack = oracle("attack-layers", ATTACK)
    outcomes = {key: value for key, value in attack.items() if ": " in key}
    control = {key: value for key, value in outcomes.items() if key.startswith("/tmp/control")}
    attacked = {key: value for key, value in outcomes.items() if key not in control}
    assert len(attacked) == 7 * len(MOUNTS), attack
    assert set(attacked.values()) == {"refused"}, attack
    # The same attempts on a directory of the agent's own work (but the mounts, which
    # need CAP_SYS_ADMIN): the attack itself is sound.
    assert {k: v for k, v in control.items() if "mount" not in k and "bind" not in k} == {
        f"/tmp/control: {what}": "ok" for what in ("create", "append", "replace", "remove", "chmod")
    }, attack
    assert attack["before"] == attack["after"], attack
    # The next trial on the same volumes: the same files, byte for byte.
    survey = oracle("survey-layers", SURVEY)
    assert survey["digest"] == attack["before"], (survey, attack)
    assert isinstance(survey["files"], int) and survey["files"] > 100, survey
