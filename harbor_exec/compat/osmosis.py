"""Run workflows, graders and configs written against the osmosis-ai 0.3.8 SDK.

A class that subclasses ``osmosis_ai.rollout.AgentWorkflow`` (or ``Grader``) is wrapped
in a harbor-exec ``AgentWorkflow`` (``Grader``) that runs it with the SDK's own
contexts: an SDK ``RolloutContext`` carrying the rollout's chat URL (the relay's, in
a container), key and id, whose status changes reach harbor-exec's rollout context;
the SDK's ``AgentWorkflowContext``/``GraderContext``; the SDK's output coercion and
reward check. So the SDK's integrations (which read the SDK's ambient context) work,
and a project gives the samples, rewards, metrics and errors that osmosis-ai's own
LocalBackend gives it.

This module also runs inside task containers, so at import it needs only the standard
library, pydantic and ``harbor_exec.authoring``. osmosis-ai itself is optional: it is
looked up in ``sys.modules`` (a class that subclasses the SDK's has imported it
already) and imported only when such a class is run.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, ClassVar

from harbor_exec.authoring import (
    AgentWorkflow,
    AgentWorkflowConfig,
    AgentWorkflowContext,
    AgentWorkflowOutput,
    Grader,
    GraderConfig,
    GraderContext,
    Messages,
    RolloutContext,
    RolloutSample,
    RolloutStatus,
    SampleSource,
    get_rollout_context,
)

__all__ = [
    "OsmosisGrader",
    "OsmosisWorkflow",
    "as_grader_class",
    "as_workflow_class",
    "is_grader_config",
    "is_osmosis_class",
    "is_workflow_config",
    "sdk_rollout_context",
]

# Where the SDK defines its bases (osmosis-ai 0.3.8).
_SDK_BASES = {
    "workflow": ("osmosis_ai.rollout.agent_workflow", "AgentWorkflow"),
    "grader": ("osmosis_ai.rollout.grader", "Grader"),
    "workflow_config": ("osmosis_ai.rollout.types.config", "AgentWorkflowConfig"),
    "grader_config": ("osmosis_ai.rollout.types.config", "GraderConfig"),
}


def _sdk_base(kind: str) -> type | None:
    """The SDK's base class for ``kind`` if osmosis-ai is imported already, else None."""
    module_name, name = _SDK_BASES[kind]
    module = sys.modules.get(module_name)
    base = getattr(module, name, None) if module is not None else None
    return base if isinstance(base, type) else None


def _is_sdk(obj: Any, kind: str) -> bool:
    base = _sdk_base(kind)
    if base is None:
        return False
    if kind in ("workflow", "grader"):
        return isinstance(obj, type) and issubclass(obj, base)
    return isinstance(obj, base)


def is_osmosis_class(obj: Any) -> bool:
    """True for a subclass of osmosis-ai's ``AgentWorkflow`` or ``Grader``."""
    return _is_sdk(obj, "workflow") or _is_sdk(obj, "grader")


def is_workflow_config(obj: Any) -> bool:
    """A harbor-exec or osmosis-ai ``AgentWorkflowConfig`` instance."""
    return isinstance(obj, AgentWorkflowConfig) or _is_sdk(obj, "workflow_config")


def is_grader_config(obj: Any) -> bool:
    """A harbor-exec or osmosis-ai ``GraderConfig`` instance."""
    return isinstance(obj, GraderConfig) or _is_sdk(obj, "grader_config")


# --------------------------------------------------------------------------- samples


def _to_sdk_sample(sample: RolloutSample | None) -> Any:
    from osmosis_ai.rollout.types import RolloutSample as SdkRolloutSample

    if sample is None:
        return None
    # Every field passed explicitly, so trajectory_messages (None included) is kept.
    return SdkRolloutSample.model_validate(dict(sample))


def _from_sdk_sample(sample: Any) -> RolloutSample | None:
    if sample is None:
        return None
    if isinstance(sample, RolloutSample):
        return sample
    return RolloutSample.model_validate(dict(sample))


def _copy_sample_into(target: RolloutSample, source: RolloutSample) -> None:
    """Give ``target`` the fields of ``source`` in place, so whoever holds ``target``
    (the backend, for a grader that failed half way) sees what the grader changed."""
    for name in RolloutSample.model_fields:
        value = getattr(source, name)
        if getattr(target, name) is not value:
            setattr(target, name, value)


class _FixedSample(SampleSource):
    """The SDK sample source's sample, handed to harbor-exec's rollout context."""

    def __init__(self, sample: RolloutSample) -> None:
        self.sample = sample

    async def get_sample(self) -> RolloutSample:
        return self.sample


# --------------------------------------------------------------------------- contexts


class _DelegatedArtifacts:
    """``artifacts_dir`` read from harbor-exec's context on first access (it may make
    the directory lazily); listed first in the bases so it wins over the field."""

    _harbor_context: AgentWorkflowContext[Any] | GraderContext
    _artifacts_override: tuple[Path | None] | None = None

    @property
    def artifacts_dir(self) -> Path | None:
        if self._artifacts_override is not None:
            return self._artifacts_override[0]
        return self._harbor_context.artifacts_dir

    @artifacts_dir.setter
    def artifacts_dir(self, value: Path | None) -> None:
        self._artifacts_override = (value,)


_context_types: dict[str, type] = {}


def _sdk_context_type(kind: str) -> type:
    """A subclass of the SDK's workflow (grader) context with delegated artifacts."""
    if kind not in _context_types:
        from osmosis_ai.rollout import context as sdk_context

        base = sdk_context.AgentWorkflowContext if kind == "workflow" else sdk_context.GraderContext
        _context_types[kind] = type(f"Harbor{base.__name__}", (_DelegatedArtifacts, base), {})
    return _context_types[kind]


def _sdk_workflow_context(context: AgentWorkflowContext[Any]) -> Any:
    sdk: Any = object.__new__(_sdk_context_type("workflow"))
    sdk.prompt = context.prompt
    sdk.config = context.config
    sdk.metadata = context.metadata
    sdk._harbor_context = context
    return sdk


def _sdk_grader_context(context: GraderContext) -> Any:
    sdk: Any = object.__new__(_sdk_context_type("grader"))
    sdk.label = context.label
    sdk.sample = _to_sdk_sample(context.sample)
    sdk.project_path = context.project_path
    sdk.metadata = context.metadata
    sdk._harbor_context = context
    return sdk


def sdk_rollout_context(rollout: RolloutContext) -> Any:
    """The SDK's ambient context for ``rollout``: same URL, key and id; its status
    changes are passed on to ``rollout`` (which tells the server)."""
    from osmosis_ai.rollout.context import RolloutContext as SdkRolloutContext
    from osmosis_ai.rollout.context import RolloutProgress
    from osmosis_ai.rollout.types import RolloutStatus as SdkRolloutStatus

    def pass_on(status: Any) -> None:
        rollout.update_status(RolloutStatus(str(status.value)))

    progress = RolloutProgress(status=SdkRolloutStatus(rollout.status.value), on_status=pass_on)
    return SdkRolloutContext(
        chat_completions_url=rollout.chat_completions_url,
        api_key=rollout.api_key,
        rollout_id=rollout.rollout_id,
        progress=progress,
    )


# --------------------------------------------------------------------------- adapters


class OsmosisWorkflow(AgentWorkflow[Any]):
    """Runs the osmosis-ai workflow class ``sdk_class`` (see ``as_workflow_class``)."""

    sdk_class: ClassVar[type[Any]]

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        self.sdk_workflow: Any = self.sdk_class(config)

    async def run(self, ctx: AgentWorkflowContext[Any]) -> AgentWorkflowOutput | Messages | None:
        from osmosis_ai.rollout.types.output import coerce_output

        rollout = get_rollout_context() or RolloutContext()
        sdk_rollout = sdk_rollout_context(rollout)
        # As osmosis-ai's LocalBackend: run and collect the sample inside the SDK context.
        with sdk_rollout:
            output = coerce_output(await self.sdk_workflow.run(_sdk_workflow_context(ctx)))
            if output is not None:
                return AgentWorkflowOutput(
                    messages=output.messages, metrics=dict(output.metrics), info=output.info
                )
            sample = _from_sdk_sample(await sdk_rollout.get_sample())
        if sample is None:
            # The SDK's "no sample": the workflow succeeds, grading it fails.
            return AgentWorkflowOutput(messages=None)
        rollout.set_sample_source(_FixedSample(sample))
        return None


class OsmosisGrader(Grader):
    """Runs the osmosis-ai grader class ``sdk_class`` (see ``as_grader_class``)."""

    sdk_class: ClassVar[type[Any]]

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        self.sdk_grader: Any = self.sdk_class(config)

    async def grade(self, ctx: GraderContext) -> Any:
        from osmosis_ai.rollout.utils.rewards import validate_sample_has_reward

        sdk_context = _sdk_grader_context(ctx)
        try:
            returned = await self.sdk_grader.grade(sdk_context)
        finally:
            graded = _from_sdk_sample(sdk_context.sample)
            if ctx.sample is not None and graded is not None:
                _copy_sample_into(ctx.sample, graded)
            else:
                ctx.sample = graded
        # The SDK's own check and message for a sample left without a reward.
        validate_sample_has_reward(sdk_context.sample)
        return returned


_adapters: dict[type, type] = {}


def _adapter(cls: type, base: type) -> type:
    if cls not in _adapters:
        _adapters[cls] = type(
            cls.__name__,
            (base,),
            {"sdk_class": cls, "__module__": cls.__module__, "__qualname__": cls.__qualname__},
        )
    return _adapters[cls]


def as_workflow_class(obj: Any) -> type[AgentWorkflow[Any]] | None:
    """``obj`` as a harbor-exec workflow class: itself when it is one, its adapter when it
    subclasses osmosis-ai's ``AgentWorkflow``, else None."""
    if isinstance(obj, type) and issubclass(obj, AgentWorkflow):
        return obj
    if _is_sdk(obj, "workflow"):
        adapter: type[AgentWorkflow[Any]] = _adapter(obj, OsmosisWorkflow)
        return adapter
    return None


def as_grader_class(obj: Any) -> type[Grader] | None:
    """``obj`` as a harbor-exec grader class: itself when it is one, its adapter when it
    subclasses osmosis-ai's ``Grader``, else None."""
    if isinstance(obj, type) and issubclass(obj, Grader):
        return obj
    if _is_sdk(obj, "grader"):
        adapter: type[Grader] = _adapter(obj, OsmosisGrader)
        return adapter
    return None
