"""One home per agent kind: executors and specs ask the agent interface, never the kind."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from harbor_exec.agents.base import AgentInputs, AgentSpec, RelayUse
from harbor_exec.agents.native.agent import NativeAgentSpec
from harbor_exec.agents.oracle import OracleAgent, OracleAgentSpec
from harbor_exec.agents.workflow import WorkflowAgent, WorkflowAgentSpec

ROOT = Path(__file__).resolve().parent.parent
AGENTS = ROOT / "harbor_exec" / "agents"


def _isinstance_targets(node: ast.expr) -> list[str]:
    """The class names an ``isinstance``'s second argument names."""
    if isinstance(node, ast.Tuple):
        return [name for element in node.elts for name in _isinstance_targets(element)]
    if isinstance(node, ast.BinOp):  # ``A | B``
        return _isinstance_targets(node.left) + _isinstance_targets(node.right)
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    return []


def test_no_branch_on_an_agent_spec_outside_the_agents_part() -> None:
    wrong = []
    for base in (ROOT / "harbor_exec", ROOT / "bundler"):
        for path in sorted(base.rglob("*.py")):
            if AGENTS in path.parents:
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Name)
                    and node.func.id == "isinstance"
                    and len(node.args) == 2
                ):
                    named = [
                        n for n in _isinstance_targets(node.args[1]) if n.endswith("AgentSpec")
                    ]
                    if named:
                        wrong.append(f"{path.relative_to(ROOT)}:{node.lineno} {named}")
    assert not wrong, "branches on an agent kind (ask AgentSpec instead):\n" + "\n".join(wrong)


def _specs() -> list[AgentSpec]:
    return [
        OracleAgentSpec(),
        WorkflowAgentSpec("pkg:Flow", "1"),
        NativeAgentSpec(name="terminus-2", model_name="openai/m", instruction="do it"),
        NativeAgentSpec(name="mini-swe-agent", model_name="openai/m", instruction="do it"),
    ]


@pytest.mark.parametrize("spec", _specs(), ids=lambda spec: spec.info.name)
def test_every_kind_says_how_it_reaches_the_relay_and_what_it_mounts(spec: AgentSpec) -> None:
    assert isinstance(spec.relay, RelayUse)
    assert spec.layer is None  # nothing prepared in these specs


def test_the_kinds_relay_use() -> None:
    oracle, workflow, terminus, mini = _specs()
    assert oracle.relay == workflow.relay == RelayUse(mount=True)
    # terminus-2 dials the relay from this process; mini-swe-agent from the container,
    # and its sample is the relay's record of the chat.
    assert terminus.relay == RelayUse(mount=False, socket_path=True)
    assert mini.relay == RelayUse(mount=True, socket_path=True, record_chat=True)


def test_each_kind_makes_its_agent_from_the_trials_inputs() -> None:
    oracle, workflow = OracleAgentSpec(), WorkflowAgentSpec("pkg:Flow", "1")
    terminus = NativeAgentSpec(name="terminus-2", model_name="openai/m", instruction="do it")
    assert isinstance(oracle.agent(AgentInputs()), OracleAgent)
    with pytest.raises(ValueError, match="rollout input"):
        workflow.agent(AgentInputs())
    made = workflow.agent(AgentInputs(rollout_input=b"{}"))
    assert isinstance(made, WorkflowAgent) and made.rollout_input == b"{}"
    with pytest.raises(ValueError, match="model endpoint"):
        terminus.agent(AgentInputs())
    agent = terminus.agent(AgentInputs(model_token="t", relay_path="/v1", relay_socket="/s"))
    assert (agent.token, agent.relay_path, agent.relay_socket) == ("t", "/v1", "/s")
