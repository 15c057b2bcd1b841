"""What one rollout runs: task + request -> ``TrialSpec`` (+ its secrets and content).

The agent is the ``oracle`` or a bundled ``AgentWorkflow`` (``prepare_bundle``
turns a workflow reference into the files a trial places and the dependency
layer its image needs). The verifier is the task's own ``tests/test.sh`` when it
has one, otherwise the bundled grader through a generated ``test.sh``. A bundle
has two parts: the agent's (a manifest without grader refs, the wheel without the
grader's and its config's modules) and the grader's (all of it), which only the
verifier side gets. The
workflow's ``rollout.json`` carries a relay token and the relay's container
socket, never the trainer's key; the grader's copy carries the label.
"""

from __future__ import annotations

import importlib.util
import secrets
import sys
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from harbor_exec.agents.base import AgentSpec
from harbor_exec.agents.native.agent import native_agent_spec
from harbor_exec.agents.native.config import NativeAgentConfig, check_model_name
from harbor_exec.agents.oracle import OracleAgentSpec
from harbor_exec.agents.workflow import WorkflowAgentSpec
from harbor_exec.authoring import RolloutContext
from harbor_exec.backends.harbor.outcomes import OutcomeSpec
from harbor_exec.backends.harbor.resolver import ResolvedTask, RolloutRejected
from harbor_exec.container.exchange import (
    MANIFEST_PATH,
    RELAY_SOCKET,
    RUNTIME_PYTHON_VERSION,
    USER_CODE_DIR,
    RelayInput,
    RolloutInput,
)
from harbor_exec.executors.spec import ModelEndpoint, TrialContent, TrialSecrets, model_endpoint
from harbor_exec.protocol import ExecutionRequest, rollout_dir_name
from harbor_exec.sandbox.archives import ArchiveEntry
from harbor_exec.sandbox.deps import DepsLayer
from harbor_exec.trial.policy import SandboxPolicy
from harbor_exec.trial.spec import TrialSpec, VerifierKind


@dataclass(frozen=True)
class PreparedBundle:
    """A built workflow bundle as trials use it: its agent's part and its grader's."""

    name: str  # the workflow reference, reported as the agent's name
    version: str
    key: str  # content key of ``agent_files`` (from the bundle's digest)
    # The agent's container: the manifest without grader refs and the unpacked wheel
    # without the modules of the grader and its config (``Manifest.grader_only``).
    agent_files: list[ArchiveEntry] = field(repr=False)
    grader_key: str  # content key of ``grader_files``
    # The verifier side only (``GRADER_DIR``): the full manifest and the whole wheel.
    grader_files: list[ArchiveEntry] = field(repr=False)
    deps: DepsLayer
    has_grader: bool
    has_workflow: bool = True  # False: grader-only, beside one of Harbor's own agents


def prepare_bundle(
    agent: str | type | None,
    *,
    workflow_config: Any = None,
    grader: Any = None,
    grader_config: Any = None,
    code_dir: str | Path | None = None,
    bundle: Any = None,
    agent_from_bundle: bool = False,
    strict_grader_isolation: bool = False,
) -> PreparedBundle:
    """Build (or reuse) the bundle of ``agent`` and read what trials need from it;
    ``agent`` None: a grader-only bundle (the agent is one of Harbor's own), or, with
    ``agent_from_bundle``, the workflow the prebuilt ``bundle`` names. ``bundle``: a
    ``Bundle`` or a path (``bundler.prebuilt.load_bundle``)."""
    from harbor_exec.bundler import Bundle, build_bundle  # the bundler extra: workflows only
    from harbor_exec.bundler.prebuilt import load_bundle

    if bundle is not None and not isinstance(bundle, Bundle):
        if not isinstance(bundle, str | Path):
            raise TypeError(
                f"bundle must be a Bundle or the path of one (or of a bundle wheel); got "
                f"{type(bundle).__name__}"
            )
        bundle = load_bundle(bundle, strict_grader_isolation=strict_grader_isolation)
    if strict_grader_isolation and bundle is not None and bundle.manifest.grader_exposed:
        raise ValueError(
            f"the bundle in {bundle.root} keeps its grader in a module the workflow imports "
            "(the agent's container can read it) and strict_grader_isolation is set: "
            "put the grader and its config in their own module and bundle it again"
        )
    if agent_from_bundle:
        if bundle is None or bundle.manifest.workflow is None:
            raise ValueError("pass agent= (the bundle, if any, names no workflow)")
        agent = bundle.manifest.workflow
    workflow_ref = _ref_for(agent, what="agent")
    grader_ref = _ref_for(grader, what="grader")
    if bundle is not None:
        # A supplied bundle is used as built (as in osmosis-ai): refs that disagree with
        # it would run other code than the caller named.
        for what, ref, built in (
            ("agent", workflow_ref, bundle.manifest.workflow),
            ("grader", grader_ref, bundle.manifest.grader),
        ):
            if ref is not None and built is not None and ref != built:
                raise ValueError(
                    f"{what}={ref!r} differs from the bundle's {built!r} ({bundle.root}): "
                    f"omit {what}= or rebuild the bundle"
                )
    if bundle is None:
        main_ref = workflow_ref or grader_ref
        if main_ref is None:
            raise ValueError("a grader-only bundle needs a grader")
        project = Path(code_dir) if code_dir else _project_dir_of(main_ref)
        bundle = build_bundle(
            project,
            workflow=workflow_ref,
            grader=grader_ref,
            workflow_config=_ref_for(workflow_config, what="workflow_config"),
            grader_config=_ref_for(grader_config, what="grader_config"),
            strict_grader_isolation=strict_grader_isolation,
        )
    if workflow_ref is None and bundle.manifest.grader is None:
        raise ValueError(f"the bundle in {bundle.root} names no grader for this agent to use")
    if bundle.manifest.python_version != RUNTIME_PYTHON_VERSION:
        raise ValueError(
            f"the bundle at {bundle.root} was built for Python {bundle.manifest.python_version}; "
            f"trial containers run the runtime's Python {RUNTIME_PYTHON_VERSION}: build it "
            f"with python_version={RUNTIME_PYTHON_VERSION!r} (the default)"
        )
    files = [ArchiveEntry(MANIFEST_PATH, bundle.manifest_path.read_bytes(), 0o644)]
    # ``files`` are the grader's part (the full manifest, the whole wheel); the agent's
    # part names no grader and leaves out the modules of grader and grader_config.
    manifest = bundle.manifest
    split = manifest.grader_only or manifest.grader_exposed
    if (manifest.grader or manifest.grader_config) and not split:
        # Only a bundle built before the split lacks them: its agent part would hold the grader.
        raise ValueError(
            f"the bundle in {bundle.root} names no grader-only modules; it predates the "
            "agent/grader split: build it again with this harbor-exec (build_bundle)"
        )
    agent_manifest = manifest.agent_copy().model_dump_json(indent=2).encode() + b"\n"
    agent_files = [ArchiveEntry(MANIFEST_PATH, agent_manifest, 0o644)]
    with zipfile.ZipFile(bundle.wheel) as wheel:
        for info in wheel.infolist():
            if info.is_dir() or ".dist-info/" in info.filename:
                continue
            files.append(ArchiveEntry(f"{USER_CODE_DIR}/{info.filename}", wheel.read(info)))
            if manifest.in_agent_part(info.filename):
                agent_files.append(files[-1])
    if workflow_ref is None:  # no workflow: nothing of the bundle enters the agent's container
        agent_files = []
    return PreparedBundle(
        name=workflow_ref or bundle.manifest.grader or "",
        version=bundle.digest[:12],
        key=f"b-agent-{bundle.digest}",
        agent_files=agent_files,
        grader_key=f"b-grader-{bundle.digest}",
        grader_files=files,
        deps=DepsLayer(bundle.wheelhouse, bundle.manifest.pip_wheel, bundle.requirements_digest),
        has_grader=manifest.grader is not None,
        has_workflow=workflow_ref is not None,
    )


@dataclass(frozen=True)
class RolloutPlan:
    """One rollout, ready for an executor."""

    task_id: str
    trial: TrialSpec
    secrets: TrialSecrets
    content: TrialContent  # the bundle's two parts (the spec names them by key)
    outcome: OutcomeSpec


class TrialPlanner:
    """Plans rollouts for one agent (oracle or bundle) under one sandbox policy."""

    def __init__(
        self,
        *,
        bundle: PreparedBundle | None,
        policy: SandboxPolicy,
        trials_dir: Path,
        relay_extra_routes: tuple[str, ...] = (),
        native: NativeAgentConfig | None = None,
        prefer_grader: bool = False,
        grader_env: Mapping[str, str] | None = None,
    ) -> None:
        self.bundle = bundle
        self.prefer_grader = prefer_grader
        self.grader_env = dict(grader_env or {})
        self.native = native
        self.policy = policy
        self.trials_dir = trials_dir
        self.relay_extra_routes = relay_extra_routes

    def plan(
        self, request: ExecutionRequest, resolved: ResolvedTask, context: RolloutContext
    ) -> RolloutPlan:
        task, task_id = resolved.task, resolved.task_id
        bundle = self.bundle
        verify = request.grade
        if verify and not task.has_tests and (bundle is None or not bundle.has_grader):
            raise RolloutRejected(
                f"grade=true but task {task_id!r} has no tests/test.sh and no grader is configured"
            )
        prompt = request.prompt or [{"role": "user", "content": task.instruction}]
        rollout_input = RolloutInput(
            rollout_id=request.id, prompt=prompt, metadata=request.metadata
        )
        # The verifier's copy carries the label and never the key. A task's own
        # tests may read it too (template tasks check answers against the label).
        grader_input = rollout_input.model_copy(update={"label": request.label})
        grader_bytes = grader_input.model_dump_json().encode()
        agent: AgentSpec = OracleAgentSpec()
        model: ModelEndpoint | None = None
        agent_input: bytes | None = None
        if bundle is not None and bundle.has_workflow:
            model = _model_endpoint(context, self.relay_extra_routes)
            # The workflow sees the relay's token as its key and a loopback URL that the
            # runner opens onto the mounted relay socket.
            relay = RelayInput(socket=RELAY_SOCKET, path=urlsplit(model.url).path.rstrip("/"))
            workflow_input = rollout_input.model_copy(
                update={"api_key": model.token, "relay": relay}
            )
            agent = WorkflowAgentSpec(name=bundle.name, version=bundle.version)
            agent_input = workflow_input.model_dump_json().encode()
        if self.native is not None:
            model = _model_endpoint(context, self.relay_extra_routes)
            model_name = self.native.model_name
            if request.metadata and "harbor_model" in request.metadata:
                try:
                    model_name = check_model_name(
                        request.metadata["harbor_model"], field_name="metadata.harbor_model"
                    )
                except ValueError as exc:
                    raise RolloutRejected(str(exc)) from None
            # The resolver made the instruction: the prompt in template mode, else instruction.md.
            agent = native_agent_spec(self.native, task.instruction, model_name)
        # A task's own tests verify; without them (or when it is preferred), the grader.
        graded = bundle is not None and bundle.has_grader and self.prefer_grader
        verifier: VerifierKind = "grader" if verify and (graded or not task.has_tests) else "tests"
        trial = TrialSpec(
            task=task,
            trials_dir=self.trials_dir,
            agent=agent,
            verifier=verifier,
            verify=verify,
            trial_name=f"{rollout_dir_name(request.id)}__{secrets.token_hex(4)[:7]}",
            verifier_timeout_sec=request.grader_timeout_sec,
            rollout_id=request.id,
            bundle=bundle.key if bundle is not None and bundle.has_workflow else None,
            # The grader's part travels only to trials its grader verifies.
            grader_bundle=(
                bundle.grader_key if bundle is not None and verifier == "grader" else None
            ),
            policy=self.policy,
            deps=bundle.deps if bundle is not None else None,
        )
        trial_secrets = TrialSecrets(
            model=model,
            scrub=[
                *([model.api_key] if model is not None and model.api_key else []),
                # A native agent writes its key (the token) into its own trajectory.
                *([model.token] if model is not None and self.native is not None else []),
                *(value for value in self.grader_env.values() if value),
            ],
            agent_input=agent_input,
            verifier_input=grader_bytes if verify else None,
            grader_env=self.grader_env if verifier == "grader" else {},
        )
        content = (
            TrialContent(bundle_files=bundle.agent_files, grader_files=bundle.grader_files)
            if bundle is not None
            else TrialContent()
        )
        outcome = OutcomeSpec(
            task_id=task_id,
            is_oracle=bundle is None and self.native is None,
            verify=verify,
            agent_timeout_sec=request.agent_timeout_sec,
        )
        return RolloutPlan(task_id, trial, trial_secrets, content, outcome)


def _model_endpoint(context: RolloutContext, extra_routes: tuple[str, ...] = ()) -> ModelEndpoint:
    """The rollout's model (URL and key, as the request gave them) for the relay."""
    url = context.chat_completions_url
    if not url:
        raise RolloutRejected("chat_completions_url is empty; the workflow needs an endpoint")
    try:
        return model_endpoint(url, context.api_key, extra_routes)
    except ValueError as exc:
        raise RolloutRejected(str(exc)) from None


def _ref_for(obj: Any, *, what: str) -> str | None:
    """``module:attr`` for a class, a ``module:attr`` string, or a module-level instance."""
    if obj is None:
        return None
    if isinstance(obj, str):
        if ":" not in obj:
            raise ValueError(f"{what} must be 'module:attr'; got {obj!r}")
        return obj
    if isinstance(obj, type):
        return f"{obj.__module__}:{obj.__qualname__}"
    # A config instance: find the module-level name it is bound to.
    for module in list(sys.modules.values()):
        for name, value in list(getattr(module, "__dict__", {}).items()):
            if value is obj:
                return f"{module.__name__}:{name}"
    raise ValueError(
        f"{what}: pass a 'module:attr' string (the bundle imports it inside the container); "
        f"{obj!r} is not a module-level object"
    )


def _project_dir_of(ref: str) -> Path:
    """The first parent of ``ref``'s module file that has a ``pyproject.toml``."""
    spec = importlib.util.find_spec(ref.split(":", 1)[0])
    if spec is None or spec.origin is None:
        raise ValueError(f"cannot find the module of {ref!r} on sys.path; pass code_dir=")
    path = Path(spec.origin).resolve()
    for parent in path.parents:
        if (parent / "pyproject.toml").is_file():
            return parent
    raise ValueError(
        f"cannot find the project of {ref!r} (no pyproject.toml above {path}); pass code_dir="
    )


__all__ = [
    "NativeAgentConfig",
    "PreparedBundle",
    "RolloutPlan",
    "TrialPlanner",
    "prepare_bundle",
]
