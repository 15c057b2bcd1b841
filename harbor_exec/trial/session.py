"""The trial's started container as agents and verifiers see it (``TrialSession``).

It implements the agents' ``harbor_exec.agents.base.AgentSession``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from harbor_exec.agents.base import TASK_SHELL
from harbor_exec.errors import AgentSetupError
from harbor_exec.sandbox.runtime import ContainerRuntime, ExecResult
from harbor_exec.sandbox.users import ROOT_ID, is_root
from harbor_exec.tasks.task import Task

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


__all__ = ["TrialSession", "upload_outcome", "with_upload"]
