"""Which trial runs a request (Harbor 0.26's ``Trial.create``): a ``MultiStepTrial`` for a
task with ``[[steps]]``, else a ``Trial``. Its own module, above both classes, so that
neither imports the other's module to choose."""

from __future__ import annotations

from harbor_exec.sandbox.runtime import ContainerRuntime
from harbor_exec.trial.results import TrialResult
from harbor_exec.trial.steps import MultiStepTrial
from harbor_exec.trial.trial import PhaseCallback, Trial, TrialRequest


def create_trial(
    runtime: ContainerRuntime,
    request: TrialRequest,
    *,
    on_phase: PhaseCallback | None = None,
) -> Trial:
    """The trial that runs ``request``: its task's kind picks the class."""
    kind = MultiStepTrial if request.spec.task.is_multi_step else Trial
    return kind(runtime, request, on_phase=on_phase)


def run_trial(
    runtime: ContainerRuntime,
    request: TrialRequest,
    *,
    on_phase: PhaseCallback | None = None,
) -> TrialResult:
    """Run one trial to completion (see ``Trial``)."""
    return create_trial(runtime, request, on_phase=on_phase).run()


__all__ = ["create_trial", "run_trial"]
