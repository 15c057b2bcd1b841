"""What a workflow trial's exchange files said, read once as its logs come back.

The runner in the container writes ``/logs/agent/sample.json`` (the sample, or
its error form) and, for a bundled grader, ``/logs/verifier/grader_error.json``
or ``/logs/verifier/sample.json`` (the sample as the grader changed it). The trial
reads them when it downloads ``/logs`` (with the rollout's secrets redacted, as
on disk) into a ``TrialOutput``, so that mapping a trial to a rollout outcome
reads no file. The reward stays in ``TrialResult`` (Harbor's record).

Every file here came out of a container: each is parsed with
``load_exchange_json`` (bounded in bytes and nesting), and what it refuses
becomes a typed value (``AgentOutput.invalid``), never an exception.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from harbor_exec.container.exchange import (
    AGENT_SAMPLE,
    GRADER_ERROR,
    RUNNER_OUTPUT,
    VERIFIER_SAMPLE,
    ErrorDetail,
    ErrorFile,
    ExchangeJSONError,
    SampleFile,
    load_exchange_json,
)
from harbor_exec.container.redaction import redact

#: How much of the runner's output a missing sample's message quotes.
RUNNER_TAIL_LINES = 20


@dataclass(frozen=True)
class AgentOutput:
    """``agent/sample.json``: exactly one of ``sample``, ``error`` or ``invalid`` is
    set when the file was there; none of them when it was missing or not JSON."""

    sample: SampleFile | None = None  # its success form (``messages`` None: no sample)
    error: ErrorDetail | None = None  # its error form: why the runner failed
    invalid: str | None = None  # JSON but not a sample: the first validation message
    runner_tail: str = "(no output)"  # the runner's last lines, kept when there is no sample

    @property
    def missing(self) -> bool:
        return self.sample is None and self.error is None and self.invalid is None


@dataclass(frozen=True)
class GraderOutput:
    """The bundled grader's files beside its reward (a task's own tests write none)."""

    sample: SampleFile | None = None  # ``verifier/sample.json``: the sample it changed
    error: ErrorDetail | None = None  # ``verifier/grader_error.json``: why it failed


@dataclass(frozen=True)
class TrialOutput:
    """A trial's exchange files, typed (see module doc)."""

    agent: AgentOutput = field(default_factory=AgentOutput)
    grader: GraderOutput = field(default_factory=GraderOutput)


def _read_text(path: Path, secrets: Sequence[str]) -> str | None:
    """``path``'s text with ``secrets`` redacted; None when it is missing or unreadable."""
    try:
        return redact(path.read_bytes().decode("utf-8"), secrets)
    except (OSError, ValueError):
        return None


def _error_detail(payload: object) -> ErrorDetail:
    try:
        return ErrorFile.model_validate(payload).error
    except ValidationError:
        return ErrorDetail(message="the runner failed")


def _tail(path: Path, secrets: Sequence[str]) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no output)"
    return redact("\n".join(text.splitlines()[-RUNNER_TAIL_LINES:]), secrets)


def parse_agent_sample(text: str) -> AgentOutput:
    """The text of a ``sample.json`` as an ``AgentOutput`` (``invalid`` says what is wrong)."""
    try:
        payload = load_exchange_json(text, AGENT_SAMPLE)
    except ExchangeJSONError as exc:
        return AgentOutput(invalid=str(exc))
    if isinstance(payload, dict) and "error" in payload:
        return AgentOutput(error=_error_detail(payload))
    try:
        return AgentOutput(sample=SampleFile.model_validate(payload))
    except ValidationError as exc:
        return AgentOutput(invalid=str(exc.errors()[0]["msg"]))


def read_agent_output(trial_dir: Path, secrets: Sequence[str] = ()) -> AgentOutput:
    """``agent/sample.json`` under ``trial_dir`` (and the runner's tail if no sample)."""
    text = _read_text(trial_dir / AGENT_SAMPLE, secrets)
    if text is None:
        return AgentOutput(runner_tail=_tail(trial_dir / RUNNER_OUTPUT, secrets))
    return parse_agent_sample(text)


def read_grader_output(trial_dir: Path, secrets: Sequence[str] = ()) -> GraderOutput:
    """``verifier/sample.json`` and ``verifier/grader_error.json`` under ``trial_dir``.

    A file that is not what the runner writes counts as absent: without a reward
    the trial already fails on the verifier side.
    """
    sample: SampleFile | None = None
    error: ErrorDetail | None = None
    text = _read_text(trial_dir / VERIFIER_SAMPLE, secrets)
    if text is not None:
        try:
            sample = SampleFile.model_validate(load_exchange_json(text, VERIFIER_SAMPLE))
        except (ExchangeJSONError, ValidationError):
            sample = None
    text = _read_text(trial_dir / GRADER_ERROR, secrets)
    if text is not None:
        try:
            error = _error_detail(load_exchange_json(text, GRADER_ERROR))
        except ExchangeJSONError:
            error = None
    return GraderOutput(sample=sample, error=error)


__all__ = [
    "AgentOutput",
    "GraderOutput",
    "TrialOutput",
    "parse_agent_sample",
    "read_agent_output",
    "read_grader_output",
]
