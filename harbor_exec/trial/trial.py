"""One trial: environment, agent, verifier, teardown, in Harbor's order and semantics.

A trial is a plain object over a ``ContainerRuntime``: no global state, so it
can run in a thread here or in a Ray actor elsewhere. ``Trial.run`` blocks and
always returns a ``TrialResult`` (also written as ``<trials_dir>/<name>/result.json``);
failures are recorded by Harbor's exception names, never raised.

Order (reference harbor-tasks.md §4), with the calls each step costs:

1. environment: build or reuse the image; create the container; one archive
   upload places ``/logs/{agent,verifier,artifacts}`` (mode 777) and the agent's
   files (``/solution`` for the oracle); start.
2. agent: run under ``[agent].timeout_sec``; on expiry ``AgentTimeoutError`` is
   recorded and the trial still verifies. A non-zero exit is written to
   ``agent/exit-code.txt``. Then every process of the agent phase is killed from
   outside the container (``ContainerRuntime.stop_processes``), however it detached.
3. verifier, in the task's mode (or ``SandboxPolicy.verifier_mode``):
   *shared*: ``/tests`` and an empty ``/logs/verifier`` are placed through the
   engine (replacing whatever the agent left there), ``test.sh`` runs, its leftovers
   are killed, ``/logs/verifier`` is read back through the engine's archive API and
   the reward parsed, then ``/logs/agent`` and ``/logs/artifacts``;
   *separate* (Harbor 0.26): before the verifier's clock starts, ``/logs/agent``,
   ``/logs/artifacts`` and the task's declared ``artifacts`` are copied out, the
   agent's container is removed, and ``test.sh`` runs in a fresh container of the
   verifier image with only those artifacts copied in; then ``/logs/verifier``.
4. teardown: remove the container (milliseconds, thanks to the init process),
   write ``result.json``.

The verdict is read first, on its own budget: ``/logs/verifier`` is its own archive
under ``SandboxPolicy.verifier_output``, so nothing the agent wrote can crowd it out.
What the agent wrote (``/logs/agent``, ``/logs/artifacts``, declared artifacts) shares
``SandboxPolicy.output``; a spent budget drops the rest unread and is recorded as
``AgentOutputLimitError`` (agent-side, the verifier's reward stands); what was
skipped or cut is noted in ``<trial>/copy-back.json``.
"""

from __future__ import annotations

import json
import logging
import re
import secrets as secrets_module
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from functools import partial
from pathlib import PurePosixPath
from typing import IO, TYPE_CHECKING, ClassVar, Literal

from harbor_exec.agents.base import Agent, AgentRun
from harbor_exec.agents.native.layer import ensure_agent_layer
from harbor_exec.agents.oracle import OracleAgent
from harbor_exec.container.exchange import AGENT_SAMPLE, BUNDLE_ROOT, ErrorDetail, ErrorFile
from harbor_exec.container.redaction import redact, scrub_tree
from harbor_exec.errors import (
    AddTestsDirError,
    AgentEndedContainerError,
    AgentOutputLimitError,
    AgentTimeoutError,
    CancelledError,
    DiskBudgetExceededError,
    EngineUnavailableError,
    EnvironmentStartError,
    GpuUnavailableError,
    HarborExecError,
    HealthcheckError,
    RewardFileNotFoundError,
    SandboxBuildFailedError,
    TaskConfigError,
    TrialError,
    TrialPhase,
    VerifierTimeoutError,
    policy_for,
)
from harbor_exec.network.egress.plan import ContainerKind, TrialEgress, network_plan
from harbor_exec.network.egress.policy import EgressMode
from harbor_exec.network.packages.build_route import BuildCache, build_cache, cache_build_options
from harbor_exec.sandbox.archives import (
    ArchiveEntry,
    ExtractReport,
    build_archive,
    extract_archive,
    tree_entries,
    write_archive,
)
from harbor_exec.sandbox.deps import bake_deps_into_image, ensure_deps_env
from harbor_exec.sandbox.runtime import (
    DROPPED_CAPABILITIES,
    LABEL_KIND,
    LABEL_ROLLOUT,
    LABEL_TASK,
    LABEL_TRIAL,
    ContainerRuntime,
    ContainerSpec,
    Mount,
)
from harbor_exec.sandbox.seccomp import SECCOMP_ALLOW_LABEL, requested_syscalls
from harbor_exec.sandbox.users import ImageAccounts, UnknownUserError, is_root
from harbor_exec.tasks.config import EnvironmentConfig, HealthcheckConfig, resolve_env
from harbor_exec.tasks.task import Task
from harbor_exec.trial.artifacts import CONVENTION_DIR, TrialArtifacts, remove_path
from harbor_exec.trial.base_images import ensure_base_images
from harbor_exec.trial.compose import ComposeEnvironment, is_compose_task, prepare_images
from harbor_exec.trial.diskwatch import DiskWatch
from harbor_exec.trial.outputs import TrialOutput, read_agent_output, read_grader_output
from harbor_exec.trial.policy import ContainerLimits, VerifierMode
from harbor_exec.trial.results import (
    AgentResult,
    ExceptionInfo,
    TimingInfo,
    TrialResult,
    VerifierResult,
    parse_rewards,
    utcnow,
)
from harbor_exec.trial.session import TrialSession
from harbor_exec.trial.spec import TrialSpec
from harbor_exec.trial.verifiers import TestsVerifier
from harbor_exec.trial.warm import WarmClaim, WarmPool, WarmSettings

if TYPE_CHECKING:
    from harbor_exec.network.egress.proxy import Announcement
    from harbor_exec.network.packages.service import PackageCacheService
    from harbor_exec.network.packages.session import TrialPackageCache

#: Called (on the trial's thread) as the trial enters each phase, ``DONE`` last.
PhaseCallback = Callable[[TrialPhase], None]
#: Blocks until a trial whose environment is up may run its agent; returns early when
#: the event (the trial's cancellation) is set (``TrialRequest.wait_turn``).
WaitTurn = Callable[[threading.Event], None]
#: "image": the image's USER, as an exec without a user runs (Harbor's healthcheck).
UserRole = Literal["agent", "verifier", "image"]
logger = logging.getLogger(__name__)

_NAME_UNSAFE = re.compile(r"[^a-zA-Z0-9_.-]+")
#: What a grader finds when the agent handed over no sample: the runner's error form.
_NOTHING_HANDED_OVER = (
    ErrorFile(error=ErrorDetail(type="NoSample", message="the workflow handed over no sample"))
    .model_dump_json()
    .encode()
)

LOG_DIRS = ("/logs", "/logs/agent", "/logs/verifier", CONVENTION_DIR)
#: An image label naming capabilities (of ``DROPPED_CAPABILITIES``) the task needs back,
#: e.g. ``LABEL harbor-exec.cap-add="SYS_CHROOT,MKNOD"`` in its Dockerfile.
CAP_ADD_LABEL = "harbor-exec.cap-add"
_MIB = 1024 * 1024


def image_tag_for(task: Task) -> str:
    """The content-addressed tag of a task's environment image."""
    return f"harbor-exec/env:{task.environment_digest()[:32]}"


def new_trial_name(task_name: str) -> str:
    """Harbor's shape: ``{task_name[:32]}__{7 random chars}``."""
    stem = _NAME_UNSAFE.sub("-", task_name.split("/")[-1])[:32].rstrip("_-") or "task"
    return f"{stem}__{secrets_module.token_hex(4)[:7]}"


def ensure_task_image(
    runtime: ContainerRuntime, task: Task, cache: BuildCache | None = None
) -> tuple[str, bool]:
    """Build (or reuse) the task's image; returns ``(image, built_now)``. With ``cache``
    (and a task that does not opt out) the build reaches the internet through the
    package cache (``harbor_exec.network.packages.build_gateway``)."""
    env = task.config.environment
    if is_compose_task(task):  # every service's image (prewarm builds them all)
        _project, images, built = prepare_images(runtime, task, cache)
        return images["main"], built > 0
    dockerfile = task.dockerfile
    if dockerfile is None:
        assert env.docker_image is not None  # load_task guarantees one of the two
        runtime.ensure_present(env.docker_image)
        return env.docker_image, False
    try:
        result = runtime.ensure_image(
            context_dir=task.environment_dir,
            tag=image_tag_for(task),
            timeout_sec=env.build_timeout_sec,
            labels={LABEL_KIND: "task-env", LABEL_TASK: task.name},
            before_build=partial(ensure_base_images, runtime, task, dockerfile),
            **cache_build_options(runtime, task, cache, dockerfile, image_tag_for(task)),
        )
    except SandboxBuildFailedError as exc:
        raise SandboxBuildFailedError(task.in_own_terms(str(exc))) from None
    return result.tag, result.built


@dataclass
class TrialRequest:
    """A runnable trial: its ``spec`` (what the trial is, plain data) and what this
    machine made of it to run: the agent, the verifier, the values to scrub, the mounts
    (``harbor_exec.executors.spec.trial_request`` makes one from a spec)."""

    spec: TrialSpec
    #: The agent that runs (the spec's agent kind made it; the oracle by default).
    agent: Agent = field(default_factory=OracleAgent)
    verifier: TestsVerifier | None = None  # None: the task's own tests/
    secrets: Sequence[str] = ()  # scrubbed from everything written under the trial dir
    mounts: Sequence[Mount] = ()  # into the agent's container only (e.g. the model relay)
    #: This machine's live package cache (a service, beside the spec, never inside its
    #: policy); None: the trial's fetches go straight to the network.
    package_cache: PackageCacheService | None = None
    #: This engine's warm containers (``harbor_exec.trial.warm``); None: every container
    #: is created for its trial.
    warm_pool: WarmPool | None = None
    #: Called once the environment is up, before the agent: blocks until the trial may
    #: run (``validate``/``run`` start the next trials ahead of their slot:
    #: ``harbor_exec.jobs.ahead``); returns early when the given event (the trial's
    #: cancellation) is set. None: the trial runs on at once.
    wait_turn: WaitTurn | None = None


class Trial:
    """Runs one ``TrialRequest`` of a single-step task; ``cancel()`` may be called from
    any thread. A multi-step task runs as ``harbor_exec.trial.steps.MultiStepTrial``, this
    class's subclass (``harbor_exec.trial.factory.create_trial`` picks the class), which
    replaces ``run_phases`` and reads the task's steps through the methods below."""

    #: Whether this class runs a task's ``[[steps]]`` (``MultiStepTrial`` does).
    runs_steps: ClassVar[bool] = False

    def __init__(
        self,
        runtime: ContainerRuntime,
        request: TrialRequest,
        *,
        on_phase: PhaseCallback | None = None,
    ) -> None:
        if request.spec.task.is_multi_step and not self.runs_steps:
            raise TypeError(
                f"{request.spec.task.name} is a multi-step task: it runs as a MultiStepTrial "
                "(harbor_exec.trial.factory.create_trial picks the class)"
            )
        self.runtime = runtime
        self.request = request
        self.name = request.spec.trial_name or new_trial_name(request.spec.task.name)
        self.dir = request.spec.trials_dir / self.name
        self.images_built = 0  # task image and dependency layer built by this trial
        self._on_phase = on_phase
        self._cancelled = threading.Event()
        self._container_lock = threading.Lock()
        self._container_id: str | None = None
        self._exception: ExceptionInfo | None = None
        #: The sample the agent handed over as its exec ended (``AgentRun.sample``).
        self._agent_sample: bytes | None = None
        #: Files the agent wrote on the host (``AgentRun.host_files``), kept the same way.
        self._host_files: dict[str, bytes] = {}
        self._verifier_logs_read = False
        self._agent_logs_read = False
        #: One budget for everything the agent wrote (``SandboxPolicy.output``).
        self._agent_copy = ExtractReport()
        self.accounts: ImageAccounts | None = None
        self.default_user = ""
        #: ``artifacts/``: ``/logs/artifacts`` and the declared ones, on the same budget.
        self.artifacts = TrialArtifacts(
            runtime, self.dir, limits=request.spec.policy.output, budget=self._agent_copy
        )
        self._verifier_copy = ExtractReport()
        #: The exchange files, read as ``/logs`` comes back (see ``_download_logs``).
        self.output = TrialOutput()
        self.image = request.spec.image or ""
        self.deps_volume: str | None = None  # the dependency environment, once ensured
        self.deps_baked = False  # ... and baked into ``self.image`` (``deps_in_image``)
        self.agent_volume: str | None = None  # the agent's layer, once ensured
        self.verifier_mode: VerifierMode = self._choose_verifier_mode()
        self._current_phase: TrialPhase | None = None
        self.network_plan = network_plan(
            request.spec.task.config, separate_verifier=self.verifier_mode == "separate"
        )
        #: This trial's use of the server's package cache (None: not through it).
        self._package_cache = self._cache_session()
        egress = request.spec.policy.egress
        if self._package_cache is not None:
            egress = replace(egress, upstream=self._package_cache.upstream)
        self._egress = TrialEgress(self.name, self.dir, egress)
        #: Egress forwarders started with their containers (by container name until
        #: created, then by id), and whether each still serves: from its start until
        #: a kill did not spare it (``stop_processes``'s companion).
        self._announcing: dict[str, Announcement] = {}
        self._forwarders: dict[str, Announcement] = {}
        self._forwarder_serves: set[str] = set()
        #: A compose task's sidecars, network and volumes (``harbor_exec.trial.compose``),
        #: one project per container that has them (a multi-step task's separate verifier
        #: gets its own while the agent's stays); the tracked container's is the last.
        self._composes: list[ComposeEnvironment] = []
        #: This trial's asks of the warm pool, released as their containers go.
        self._claims: dict[str, WarmClaim] = {}

    # ----------------------------------------------------------------- control

    def cancel(self) -> None:
        """Stop the trial: its container is removed at once; ``run`` records CancelledError."""
        self._cancelled.set()
        agent_cancel = getattr(self.request.agent, "cancel", None)
        if callable(agent_cancel):  # an agent whose loop runs here (a native agent)
            agent_cancel()
        with self._container_lock:
            container_id = self._container_id
        if container_id is not None:
            self.runtime.remove(container_id)
        self._compose_down()

    @property
    def container_id(self) -> str | None:
        """The container the trial tracks now (None before it is created, once removed)."""
        with self._container_lock:
            return self._container_id

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def check_cancelled(self) -> None:
        if self._cancelled.is_set():
            raise CancelledError("the trial was cancelled")

    def record(self, exc: BaseException) -> None:
        if self._exception is None:  # Harbor keeps only the first exception
            if isinstance(exc, EngineUnavailableError) and self._current_phase:
                exc = exc.during(self._current_phase)
            info = ExceptionInfo.from_exception(exc)
            if self.request.secrets:  # as on disk: the result never holds a secret
                info.exception_message = redact(info.exception_message, self.request.secrets)
                info.exception_traceback = redact(info.exception_traceback, self.request.secrets)
            self._exception = info

    @property
    def exception(self) -> ExceptionInfo | None:
        """The first exception recorded (Harbor keeps only that one)."""
        return self._exception

    def take_exception(self) -> ExceptionInfo | None:
        """The exception recorded so far, cleared: a multi-step trial's is each step's."""
        exception, self._exception = self._exception, None
        return exception

    @property
    def agent_sample(self) -> bytes | None:
        """The sample the agent handed over as its exec ended (``AgentRun.sample``)."""
        return self._agent_sample

    def replace_agent_sample(self, sample: bytes) -> None:
        """Make ``sample`` the rollout's (``agent/sample.json``, read again into
        ``output``); the agent's host files are in their step's ``agent/`` already."""
        self._host_files = {}
        self._agent_sample = sample
        self._pin_agent_sample()
        self.output = TrialOutput(
            agent=read_agent_output(self.dir, self.request.secrets), grader=self.output.grader
        )

    def begin_outputs(self) -> None:
        """Fresh read-back state: the logs, artifacts and sample are read anew (each
        step of a multi-step trial reads its own)."""
        self._verifier_logs_read = self._agent_logs_read = False
        self.artifacts.begin_step()
        self._agent_sample, self._host_files = None, {}

    def outputs_archived(self) -> None:
        """What was read back so far was moved away (a step's, into ``steps/<name>/``):
        nothing of it is read again at teardown."""
        self._verifier_logs_read = self._agent_logs_read = True
        self.artifacts.step_archived()

    def _phase(self, name: TrialPhase) -> None:
        self._current_phase = name
        if self._on_phase is not None:
            self._on_phase(name)

    # ----------------------------------------------------------------- run

    def run(self) -> TrialResult:
        request, task = self.request, self.request.spec.task
        self.dir.mkdir(parents=True, exist_ok=True)
        result = TrialResult(
            task_name=task.name,
            trial_name=self.name,
            trial_uri=self.dir.resolve().as_uri(),
            task_id=task.origin or {"path": str(task.path)},
            source=request.spec.source,
            task_checksum=task.checksum(),
            config=self._config_summary(),
            agent_info=request.agent.info,
            # Harbor 0.26 records None for multi-step trials (resolved per step).
            verifier_environment_mode=None if task.is_multi_step else self.verifier_mode,
            started_at=utcnow(),
        )
        session: TrialSession | None = None
        if self._package_cache is not None:
            egress = request.spec.policy.egress
            self._package_cache.begin(egress.overrides, dns=egress.dns)
        try:
            self.check_supported()
            session = self._environment(result)
            self._healthcheck(session)
            if request.wait_turn is not None:
                request.wait_turn(self._cancelled)
                self.check_cancelled()
            self.run_phases(session, result)
        except (HarborExecError, OSError) as exc:
            self.record(exc if not self.cancelled else CancelledError("the trial was cancelled"))
        except BaseException as exc:  # keep the container accounting right on Ctrl-C too
            self.record(CancelledError(f"interrupted: {type(exc).__name__}"))
            self._teardown(session)
            raise
        self._phase(TrialPhase.TEARDOWN)
        if self.request.warm_pool is not None:
            for claim in list(self._claims.values()):
                self.request.warm_pool.finished(claim)  # its slot is given back now
        self._teardown(session)
        self._phase(TrialPhase.DONE)
        result.exception_info = self._exception
        result.finished_at = utcnow()
        self._write(result)
        return result

    def check_supported(self) -> None:
        """Refuse, before anything is built, what this trial cannot run (nothing here)."""

    def run_phases(self, session: TrialSession, result: TrialResult) -> None:
        """The agent, then the verifier in the trial's mode."""
        if self._exception is None:
            self.run_agent(session, result)
        if self.should_verify():
            if self.verifier_mode == "separate":
                self.verify_separate(session, result)
            else:
                self.verify_shared(session, result)

    def verifier_for(self, task: Task) -> TestsVerifier:
        """The verifier of ``task`` (the request's, else the task's own ``tests/``)."""
        return self.request.verifier or TestsVerifier(task.tests_dir)

    def _build_cache(self) -> BuildCache | None:
        """How this trial's image builds reach the package cache (None: they do not)."""
        return build_cache(self.request.package_cache, self.request.spec.policy.egress)

    def _cache_session(self) -> TrialPackageCache | None:
        service = self.request.package_cache
        if service is None:
            return None
        # Imported here: the cache needs the server extra (httpx, h11, cryptography).
        from harbor_exec.network.packages.session import TrialPackageCache, wanted

        if not wanted(service, self.request.spec.task):
            return None
        phases = (self.network_plan.agent, self.network_plan.verifier)
        if all(p.mode is EgressMode.NO_NETWORK for p in phases):
            return None  # nothing to fetch, nothing to record
        return TrialPackageCache(service, self.request.spec.task)

    def _cached(self, kind: ContainerKind) -> bool:
        """Whether ``kind``'s container reaches the network through the package cache."""
        if self._package_cache is None:
            return False
        return any(p.mode is not EgressMode.NO_NETWORK for p in self.network_plan.phases(kind))

    def _config_summary(self) -> dict[str, object]:
        request, config = self.request, self.request.spec.task.config
        return {
            "task": {"path": str(request.spec.task.path), "source": request.spec.source},
            "trial_name": self.name,
            "trials_dir": str(request.spec.trials_dir),
            "agent": {"name": request.agent.info.name},
            "timeouts": {
                "agent_sec": request.spec.agent_timeout_sec or config.agent.timeout_sec,
                "verifier_sec": request.spec.verifier_timeout_sec or config.verifier.timeout_sec,
                "build_sec": config.environment.build_timeout_sec,
            },
            "verify": request.spec.verify,
            "verifier_environment_mode": self.verifier_mode,
            "rollout_id": request.spec.rollout_id,
        }

    def _choose_verifier_mode(self) -> VerifierMode:
        if self.request.spec.policy.verifier_mode == "separate":
            return "separate"
        if self.request.verifier is not None and self.request.verifier.bundled_grader:
            return self.request.spec.policy.grader_verifier_mode
        config = self.request.spec.task.config.verifier
        if config.environment_mode in ("shared", "separate"):
            return "separate" if config.environment_mode == "separate" else "shared"
        return "separate" if config.environment is not None else "shared"

    def _enter_egress(self, phase: Literal["agent", "verifier"], container_id: str) -> None:
        """The phase's network policy on the trial's proxy, when its container has one."""
        shared = phase == "agent" or self.verifier_mode == "shared"
        kind: ContainerKind = "trial" if shared else "verifier"
        if self.network_plan.proxied(kind) or self._cached(kind):
            policy = self.network_plan.agent if phase == "agent" else self.network_plan.verifier
            serving = self._forwarders.get(container_id)
            if container_id not in self._forwarder_serves:
                serving = None
            self._egress.enter(phase, policy, self.runtime, container_id, serving)

    def _spec(
        self,
        image: str,
        env_config: EnvironmentConfig,
        *,
        kind: str,
        mounts: Sequence[Mount],
        gpus: int = 0,
    ) -> ContainerSpec:
        request, task, policy = self.request, self.request.spec.task, self.request.spec.policy
        image_labels = self.runtime.image_labels(image)
        label = image_labels.get(CAP_ADD_LABEL, "")
        wanted = {c.strip().upper().removeprefix("CAP_") for c in label.split(",") if c.strip()}
        limits = ContainerLimits.resolve(policy, env_config)
        env = resolve_env(
            env_config.env, task=task.name, field="[environment].env", allowed=task.env_allow
        )
        network_kind: ContainerKind = "trial" if kind == "trial" else "verifier"
        if kind == "sidecar":
            pass  # no forwarder to the proxy runs there: it keeps its compose network only
        elif self.network_plan.proxied(network_kind):
            mounts = [*mounts, self._egress.mount()]
            env = {**env, **self._egress.env()}
        elif self._cached(network_kind):
            # The task's own settings win over the cache's (not over a proxied policy's).
            mounts = [*mounts, self._egress.mount()]
            env = {**self._egress.env(), **env}
        if kind != "sidecar" and self._package_cache is not None and self._cached(network_kind):
            mounts = [*mounts, *self._package_cache.trust_mounts()]
            env = {**self._package_cache.env(), **env}
        name = f"hx-{_NAME_UNSAFE.sub('-', self.name)}-{secrets_module.token_hex(3)}"
        before_keep_alive: list[str] = []
        if kind != "sidecar" and (
            self.network_plan.proxied(network_kind) or self._cached(network_kind)
        ):
            # Its forwarder starts with it: its first phase waits for no exec.
            before_keep_alive, self._announcing[name] = self._egress.forwarder_with_container()
        return ContainerSpec(
            image=image,
            name=name,
            before_keep_alive=before_keep_alive,
            labels={
                **request.spec.labels,
                LABEL_TRIAL: self.name,
                LABEL_TASK: task.name,
                LABEL_KIND: kind,
                **({LABEL_ROLLOUT: request.spec.rollout_id} if request.spec.rollout_id else {}),
            },
            env=env,
            cpus=limits.cpus,
            memory_mb=limits.memory_mb,
            pids_limit=limits.pids_limit,
            shm_mb=limits.shm_mb,
            nofile_limit=limits.nofile_limit,
            network=self.network_plan.network(network_kind),
            mounts=mounts,
            cap_add=sorted(wanted & set(DROPPED_CAPABILITIES)),
            syscalls_allowed=requested_syscalls(image_labels.get(SECCOMP_ALLOW_LABEL)),
            gpus=gpus,
            deps_volume=None if kind == "trial" and self.deps_baked else self.deps_volume,
            agent_volume=self.agent_volume if kind == "trial" else None,
            command_channel=policy.command_channel,
        )

    def _create(self, spec: ContainerSpec) -> str:
        projects = len(self._composes)
        spec = self._compose_up(spec)
        with self._container_lock:
            self.check_cancelled()
            container_id = self._container_id = self.runtime.create(spec)
        announcing = self._announcing.pop(spec.name, None)
        if announcing is not None:
            self._forwarders[container_id] = announcing
            self._forwarder_serves.add(container_id)
        if len(self._composes) > projects:
            self._composes[-1].place_main_binds(container_id)
        return container_id

    def _open(self, spec: ContainerSpec) -> tuple[str, bool]:
        """``spec``'s container and whether it is started: a warm one the pool made
        ahead of this trial (``harbor_exec.trial.warm``), else one created now."""
        pool, policy = self.request.warm_pool, self.request.spec.policy
        if (
            pool is None
            or policy.warm_containers <= 0
            or spec.gpus
            or is_compose_task(self.request.spec.task)
        ):
            return self._create(spec), False
        settings = WarmSettings(policy.warm_containers, policy.warm_memory_mb, policy.warm_idle_sec)
        claim = pool.claim(spec, settings)
        if claim.container_id is None:
            try:
                container_id = self._create(spec)
            except BaseException:
                pool.release(claim)
                raise
            self._claims[container_id] = claim
            return container_id, False
        self._announcing.pop(spec.name, None)  # its forwarder starts in its first phase
        self._claims[claim.container_id] = claim
        with self._container_lock:
            self._container_id = claim.container_id
        if self.cancelled:
            self._remove_container()
            self.check_cancelled()
        return claim.container_id, True

    def _start(self, container_id: str, started: bool) -> None:
        if not started:
            self.runtime.start(container_id)
        claim = self._claims.get(container_id)
        if claim is not None and self.request.warm_pool is not None:
            self.request.warm_pool.created(claim)

    def _removed(self, container_id: str) -> None:
        """A container of this trial is gone: its claim (if any) goes back to the pool."""
        claim = self._claims.pop(container_id, None)
        if claim is not None and self.request.warm_pool is not None:
            self.request.warm_pool.release(claim)

    def _compose_up(self, spec: ContainerSpec) -> ContainerSpec:
        """A compose task's sidecars, started around ``spec``'s container (the agent's,
        or a separate verifier's from the task's own environment, as Harbor starts a
        whole new project for it); ``spec`` joined to their network."""
        task = self.request.spec.task
        verifier_env = task.config.verifier.environment
        if not is_compose_task(task) or (
            spec.labels.get(LABEL_KIND) == "verifier"
            and (
                task.verifier_dockerfile is not None or (verifier_env and verifier_env.docker_image)
            )
        ):
            return spec
        project, images, built = prepare_images(self.runtime, task, self._build_cache())
        self.images_built += built
        compose = ComposeEnvironment(
            self.runtime,
            task,
            project,
            self.name,
            labels={k: v for k, v in spec.labels.items() if k != LABEL_KIND},
            base_spec=lambda image, _service: self._spec(
                image, task.config.environment, kind="sidecar", mounts=()
            ),
            start_timeout_sec=task.config.environment.build_timeout_sec,
            cancelled=lambda: self.cancelled,
        )
        self._composes.append(compose)
        return compose.up(spec, {**images, "main": spec.image})

    def _compose_down(self, *, every: bool = True) -> None:
        """Remove the tracked container's compose project (``every``: all of them)."""
        while self._composes:
            self._composes.pop().down()
            if not every:
                return

    def _check_environment_fields(self) -> None:
        """Refuse, before anything is built, the ``[environment]`` fields Harbor 0.26
        refuses on its Docker environment (a TPU slice) or for agents without the
        capability (MCP servers, skills: the oracle ignores both, as in Harbor)."""
        task = self.request.spec.task
        env = task.config.environment
        if env.tpu is not None:
            raise TaskConfigError(
                task.name,
                "[environment].tpu: a TPU slice needs a TPU-capable environment (GKE); "
                "a Docker engine has none",
                file="task.toml",
            )
        for hook in task.config.verifier.collect:
            if hook.service != "main":
                raise TaskConfigError(
                    task.name,
                    f"[[verifier.collect]] service = {hook.service!r}: hooks run in the "
                    "main service only here (not in a compose sidecar)",
                    file="task.toml",
                )
        if isinstance(self.request.agent, OracleAgent):
            return
        for field_name, value in (("mcp_servers", env.mcp_servers), ("skills_dir", env.skills_dir)):
            if value:
                raise TaskConfigError(
                    task.name,
                    f"[environment].{field_name}: the agent {self.request.agent.info.name!r} "
                    "cannot use it here (only the oracle runs such tasks, ignoring it, "
                    "as in Harbor)",
                    file="task.toml",
                )

    def _check_gpus(self) -> int:
        """GPUs to request; ``GpuUnavailableError`` before anything starts when the task
        needs some and the engine has none (Harbor refuses such tasks too)."""
        env = self.request.spec.task.config.environment
        wanted = env.gpus or 0
        if wanted <= 0:
            return 0
        available = self.runtime.gpu_count()
        if available == 0 or 0 < available < wanted:
            types = f" of type {', '.join(env.gpu_types)}" if env.gpu_types else ""
            raise GpuUnavailableError(
                f"task {self.request.spec.task.name}: [environment].gpus = {wanted}{types} but the "
                f"Docker engine has {available if available > 0 else 'no'} GPU(s) to give "
                "(install the NVIDIA container toolkit, or run this task elsewhere)"
            )
        return wanted

    def _environment(self, result: TrialResult) -> TrialSession:
        request, task = self.request, self.request.spec.task
        env_config = task.config.environment
        self._phase(TrialPhase.ENVIRONMENT)
        timing = result.environment_setup = TimingInfo(started_at=utcnow())
        try:
            self._check_environment_fields()
            gpus = self._check_gpus()
            if request.spec.image is None:
                self.image, built = ensure_task_image(self.runtime, task, self._build_cache())
                self.images_built += built
            if request.spec.deps is not None:
                self.deps_volume, built = ensure_deps_env(
                    self.runtime, request.spec.deps, self.image
                )
                self.images_built += built
                if request.spec.policy.deps_in_image:
                    self.image, built = bake_deps_into_image(
                        self.runtime, self.image, self.deps_volume, scratch=self.dir
                    )
                    self.images_built += built
                    self.deps_baked = True
            if request.spec.agent.layer is not None:
                self.agent_volume, built = ensure_agent_layer(
                    self.runtime, request.spec.agent.layer, self.image
                )
                self.images_built += built
            self.check_cancelled()
            container_id, started = self._open(
                self._spec(self.image, env_config, kind="trial", mounts=request.mounts, gpus=gpus)
            )
            entries = [ArchiveEntry(path, None, 0o777) for path in LOG_DIRS]
            entries += request.agent.files(task)
            if (
                task.dockerfile is None
                and task.environment_dir.is_dir()
                and not is_compose_task(task)
            ):
                # Harbor uploads environment/ into the workdir for prebuilt images.
                workdir = env_config.workdir or "/"
                entries += tree_entries(task.environment_dir, workdir.rstrip("/") or "/")
            archive = build_archive(entries)
            users = self._resolve_users(self.image, container_id, ("agent", "verifier", "image"))
            if is_root(users["agent"]):
                # The agent's first command carries these files on its stdin (one fewer
                # call); nothing of the agent's has run yet, so the image's tar is trusted.
                pending: bytes | None = archive
            else:
                self.runtime.put_archive(container_id, archive)
                pending = None
            self._start(container_id, started)
            self.check_cancelled()
        finally:
            timing.finished_at = utcnow()
        return TrialSession(
            self.runtime,
            container_id,
            task,
            pending_files=pending,
            agent_user=users["agent"],
            verifier_user=users["verifier"],
            image_user=users["image"],
        )

    def _resolve_users(
        self, image: str, container_id: str, roles: Sequence[UserRole] = ("agent", "verifier")
    ) -> dict[UserRole, str]:
        """Each of ``roles``' user as numeric ``uid:gid``, from the account files of
        ``container_id`` (created from ``image``, not started). A user left unset is
        the image's USER, as in Harbor."""
        task = self.request.spec.task
        accounts = self.runtime.image_accounts(image, container_id)
        default = self.runtime.image_user(image)
        if image == self.image and self.accounts is None:
            # The trial image's, read before anything ran: what later lookups resolve
            # against (the agent may rewrite the container's account files).
            self.accounts, self.default_user = accounts, default
        resolved: dict[UserRole, str] = {}
        for role in roles:
            user = {"agent": task.agent_user, "verifier": task.verifier_user}.get(role)
            wanted = default if user is None or str(user) == "" else user
            try:
                resolved[role] = accounts.resolve(wanted)
            except UnknownUserError as exc:
                where = f"[{role}].user" if wanted is user else f"the image {image}'s USER"
                raise TaskConfigError(
                    self.request.spec.task.name, f"{where} = {wanted!r}: {exc}", file="task.toml"
                ) from None
        return resolved

    def _healthcheck(self, session: TrialSession) -> None:
        """``[environment.healthcheck]`` before the agent, as Harbor 0.26 runs it (Docker
        HEALTHCHECK's semantics): ``command`` until it exits 0; failures in the first
        ``start_period_sec`` do not count (retried every ``start_interval_sec``), then
        ``retries`` failures in a row (``interval_sec`` apart) are a ``HealthcheckError``."""
        self.run_healthcheck(session, self.request.spec.task.config.environment.healthcheck)

    def run_healthcheck(self, session: TrialSession, check: HealthcheckConfig | None) -> None:
        if check is None:
            return
        start_period_end = time.monotonic() + check.start_period_sec
        failures = 0
        while True:
            in_start_period = time.monotonic() < start_period_end
            ran = session.bash(
                check.command, user=session.image_user, timeout_sec=check.timeout_sec
            )
            self.check_cancelled()
            if ran.exit_code == 0 and not ran.timed_out:
                return
            if not in_start_period:
                failures += 1
                if failures >= check.retries:
                    raise HealthcheckError(
                        f"Healthcheck failed after {check.retries} consecutive retries: "
                        f"{check.command}"
                    )
            pause = check.start_interval_sec if in_start_period else check.interval_sec
            if self._cancelled.wait(pause):
                self.check_cancelled()

    def run_agent(self, session: TrialSession, result: TrialResult) -> None:
        request = self.request
        now = utcnow()
        result.agent_setup = TimingInfo(started_at=now, finished_at=now)
        timeout = request.spec.agent_timeout_sec
        if timeout is None:
            timeout = request.spec.task.agent_timeout_sec
        self._phase(TrialPhase.AGENT)
        timing = result.agent_execution = TimingInfo(started_at=utcnow())
        limits = ContainerLimits.resolve(request.spec.policy, request.spec.task.config.environment)
        watch = DiskWatch(self.runtime, session.container_id, limits.storage_mb * _MIB)
        self._enter_egress("agent", session.container_id)
        try:
            with watch:
                run = request.agent.run(session, timeout)
        except EnvironmentStartError:
            # An exec that failed because the agent ended its container is the
            # agent's outcome (the container was started and healthy before it ran).
            if self.cancelled or self.runtime.container_running(session.container_id):
                raise
            run = AgentRun(exit_code=None, timed_out=False)
            self._revive(session)
        except FileNotFoundError as exc:
            # The oracle without solution/solve.sh: Harbor records it and, the
            # policy saying "grade", still runs the verifier (reward 0, not none).
            self.record(exc)
            run = AgentRun(exit_code=None, timed_out=False)
        finally:
            timing.finished_at = utcnow()
            # Nothing the agent started may run on into the verifier phase.
            if not self.cancelled and self._container_id is not None:
                try:
                    self._stop_processes(session.container_id)
                except EnvironmentStartError:
                    # The container stopped under the kill: the agent ended it.
                    if self.runtime.container_running(session.container_id):
                        raise
                    self._revive(session)
        self._host_files = dict(run.host_files)
        if run.sample is not None:
            self._agent_sample = run.sample
        self._pin_agent_sample()
        self.check_cancelled()
        # Harbor's place for them: after the agent, before anything is read back.
        self._run_collect_hooks(session.container_id)
        result.agent_result = AgentResult.model_validate(run.agent_result or {})
        if watch.exceeded is not None:
            used = watch.exceeded
            why = f" ({used.incomplete})" if used.incomplete else ""
            self.record(
                DiskBudgetExceededError(
                    f"the agent wrote more than its {limits.storage_mb} MB disk budget "
                    f"(at least {used.bytes_used // _MIB} MB{why}); its processes were killed "
                    "and the trial was verified anyway"
                )
            )
        if run.error is not None:
            # Harbor's rule: the agent's exception is the trial's (its key and token
            # scrubbed), counted as an error, and the trial verified as its policy says.
            self.record(run.error)
        if run.timed_out:
            self.record(
                AgentTimeoutError(
                    f"the agent ran past its {timeout:g}s timeout; its processes were killed "
                    "and the trial was verified anyway"
                )
            )
        if run.exit_code not in (0, None) and not run.timed_out and watch.exceeded is None:
            (self.dir / "agent").mkdir(parents=True, exist_ok=True)
            (self.dir / "agent" / "exit-code.txt").write_text(f"{run.exit_code}\n")

    def should_verify(self) -> bool:
        if not self.request.spec.verify or self._container_id is None or self.cancelled:
            return False
        if self._exception is None:
            return True
        return policy_for(self._exception.exception_type).should_grade

    def _verifier_timeout(self) -> float | None:
        timeout = self.request.spec.verifier_timeout_sec
        return self.request.spec.task.verifier_timeout_sec if timeout is None else timeout

    def _run_verifier(
        self,
        session: TrialSession,
        result: TrialResult,
        *,
        upload_tests: bool = True,
        started: datetime | None = None,
    ) -> None:
        """Run ``test.sh`` in ``session`` (its timeout counted from ``started``), then
        read ``/logs/verifier`` through the engine and parse the reward."""
        task = self.request.spec.task
        verifier = self.verifier_for(task)
        timeout = self._verifier_timeout()
        remaining = None if timeout is None else timeout - _elapsed(started)
        placed = self._agent_files(verifier)
        self._enter_egress("verifier", session.container_id)
        run = verifier.run(session, remaining, upload_tests=upload_tests, placed=placed)
        self.check_cancelled()
        if run.timed_out:
            raise VerifierTimeoutError(
                f"tests/test.sh ran past the {timeout:g}s verifier timeout; no reward"
            )
        if run.upload_failed:
            raise AddTestsDirError("uploading tests/ to /tests in the container failed")
        # Whatever test.sh left running (or started through a binary the agent
        # replaced) stops before the reward is read.
        self._stop_processes(session.container_id)
        self._read_verifier_logs(session.container_id)
        result.verifier_result = VerifierResult(rewards=parse_rewards(self.dir / "verifier"))

    def verify_shared(self, session: TrialSession, result: TrialResult) -> None:
        self.artifacts.collect(session.container_id, self.request.spec.task)
        self._phase(TrialPhase.VERIFIER)
        timing = result.verifier = TimingInfo(started_at=utcnow())
        try:
            try:
                self._run_verifier(session, result, started=timing.started_at)
            except (EnvironmentStartError, RewardFileNotFoundError):
                # The container the agent ran in died under the verifier (a signal to
                # its init lands late): the agent's doing; verify once more, restarted.
                if self.cancelled or self.runtime.container_running(session.container_id):
                    raise
                if not self._revive(session):
                    return
                self._run_verifier(session, result, started=timing.started_at)
        except TrialError as exc:
            self.record(exc)
        finally:
            timing.finished_at = utcnow()
        if not self.cancelled:  # the verdict stands; now what the agent wrote
            self._read_agent_logs(session.container_id)
        self.record_agent_overflow()

    def _revive(self, session: TrialSession) -> bool:
        """The agent ended its container: record it as the agent's outcome and start
        the container again (its files stay, none of its processes do) for the
        verifier. False, and the container removed (nothing is verified), when it
        cannot start."""
        self.record(
            AgentEndedContainerError(
                "the agent's container stopped after it had started (its init was killed "
                "or made to exit); it was restarted and verified"
            )
        )
        forwarder = self._forwarders.get(session.container_id)
        if forwarder is not None:  # it starts again with the container
            forwarder.reset()
            self._forwarder_serves.add(session.container_id)
        try:
            self.runtime.start(session.container_id)
        except EnvironmentStartError:
            self._remove_container()
            return False
        return True

    def _stop_processes(self, container_id: str) -> None:
        """Kill everything a phase left in the container; the egress forwarder started
        with it is spared while it is exactly itself (then the next phase needs no new
        one)."""
        forwarder = self._forwarders.get(container_id)
        companion = None
        if forwarder is not None and container_id in self._forwarder_serves:
            companion = forwarder.companion
        if not self.runtime.stop_processes(container_id, companion):
            self._forwarder_serves.discard(container_id)

    def verify_separate(
        self, session: TrialSession, result: TrialResult, *, keep_agent: bool = False
    ) -> None:
        """Harbor 0.26's separate verifier: a fresh container that sees only the artifacts.

        The hand-over (the agent's logs and artifacts, copied out and packed on the
        agent's budget) happens before the verifier's clock starts: nothing the agent
        wrote is charged to the verifier's timeout or crowds its own outputs.
        ``keep_agent``: the agent's container stays for a later step (multi-step tasks);
        the verifier's is removed once it is done."""
        task = self.request.spec.task
        agent_id: str | None = None
        with tempfile.TemporaryFile(dir=self.dir) as handover:
            self._pack_handover(session.container_id, handover)
            if not keep_agent:
                # Before the clock too: removing a layer the agent filled (100,000
                # directories take the engine tens of seconds) is the agent's cost.
                self._remove_container()
            self._phase(TrialPhase.VERIFIER)
            timing = result.verifier = TimingInfo(started_at=utcnow())
            try:
                if keep_agent:
                    with self._container_lock:  # the verifier's is the one tracked now
                        agent_id, self._container_id = self._container_id, None
                image, upload_tests = self._verifier_image()
                env_config = task.config.verifier.environment or task.config.environment
                spec = self._spec(image, env_config, kind="verifier", mounts=())
                container_id, started = self._open(spec)
                verifier_user = self._resolve_users(image, container_id, ["verifier"])["verifier"]
                handover.seek(0)
                self.runtime.put_archive(container_id, handover)
                self._start(container_id, started)
                self.check_cancelled()
                fresh = TrialSession(self.runtime, container_id, task, verifier_user=verifier_user)
                self._run_verifier(fresh, result, upload_tests=upload_tests, started=utcnow())
            except TrialError as exc:
                self.record(exc)
            finally:
                timing.finished_at = utcnow()
                if agent_id is not None:  # the verifier's goes; the agent's is tracked again
                    self._remove_container()
                    with self._container_lock:
                        self._container_id = agent_id
                    if self.cancelled:  # cancel() ran while the verifier's was the tracked one
                        self._remove_container()
        self.record_agent_overflow()

    def _pack_handover(self, container_id: str, handover: IO[bytes]) -> None:
        """Copy the agent's logs and declared artifacts out of its container and pack
        what the verifier's container gets into ``handover`` (a file: streamed from
        disk, never a second copy in memory)."""
        self._read_agent_logs(container_id)
        # harbor-exec's own tree (the grader's bundle) is placed by the trial, never
        # from an artifact the agent wrote (a task declaring "/opt" or "/").
        sources = [
            (local, path)
            for local, path in [
                *self.artifacts.convention_artifacts(),
                *self.artifacts.collect(container_id, self.request.spec.task),
            ]
            if not PurePosixPath(path).is_relative_to(BUNDLE_ROOT)
        ]
        # The agent files the verifier reads (the sample) are placed from the host's
        # copies by _run_verifier, in both modes.
        entries = [ArchiveEntry(path, None, 0o777) for path in LOG_DIRS]
        write_archive(handover, entries, sources)

    def _agent_files(self, verifier: TestsVerifier) -> list[ArchiveEntry]:
        """The host's copies of the agent outputs ``verifier`` reads (e.g. the sample a
        bundled grader grades); a missing one is placed as the runner's error form, so
        that nothing the agent left at that path is graded."""
        entries: list[ArchiveEntry] = []
        for path in verifier.agent_files:
            local = self.dir / "agent" / PurePosixPath(path).relative_to("/logs/agent")
            data = local.read_bytes() if local.is_file() else _NOTHING_HANDED_OVER
            entries += [ArchiveEntry("/logs/agent", None, 0o755), ArchiveEntry(path, data, 0o644)]
        return entries

    def _pin_agent_sample(self) -> None:
        """Make ``agent/sample.json`` the copy the agent handed over (``AgentRun.sample``):
        a download of ``/logs`` brings back the container's file, which something the
        workflow left running may have rewritten."""
        for relative, data in self._host_files.items():
            target = self.dir / relative
            if target.exists() or target.is_symlink():
                remove_path(target)
            target.parent.mkdir(parents=True, exist_ok=True)
            text = data.decode("utf-8", errors="replace")
            target.write_text(redact(text, self.request.secrets), encoding="utf-8")
        if self._agent_sample is None:
            return
        path = self.dir / AGENT_SAMPLE
        if path.exists() or path.is_symlink():
            remove_path(path)
        if self._agent_sample:
            path.parent.mkdir(parents=True, exist_ok=True)
            text = self._agent_sample.decode("utf-8", errors="replace")
            path.write_text(redact(text, self.request.secrets), encoding="utf-8")

    def _verifier_image(self) -> tuple[str, bool]:
        """Harbor's order: ``[verifier.environment].docker_image``; an image built from
        ``tests/Dockerfile`` (both bundle the tests); else the trial's own image, with
        ``tests/`` uploaded. Returns ``(image, upload_tests)``."""
        task = self.request.spec.task
        config = task.config.verifier.environment
        if config is not None and config.docker_image:
            self.runtime.ensure_present(config.docker_image)
            return config.docker_image, False
        if task.verifier_dockerfile is not None:
            built = self.runtime.ensure_image(
                before_build=partial(
                    ensure_base_images, self.runtime, task, task.verifier_dockerfile
                ),
                context_dir=task.tests_dir,
                tag=f"harbor-exec/verifier:{task.tests_digest()[:32]}",
                timeout_sec=(config or task.config.environment).build_timeout_sec,
                labels={LABEL_KIND: "verifier-env", LABEL_TASK: task.name},
            )
            return built.tag, False
        return self.image, True

    def _run_collect_hooks(self, container_id: str) -> None:
        """``[[verifier.collect]]`` hooks, once the agent's processes are stopped and
        before its logs and artifacts are read, as Harbor runs them: best effort (a
        failure is noted in ``collect-hooks.txt``, never the trial's), each under its
        ``timeout_sec``, as its ``user`` (resolved from the image's account files as
        read before the agent ran)."""
        hooks = self.request.spec.task.config.verifier.collect
        if not hooks or self.accounts is None:
            return
        notes: list[str] = []
        for hook in hooks:
            wanted = self.default_user if hook.user is None or str(hook.user) == "" else hook.user
            try:
                user = self.accounts.resolve(wanted)
            except UnknownUserError as exc:
                notes.append(f"{hook.command!r}: user {wanted!r}: {exc}")
                continue
            session = TrialSession(self.runtime, container_id, self.request.spec.task)
            ran = session.bash(hook.command, user=user, timeout_sec=hook.timeout_sec)
            if ran.timed_out or ran.exit_code != 0:
                how = "timed out" if ran.timed_out else f"exited with code {ran.exit_code}"
                notes.append(f"{hook.command!r} {how}")
        if notes:
            (self.dir / "collect-hooks.txt").write_text("\n".join(notes) + "\n")

    # ----------------------------------------------------------------- teardown

    def download_logs(self, container_id: str) -> None:
        """Read back whatever of ``/logs`` is not read yet, the verifier's part first."""
        if not self._verifier_logs_read:
            self._read_verifier_logs(container_id)
        if not self._agent_logs_read:
            self._read_agent_logs(container_id)

    def _read_verifier_logs(self, container_id: str) -> None:
        """``/logs/verifier`` into ``verifier/``, as its own archive on its own budget
        (``SandboxPolicy.verifier_output``), and the grader's exchange files."""
        self._verifier_logs_read = True
        limits, report, target = self.request.spec.policy.verifier_output, ExtractReport(), self.dir
        stream = self.runtime.get_archive(container_id, "/logs/verifier")
        if stream is not None:
            extract_archive(stream, target / "verifier", limits=limits, report=report)
        if report.incomplete:  # test.sh flooded its own dir: fetch the reward files alone
            for name in ("reward.json", "reward.txt"):
                if not (target / "verifier" / name).exists():
                    single = self.runtime.get_archive(container_id, f"/logs/verifier/{name}")
                    if single is not None:
                        extract_archive(single, target / "verifier", strip=0, limits=limits)
        self._verifier_copy = report
        secrets = self.request.secrets
        self.output = replace(self.output, grader=read_grader_output(self.dir, secrets))

    def _read_agent_logs(self, container_id: str) -> None:
        """``/logs/agent`` into ``agent/`` and ``/logs/artifacts`` into
        ``artifacts/logs/artifacts/``, on the agent's budget, and the agent's
        exchange files. One archive of ``/logs`` (each archive call costs the engine
        tens of milliseconds), routed by name; it ends before ``verifier/``."""
        self._agent_logs_read = True
        stream = self.runtime.get_archive(container_id, "/logs")
        if stream is not None:
            routes = {"agent": self.dir / "agent", "artifacts": self.artifacts.convention_dir}
            extract_archive(
                stream,
                self.dir,
                limits=self.request.spec.policy.output,
                report=self._agent_copy,
                routes=routes,
            )
            self.artifacts.drop_convention_excludes(self.request.spec.task)
        self._pin_agent_sample()  # the container's sample.json may have been rewritten
        secrets = self.request.secrets
        self.output = replace(self.output, agent=read_agent_output(self.dir, secrets))

    def record_agent_overflow(self) -> None:
        """Record a spent agent budget (after the verifier's own outcome, which wins)."""
        copy = self._agent_copy
        if copy.incomplete:
            limits = self.request.spec.policy.output
            cap = {
                "bytes": f"{limits.max_total_bytes} bytes",
                "files": f"{limits.max_files} files",
                "dirs": f"{limits.max_dirs} directories",
                "entries": f"{limits.max_entries} entries",
            }.get(copy.exceeded or "", copy.exceeded)
            self.record(
                AgentOutputLimitError(
                    f"the agent's /logs/agent, /logs/artifacts and artifacts went over the "
                    f"copy-back budget of {cap}; the rest was not read (the verifier's "
                    "output was read first: its reward stands)"
                )
            )

    def _write_copy_notes(self) -> None:
        """``copy-back.json``: what the copy-back skipped, cut or stopped at, if anything."""
        notes = {
            part: report.summary()
            for part, report in (("verifier", self._verifier_copy), ("agent", self._agent_copy))
            if report.incomplete or report.skipped_count or report.truncated
        }
        if notes:
            (self.dir / "copy-back.json").write_text(json.dumps(notes, indent=2))

    def _remove_container(self) -> None:
        with self._container_lock:
            container_id, self._container_id = self._container_id, None
        if container_id is not None:
            self.runtime.remove(container_id)
            self._removed(container_id)
        self._compose_down(every=False)

    def _teardown(self, session: TrialSession | None) -> None:
        try:
            self._teardown_containers()
        finally:
            for claimed in list(self._claims):
                self._removed(claimed)

    def _teardown_containers(self) -> None:
        self._egress.close()
        if self._package_cache is not None:
            self._package_cache.write(self.dir)
        with self._container_lock:
            container_id, self._container_id = self._container_id, None
        if container_id is None:
            self._compose_down()
            return
        try:
            if not self.cancelled:
                self.download_logs(container_id)
                # As Harbor's recovery does when the trial stopped before its verifier.
                self.artifacts.collect(container_id, self.request.spec.task)
                self.record_agent_overflow()
        except (HarborExecError, OSError):
            pass  # logs are best effort once the trial is over
        finally:
            try:
                # Teardown never raises: an engine fault leaves the id with the
                # runtime, whose periodic reap removes it once the engine is back.
                self.runtime.remove(container_id)
                self._compose_down()
            except Exception as exc:
                self.record(exc)

    def _write(self, result: TrialResult) -> None:
        self._write_copy_notes()
        self.artifacts.write_manifest(self.request.spec.task)
        if self._exception is not None:
            (self.dir / "exception.txt").write_text(self._exception.exception_traceback)
        result.write(self.dir)
        if self.request.secrets:
            scrub_tree(self.dir, self.request.secrets)


def _elapsed(since: datetime | None) -> float:
    return 0.0 if since is None else (utcnow() - since).total_seconds()


__all__ = [
    "Trial",
    "TrialRequest",
    "ensure_task_image",
    "image_tag_for",
    "new_trial_name",
]
