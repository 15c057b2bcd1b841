"""Verifiers: what runs ``/tests/test.sh`` after the agent, inside the container.

A verifier places ``/tests`` after the agent and runs ``/tests/test.sh``: a task's own
tests and a generated bundled-grader test are the same verifier over different
directories (Harbor's ``verifier/``; the agents are ``harbor_exec.agents``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from harbor_exec.agents.base import TASK_SHELL
from harbor_exec.container.exchange import (
    AGENT_SAMPLE,
    GRADER_CODE_DIR,
    GRADER_DIR,
    GRADER_INPUT,
    GRADER_MANIFEST_PATH,
    GRADER_WORKDIR,
    MANIFEST_PATH,
    RUNTIME_BUSYBOX,
    RUNTIME_PYTHON,
    TESTS_DIR,
    USER_CODE_DIR,
    in_logs,
)
from harbor_exec.sandbox.archives import ArchiveEntry, build_archive, tree_entries
from harbor_exec.sandbox.runtime_volume import RUNTIME_SHELL
from harbor_exec.sandbox.users import numeric_ids
from harbor_exec.tasks.config import resolve_env
from harbor_exec.trial.session import TrialSession


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


def grader_verifier(
    grader_input: bytes, bundle_files: Sequence[ArchiveEntry], *, env: Mapping[str, str] = {}
) -> TestsVerifier:
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
        extra_env=dict(env),
    )


__all__ = [
    "GRADER_TEST_SH",
    "TestsVerifier",
    "VerifierRun",
    "grader_bundle_files",
    "grader_verifier",
    "tests_verifier",
]
