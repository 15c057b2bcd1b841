"""``harbor-exec run``'s options, checked before any Docker engine is asked: a bad
model route, a missing key variable, an unknown agent, a key given where its
variable's name belongs (never echoed). No Docker here."""

from __future__ import annotations

from pathlib import Path

import pytest

from harbor_exec.cli.run import check_run_agent
from tests.cli_utils import invoke
from tests.task_factory import make_task

KEY = "sk-never-shown-4c1d2e"
BASE = "http://127.0.0.1:9/v1"


def run_cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    result = invoke("run", *args, env=dict(env or {}))
    return result.exit_code, result.output


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    make_task(tmp_path / "ds", "one")
    return tmp_path / "ds"


def test_a_route_other_than_openai_is_refused_naming_the_flag(dataset: Path) -> None:
    code, text = run_cli(
        str(dataset),
        "--agent",
        "terminus-2",
        "--model-name",
        "anthropic/claude",
        "--api-base",
        BASE,
    )
    assert code == 2
    assert "Invalid value for --model-name" in text
    assert "'openai/<id>' model route" in text and "anthropic/claude" in text


def test_an_unknown_agent_is_refused_with_the_names(dataset: Path) -> None:
    code, text = run_cli(
        str(dataset), "--agent", "claude-code", "--model-name", "openai/m", "--api-base", BASE
    )
    assert code == 2
    assert "Invalid value for --agent" in text and "terminus-2" in text
    code, text = run_cli(
        str(dataset), "--agent", "oracle", "--model-name", "openai/m", "--api-base", BASE
    )
    assert code == 2 and "harbor-exec validate" in text


def test_a_missing_key_variable_is_refused_naming_the_flag(dataset: Path) -> None:
    args = [str(dataset), "--agent", "terminus-2", "--model-name", "openai/m", "--api-base", BASE]
    code, text = run_cli(*args, "--api-key-env", "HX_TEST_NO_SUCH_KEY")
    assert code == 2
    assert "Invalid value for --api-key-env" in text
    assert "HX_TEST_NO_SUCH_KEY is not set or empty" in text
    code, text = run_cli(*args, "--api-key-env", "HX_TEST_EMPTY", env={"HX_TEST_EMPTY": ""})
    assert code == 2 and "HX_TEST_EMPTY is not set or empty" in text


def test_the_key_itself_given_for_its_variable_is_refused_and_not_echoed(dataset: Path) -> None:
    args = [str(dataset), "--agent", "terminus-2", "--model-name", "openai/m", "--api-base", BASE]
    code, text = run_cli(*args, "--api-key-env", KEY)
    assert code == 2
    assert "Invalid value for --api-key-env" in text and "NAME of an environment variable" in text
    assert KEY not in text


def test_a_bad_api_base_and_managed_options_are_refused_naming_the_flag(dataset: Path) -> None:
    args = [str(dataset), "--agent", "terminus-2", "--model-name", "openai/m"]
    code, text = run_cli(*args, "--api-base", "127.0.0.1:8000/v1")
    assert code == 2 and "Invalid value for --api-base" in text
    code, text = run_cli(*args, "--api-base", BASE, "--agent-kwarg", "api_base=http://x")
    assert code == 2 and "Invalid value for --agent-kwarg" in text and "api_base" in text


def test_checked_options_become_harbors_agent_config_without_the_key() -> None:
    chosen = check_run_agent(
        "terminus-2",
        model_name="openai/m-1",
        api_base=BASE,
        api_key_env="HX_KEY",
        agent_kwargs=["max_turns=5", "temperature=0.2"],
        agent_setup_timeout_sec=30,
        environ={"HX_KEY": KEY},
    )
    assert chosen.harbor_config == {
        "name": "terminus-2",
        "model_name": "openai/m-1",
        "kwargs": {"max_turns": 5, "temperature": 0.2},
        "model_api_key_name": "HX_KEY",
        "override_setup_timeout_sec": 30,
    }
    assert KEY not in repr(chosen)
    # Each trial: a fresh token, the key only in its secrets (for its relay), both scrubbed.
    first, second = chosen.secrets(None), chosen.secrets(None)  # type: ignore[arg-type]
    assert first.model is not None and second.model is not None
    assert first.model.url == BASE and first.model.api_key == KEY
    assert first.model.token != second.model.token
    assert set(first.scrub) == {KEY, first.model.token}
