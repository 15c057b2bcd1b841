"""JSON from a container, bounded before it is parsed, and the runner's sample frame.

Engine-free: the readers the trial uses on a downloaded ``/logs`` and the frame
the runner prints; a hostile document ends as a typed refusal, never RecursionError.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harbor_exec.container.exchange import (
    MAX_EXCHANGE_JSON_DEPTH,
    ExchangeJSONError,
    frame_sample,
    json_depth,
    load_exchange_json,
    unframe_sample,
)
from harbor_exec.errors import VerifierOutputParseError
from harbor_exec.trial.outputs import read_agent_output, read_grader_output
from harbor_exec.trial.results import parse_rewards

DEEP_ARRAY = "[" * 200_000 + "]" * 200_000
DEEP_OBJECT = '{"a":' * 200_000 + "1" + "}" * 200_000


@pytest.mark.parametrize("text", [DEEP_ARRAY, DEEP_OBJECT, "[" * 200_000])
def test_deep_json_is_refused_before_parsing(text: str) -> None:
    with pytest.raises(ExchangeJSONError, match="nests deeper than"):
        load_exchange_json(text, "sample.json")


def test_json_at_the_depth_limit_is_read() -> None:
    depth = MAX_EXCHANGE_JSON_DEPTH
    value = load_exchange_json("[" * depth + "]" * depth, "x")
    assert isinstance(value, list)


def test_brackets_inside_strings_do_not_count() -> None:
    text = json.dumps({"content": "[" * 10_000 + '\\" {{{', "n": [[1]]})
    assert json_depth(text, 64) == 3
    assert load_exchange_json(text, "x")["n"] == [[1]]


def test_oversized_json_is_refused_before_parsing() -> None:
    with pytest.raises(ExchangeJSONError, match="bytes; at most 100"):
        load_exchange_json(b'"' + b"x" * 200 + b'"', "x", max_bytes=100)


@pytest.mark.parametrize("data", [b"not json", b"\xff\xfe", b'{"reward": NaN}'])
def test_what_is_not_json_is_refused(data: bytes) -> None:
    with pytest.raises(ExchangeJSONError):
        load_exchange_json(data, "x")


def test_the_first_complete_frame_wins() -> None:
    first, later = b'{"messages": []}', b'{"messages": [], "remove_sample": true}'
    output = b"noise\n" + frame_sample(first) + frame_sample(later)
    assert unframe_sample(output) == first


@pytest.mark.parametrize(
    "output",
    [
        b"no frame at all",
        frame_sample(b'{"messages": []}')[:-5],  # cut short: the exec ended mid-frame
        b"\x1eharbor-exec:sample:v1 99999999999\n{}",  # declares more than the cap
        b"\x1eharbor-exec:sample:v1 abc\n{}",
    ],
)
def test_no_complete_frame_is_no_sample(output: bytes) -> None:
    assert unframe_sample(output) is None


def _trial_dir(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return tmp_path


def test_a_deep_agent_sample_is_an_invalid_sample(tmp_path: Path) -> None:
    output = read_agent_output(_trial_dir(tmp_path, "agent/sample.json", DEEP_ARRAY))
    assert output.invalid is not None and "nests deeper than" in output.invalid
    assert output.sample is None and output.error is None


def test_deep_grader_files_count_as_absent(tmp_path: Path) -> None:
    _trial_dir(tmp_path, "verifier/sample.json", DEEP_OBJECT)
    _trial_dir(tmp_path, "verifier/grader_error.json", DEEP_ARRAY)
    output = read_grader_output(tmp_path)
    assert output.sample is None and output.error is None


def test_a_deep_reward_json_is_a_verifier_parse_error(tmp_path: Path) -> None:
    _trial_dir(tmp_path, "verifier/reward.json", '{"reward": ' + DEEP_ARRAY + "}")
    with pytest.raises(VerifierOutputParseError, match="nests deeper than"):
        parse_rewards(tmp_path / "verifier")
