"""Agents and verifiers: the pieces a trial runs inside its container.

An agent places its files before the container starts (``files``) and then
runs (``run``). A verifier places ``/tests`` after the agent and runs
``/tests/test.sh``. The ``oracle`` (the task's ``solution/solve.sh``) and the
bundled workflow are two agents behind one interface; a task's own tests and a
generated grader test are the same verifier over different directories.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from harbor_exec.container.exchange import (
    AGENT_INPUT,
    AGENT_SAMPLE,
    GRADER_CODE_DIR,
    GRADER_DIR,
    GRADER_INPUT,
    GRADER_MANIFEST_PATH,
    GRADER_WORKDIR,
    MANIFEST_PATH,
    RUNNER_OUTPUT,
    RUNTIME_BUSYBOX,
    RUNTIME_PYTHON,
    TESTS_DIR,
    USER_CODE_DIR,
    RolloutInput,
    in_logs,
    unframe_sample,
)
from harbor_exec.errors import AgentSetupError
from harbor_exec.sandbox.archives import ArchiveEntry, build_archive, tree_entries
from harbor_exec.sandbox.runtime import ContainerRuntime, ExecResult
from harbor_exec.sandbox.runtime_volume import RUNTIME_SHELL
from harbor_exec.sandbox.users import ROOT_ID, is_root, numeric_ids
from harbor_exec.trial.results import AgentInfo
from harbor_exec.trial.task import Task, resolve_env

#: How Harbor runs the task's own scripts: the image's bash.
TASK_SHELL = ("bash", "-c")
_NO_TAR = "harbor-exec:no-tar"
_UPLOAD_FAILED = "harbor-exec:upload-failed"


def with_upload(command: str) -> str:
    """``command``, preceded by unpacking a tar from stdin at ``/``.

    Sending files with the command saves the daemon an archive round trip. The
    markers on stderr tell "no tar in this image" and "upload failed" apart from
    whatever exit code ``command`` itself returns.
    """
    return (
        f"command -v tar >/dev/null || {{ echo {_NO_TAR} >&2; exit 213; }}; "
        f"tar -xf - -C / || {{ echo {_UPLOAD_FAILED} >&2; exit 214; }}; {command}"
    )


def upload_outcome(result: ExecResult) -> str:
    """``"ok"``, ``"no-tar"`` or ``"failed"`` for an exec of ``with_upload(...)``."""
    if result.exit_code == 213 and _NO_TAR.encode() in result.errors:
        return "no-tar"
    if result.exit_code == 214 and _UPLOAD_FAILED.encode() in result.errors:
        return "failed"
    return "ok"


@dataclass
class TrialSession:
    """A started trial container, as agents and verifiers see it.

    ``pending_files`` is a tar of the files the trial placed before the agent
    (log directories, ``/solution`` or the bundle). When the first command runs
    as root they travel on its stdin instead of a separate upload.
    ``agent_user`` and ``verifier_user`` are numeric ``uid:gid``, resolved from the
    image before anything ran (``harbor_exec.sandbox.users``): a name resolved at
    exec time would go through account files the agent can rewrite.
    """

    runtime: ContainerRuntime
    container_id: str
    task: Task
    pending_files: bytes | None = None
    agent_user: str = ROOT_ID
    verifier_user: str = ROOT_ID
    #: The image's USER (an exec that names no user), resolved like the others.
    image_user: str = ROOT_ID

    @property
    def workdir(self) -> str | None:
        return self.task.config.environment.workdir

    def bash(
        self,
        command: str,
        *,
        user: str = ROOT_ID,
        env: Mapping[str, str] | None = None,
        timeout_sec: float | None = None,
        stdin: bytes | None = None,
        shell: Sequence[str] = TASK_SHELL,
    ) -> ExecResult:
        """``bash -c command`` in the task's workdir, as Harbor runs every exec, as
        ``user`` (a resolved ``uid:gid``). harbor-exec's own commands pass
        ``shell=RUNTIME_SHELL``: the runtime's busybox, in images without bash too."""
        files, self.pending_files = self.pending_files, None
        argv = [*shell, command]
        if files is not None and stdin is None and is_root(user):
            result = self._exec([*shell, with_upload(command)], user, env, timeout_sec, files)
            outcome = upload_outcome(result)
            if outcome == "failed":
                raise AgentSetupError("placing the agent's files in the container failed")
            if outcome == "ok":
                return result
        if files is not None:
            self.runtime.put_archive(self.container_id, files)
        return self._exec(argv, user, env, timeout_sec, stdin)

    def _exec(
        self,
        argv: list[str],
        user: str,
        env: Mapping[str, str] | None,
        timeout_sec: float | None,
        stdin: bytes | None,
    ) -> ExecResult:
        return self.runtime.exec(
            self.container_id,
            argv,
            env=env,
            user=user,
            workdir=self.workdir,
            timeout_sec=timeout_sec,
            stdin=stdin,
        )


@dataclass(frozen=True)
class AgentRun:
    """How the agent phase ended."""

    exit_code: int | None
    timed_out: bool
    # A bundled workflow's ``sample.json``, taken from the runner's stdout as its exec
    # ended (b"": none came); None for agents that hand over no sample (the oracle).
    sample: bytes | None = None
    #: Files the agent wrote on the host (a native agent's ``agent/trajectory.json``),
    #: by path under the trial dir: kept over whatever the container's ``/logs`` says.
    host_files: Mapping[str, bytes] = field(default_factory=dict)
    #: Harbor's ``agent_result`` fields as the agent counted them (native agents).
    agent_result: Mapping[str, Any] | None = None


class Agent(Protocol):
    """Something that acts on the task inside the container."""

    @property
    def info(self) -> AgentInfo: ...

    def files(self, task: Task) -> list[ArchiveEntry]:
        """Files to place before the container starts."""
        ...

    def run(self, session: TrialSession, timeout_sec: float | None) -> AgentRun: ...


class OracleAgent:
    """Harbor's ``oracle``: runs the task's ``solution/solve.sh``."""

    info = AgentInfo(name="oracle", version="1.0.0")

    def files(self, task: Task) -> list[ArchiveEntry]:
        return tree_entries(task.solution_dir, "/solution", executable=["solve.sh"])

    def for_step(self, task: Task) -> OracleAgent:
        """The oracle of one step: its ``files`` and ``run`` read the step's view
        (``steps/<name>/solution/`` when the step has one, else ``solution/``)."""
        return self

    def run(self, session: TrialSession, timeout_sec: float | None) -> AgentRun:
        if not session.task.solve_script.is_file():
            # Harbor's oracle raises exactly this (recorded as FileNotFoundError),
            # instead of letting bash fail with exit 127. It names the task's own file,
            # not the snapshot we checked.
            task = session.task
            missing = task.path / task.solve_script.relative_to(task.root)
            if task.step is not None and task.solution_dir != task.root / "solution":
                raise FileNotFoundError(
                    "No OS-compatible solution script found for step "
                    f"'{task.step.name}': expected {missing}"
                )
            raise FileNotFoundError(f"Solution script not found: {missing}")
        config = session.task.config
        env = {
            "DEBIAN_FRONTEND": "noninteractive",
            **resolve_env(
                config.solution.env,
                task=session.task.name,
                field="[solution].env",
                allowed=session.task.env_allow,
            ),
        }
        result = session.bash(
            "(/solution/solve.sh) > /logs/agent/oracle.txt 2>&1",
            user=session.agent_user,
            env=env,
            timeout_sec=timeout_sec,
        )
        return AgentRun(exit_code=result.exit_code, timed_out=result.timed_out)


@dataclass(frozen=True)
class VerifierRun:
    exit_code: int | None
    timed_out: bool
    upload_failed: bool = False


@dataclass(frozen=True)
class TestsVerifier:
    """Runs ``/tests/test.sh``: the task's own ``tests/`` (``tests_dir``), or files
    generated for this trial (``generated``, e.g. a bundled grader's test.sh), or both."""

    tests_dir: Path | None = None
    generated: Sequence[ArchiveEntry] = ()
    #: A step's own ``tests/``, placed over ``tests_dir`` (Harbor uploads both, in order).
    step_tests_dir: Path | None = None
    extra_env: Mapping[str, str] = field(default_factory=dict)
    # Agent outputs this verifier reads (a bundled grader grades the agent's sample):
    # the trial places its own copies there before the verifier runs, in the agent's
    # container too (the agent may have rewritten its files after handing them over).
    agent_files: Sequence[str] = ()
    #: The bundled grader (``grader_verifier``): it runs in the policy's
    #: ``grader_verifier_mode``, not the task's mode.
    bundled_grader: bool = False

    def files(self, *, upload_tests: bool = True) -> list[ArchiveEntry]:
        """``/tests`` (replacing whatever the agent left there) and the generated files.

        ``upload_tests=False``: the verifier image bundles the tests itself (a
        separate verifier built from ``tests/Dockerfile``); only generated files go in.
        """
        if not upload_tests:
            return list(self.generated)
        entries = [ArchiveEntry("/tests", None, 0o755, fresh=True)]
        for tests_dir in (self.tests_dir, self.step_tests_dir):
            if tests_dir is not None and tests_dir.is_dir():
                entries += tree_entries(tests_dir, "/tests", executable=["test.sh"])[1:]
        return entries + list(self.generated)

    def run(
        self,
        session: TrialSession,
        timeout_sec: float | None,
        *,
        upload_tests: bool = True,
        placed: Sequence[ArchiveEntry] = (),
    ) -> VerifierRun:
        """Place ``/tests`` and an empty ``/logs/verifier`` through the engine, then run
        ``test.sh`` under ``timeout_sec``.

        Both go through the engine's archive API, not through programs in the
        container (which the agent may have replaced): the archive's ``/logs/verifier``
        and ``/tests`` entries replace whatever the agent left at those paths, stale
        reward files included. The trial reads ``/logs`` back the same way.
        ``placed`` are more files put in with them (the host's copies of ``agent_files``).
        """
        env = {
            **resolve_env(
                session.task.verifier_env,
                task=session.task.name,
                field="[verifier].env",
                allowed=session.task.env_allow,
            ),
            **self.extra_env,
        }
        entries = [
            ArchiveEntry("/logs", None, 0o755),
            # The verifier's own: whoever else runs in the container (a non-root
            # agent's user) cannot write in it while test.sh runs.
            ArchiveEntry(
                "/logs/verifier", None, 0o755, fresh=True, owner=numeric_ids(session.verifier_user)
            ),
            *self.files(upload_tests=upload_tests),
            *placed,
        ]
        try:
            session.runtime.put_archive(session.container_id, build_archive(entries))
        except Exception:
            return VerifierRun(exit_code=None, timed_out=False, upload_failed=True)
        result = session.bash(
            # Harbor makes test.sh executable as root first; an image that bundles
            # its tests may have copied it without the bit.
            "chmod +x /tests/test.sh 2>/dev/null; "
            "(/tests/test.sh) > /logs/verifier/test-stdout.txt 2>&1",
            user=session.verifier_user,
            env=env,
            timeout_sec=timeout_sec,
            shell=RUNTIME_SHELL if self.bundled_grader else TASK_SHELL,
        )
        return VerifierRun(exit_code=result.exit_code, timed_out=result.timed_out)


# --------------------------------------------------------------------------- bundled workflows


@dataclass(frozen=True, kw_only=True)
class WorkflowAgent:
    """A bundled ``AgentWorkflow``, run by ``python -m harbor_exec.container.runner agent``
    on the read-only runtime's Python (any image: no Python, musl, a non-root user).

    ``bundle_files`` are the bundle's agent part: its manifest without grader refs and
    the user's code (the unpacked wheel) without the grader's and its config's modules;
    ``rollout_input`` is ``/logs/agent/rollout.json`` (prompt, metadata, chat URL and
    key; never the label). The runner hands the sample back on its stdout; the trial
    keeps that copy as ``agent/sample.json``, whatever the container's file says later.
    """

    name: str
    version: str
    bundle_files: Sequence[ArchiveEntry] = field(repr=False)
    rollout_input: bytes = field(repr=False)

    @property
    def info(self) -> AgentInfo:
        return AgentInfo(name=self.name, version=self.version)

    def files(self, task: Task) -> list[ArchiveEntry]:
        return [*self.bundle_files, ArchiveEntry(in_logs(AGENT_INPUT), self.rollout_input, 0o644)]

    def for_step(self, task: Task) -> WorkflowAgent:
        """The workflow of one step: a fresh run whose prompt is the step's instruction
        (as Harbor runs each step's agent with that step's instruction)."""
        step_input = RolloutInput.model_validate_json(self.rollout_input)
        step_input.prompt = [{"role": "user", "content": task.instruction}]
        return replace(self, rollout_input=step_input.model_dump_json().encode())

    def run(self, session: TrialSession, timeout_sec: float | None) -> AgentRun:
        # The sample comes back on the exec's stdout (see ``exchange.frame_sample``),
        # taken when the runner's exec ends: a ``sample.json`` rewritten later by
        # something the workflow left running changes nothing.
        result = session.bash(
            f"exec {RUNTIME_PYTHON} -I -m harbor_exec.container.runner agent "
            f"--sample-to-stdout --manifest {MANIFEST_PATH} --code-dir {USER_CODE_DIR} "
            f"2> {in_logs(RUNNER_OUTPUT)}",
            user=session.agent_user,
            timeout_sec=timeout_sec,
            shell=RUNTIME_SHELL,
        )
        sample = unframe_sample(result.output) or b""
        return AgentRun(exit_code=result.exit_code, timed_out=result.timed_out, sample=sample)


# The grader runs isolated from anything the agent shaped: ``-I`` ignores PYTHON*
# variables and the user site and puts neither the cwd nor a script dir on sys.path
# (``-m`` would put the cwd first: a workdir the agent wrote, maybe carried back as
# an artifact); the cwd is an empty directory; the user's code comes only from the
# grader's own copy of the bundle, placed fresh after the agent's processes died.
GRADER_TEST_SH = f"""#!{RUNTIME_BUSYBOX} sh
# Generated by harbor-exec: this task has no tests/, so the bundled grader verifies.
cd {GRADER_WORKDIR} || exit 2
exec {RUNTIME_PYTHON} -I -m harbor_exec.container.runner grade \\
  --manifest {GRADER_MANIFEST_PATH} --code-dir {GRADER_CODE_DIR}
"""


def grader_bundle_files(bundle_files: Sequence[ArchiveEntry]) -> list[ArchiveEntry]:
    """``bundle_files`` (the bundle's grader part: the full manifest and all the user's
    code, laid out as the agent's part is) moved under ``GRADER_DIR``, which replaces
    whatever tree, file or link is there, plus the grader's empty working directory."""
    entries = [
        ArchiveEntry(GRADER_DIR, None, 0o755, fresh=True),
        ArchiveEntry(GRADER_CODE_DIR, None, 0o755),
        ArchiveEntry(GRADER_WORKDIR, None, 0o755),
    ]
    for entry in bundle_files:
        if entry.path == MANIFEST_PATH:
            path = GRADER_MANIFEST_PATH
        elif entry.path.startswith(f"{USER_CODE_DIR}/"):
            path = GRADER_CODE_DIR + entry.path.removeprefix(USER_CODE_DIR)
        else:
            raise ValueError(f"a bundle file outside {USER_CODE_DIR}: {entry.path}")
        entries.append(ArchiveEntry(path, entry.data, entry.mode))
    return entries


def tests_verifier(tests_dir: Path, grader_input: bytes | None = None) -> TestsVerifier:
    """The task's own ``tests/``, with ``/tests/rollout.json`` (the grader's input, with
    the label) when given: template tasks check answers against the label."""
    if grader_input is None:
        return TestsVerifier(tests_dir)
    entry = ArchiveEntry(f"{TESTS_DIR}/{GRADER_INPUT}", grader_input, 0o644)
    return TestsVerifier(tests_dir, generated=[entry])


def grader_verifier(grader_input: bytes, bundle_files: Sequence[ArchiveEntry]) -> TestsVerifier:
    """The bundled grader as a verifier: a generated ``/tests/test.sh``,
    ``/tests/rollout.json`` (the grader's input, with the label) and the grader's own
    fresh copy of the bundle (``grader_bundle_files`` of the grader part, which the
    agent's container never held: the agent may have changed or added to its own part;
    a separate verifier container has none)."""
    return TestsVerifier(
        generated=[
            *grader_bundle_files(bundle_files),
            ArchiveEntry("/tests/test.sh", GRADER_TEST_SH.encode(), 0o755),
            ArchiveEntry(f"{TESTS_DIR}/{GRADER_INPUT}", grader_input, 0o644),
        ],
        agent_files=[in_logs(AGENT_SAMPLE)],
        bundled_grader=True,
    )
