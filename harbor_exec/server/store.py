"""Durable rollout state: a small SQLite database under the server's ``--data-dir``.

Every admitted rollout is a row: id, lease digest, request (without the LLM key),
status and final result. A restarted server reads it back, so a trainer's poll
gets the finished result (with the lease token it already holds) or a terminal
``internal_error`` for work that was running when the server died, never a 404.

Writes are cheap on the event loop: each change only updates a pending row in a
dict; a writer thread upserts the pending rows in one transaction every
``flush_interval_sec`` (WAL mode, ``synchronous=NORMAL``: no fsync per commit). A
rollout that is admitted and finished within one interval costs one row write.
Rows are keyed by an admission sequence number, not by the (random) rollout id, so
every write lands on the last few pages of the table and a commit rewrites few pages;
the id is unique in memory (the registry), so it needs no index. One server
process owns a data dir, enforced with an exclusive ``flock`` on ``server.lock``.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from harbor_exec.errors import HarborExecError

__all__ = ["DataDirLockedError", "RolloutStore", "StoredRollout", "default_data_dir"]

logger = logging.getLogger(__name__)

DB_NAME: Final = "rollouts.sqlite3"
LOCK_NAME: Final = "server.lock"
RESTARTED_MESSAGE: Final = "harbor-exec restarted while this rollout was running"

_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS rollouts (
    seq INTEGER PRIMARY KEY,
    id TEXT NOT NULL,
    lease_digest BLOB NOT NULL,
    request TEXT,
    status TEXT NOT NULL,
    admitted_at REAL NOT NULL,
    finished_at REAL,
    final_body BLOB,
    reward REAL,
    err_message TEXT,
    err_category TEXT
)
"""
_UPSERT: Final = """
INSERT INTO rollouts (seq, id, lease_digest, request, status, admitted_at, finished_at,
                      final_body, reward, err_message, err_category)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT(seq) DO UPDATE SET
    status = excluded.status,
    finished_at = excluded.finished_at,
    final_body = excluded.final_body,
    reward = excluded.reward,
    err_message = excluded.err_message,
    err_category = excluded.err_category
"""


class DataDirLockedError(HarborExecError):
    """Another harbor-exec server already owns this ``--data-dir``."""


def default_data_dir(port: int) -> Path:
    """The data dir of a server on ``port`` that was given none: ``$HARBOR_EXEC_DATA_DIR``
    as it is, else ``$XDG_STATE_HOME/harbor-exec/server/port-<port>``
    (``~/.local/state/...``). One per port, because a dir has one owner: servers on
    different ports each get their own, and a restart on the same port finds its
    rollouts again."""
    if configured := os.environ.get("HARBOR_EXEC_DATA_DIR"):
        return Path(configured)
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "harbor-exec" / "server" / f"port-{port}"


@dataclass
class StoredRollout:
    """One row as read back at start-up."""

    rollout_id: str
    lease_digest: bytes
    request: dict[str, Any] | None
    status: str
    admitted_at: float
    finished_at: float | None
    final_body: bytes | None
    reward: float | None
    err_message: str | None
    err_category: str | None


class RolloutStore:
    """The SQLite file and its batching writer (see the module doc)."""

    def __init__(self, data_dir: Path | str, *, flush_interval_sec: float = 0.1) -> None:
        self.data_dir = Path(data_dir).expanduser()
        self.flush_interval_sec = flush_interval_sec
        try:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            self._lock_file = open(self.data_dir / LOCK_NAME, "a+")  # noqa: SIM115 - held for life
        except OSError as exc:
            raise HarborExecError(f"--data-dir {self.data_dir} is not usable: {exc}") from None
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock_file.seek(0)
            owner = self._lock_file.read().strip() or "unknown"
            self._lock_file.close()
            raise DataDirLockedError(
                f"--data-dir {self.data_dir} is in use by another harbor-exec server "
                f"(pid {owner}); give this one its own --data-dir"
            ) from None
        self._lock_file.seek(0)
        self._lock_file.truncate()
        self._lock_file.write(str(os.getpid()))
        self._lock_file.flush()
        self.path = self.data_dir / DB_NAME
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute(_SCHEMA)
        # id -> full row (as _UPSERT takes it); sequence numbers to delete.
        self._pending: dict[str, list[Any]] = {}
        self._deletes: list[int] = []
        self._seq_of: dict[str, int] = {}  # rows held, by rollout id
        last = self._db.execute("SELECT max(seq) FROM rollouts").fetchone()[0]
        self._next_seq = 1 + (last or 0)
        self._guard = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.write_errors = 0

    # ------------------------------------------------------------------ reading

    def load(self) -> list[StoredRollout]:
        """Every stored rollout (call before serving)."""
        rows = self._db.execute(
            "SELECT seq, id, lease_digest, request, status, admitted_at, finished_at, final_body,"
            " reward, err_message, err_category FROM rollouts ORDER BY seq"
        ).fetchall()
        loaded: list[StoredRollout] = []
        for seq, *row in rows:
            try:
                request = json.loads(row[2]) if row[2] else None
            except ValueError:
                request = None
            self._seq_of[row[0]] = seq
            loaded.append(StoredRollout(row[0], bytes(row[1]), request, *row[3:]))
        return loaded

    # ------------------------------------------------------------------ writing (event loop)

    def admitted(self, rollout_id: str, lease_digest: bytes, request_json: str) -> None:
        with self._guard:
            seq = self._next_seq
            self._next_seq += 1
            self._seq_of[rollout_id] = seq
            row = [seq, rollout_id, lease_digest, request_json, "queued", time.time()]
            row += [None, None, None, None, None]
            self._pending[rollout_id] = row
        self._kick()

    def status(self, rollout_id: str, status: str) -> None:
        with self._guard:
            row = self._pending_row(rollout_id)
            if row is None:
                return
            row[4] = status
        self._kick()

    def finished(
        self,
        rollout_id: str,
        *,
        status: str,
        body: bytes,
        reward: float | None,
        err_message: str | None,
        err_category: str | None,
    ) -> None:
        with self._guard:
            row = self._pending_row(rollout_id)
            if row is None:
                return
            row[4:] = [status, row[5], time.time(), body, reward, err_message, err_category]
        self._kick()

    def _pending_row(self, rollout_id: str) -> list[Any] | None:
        """The unwritten row of ``rollout_id`` (a stub for a known one already written);
        None for an id never admitted. Call with ``_guard`` held."""
        row = self._pending.get(rollout_id)
        if row is None and (row := self._stub(rollout_id)) is not None:
            self._pending[rollout_id] = row
        return row

    def forget(self, rollout_id: str) -> None:
        """Drop a rollout whose retention ended."""
        with self._guard:
            self._pending.pop(rollout_id, None)
            seq = self._seq_of.pop(rollout_id, None)
            if seq is not None:
                self._deletes.append(seq)
        self._kick()

    def _stub(self, rollout_id: str) -> list[Any] | None:
        # An update for a row already written: the upsert only touches the
        # status/result columns, so these placeholders never overwrite anything.
        seq = self._seq_of.get(rollout_id)
        if seq is None:
            return None  # not ours (never admitted through this store)
        return [seq, rollout_id, b"", None, "queued", 0.0, None, None, None, None, None]

    def _kick(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="hx-rollout-store", daemon=True)
            self._thread.start()
        # The writer sleeps flush_interval_sec between batches on its own; no
        # per-change wake-up, which would cost a syscall per rollout.

    # ------------------------------------------------------------------ writer thread

    def _run(self) -> None:
        while not self._closed:
            self._wake.wait(self.flush_interval_sec)
            self.flush()

    def flush(self) -> None:
        """Write every pending change in one transaction."""
        with self._guard:
            rows = list(self._pending.values())
            deletes = self._deletes
            self._pending = {}
            self._deletes = []
        if not rows and not deletes:
            return
        try:
            with self._db:
                self._db.execute("BEGIN")
                if rows:
                    self._db.executemany(_UPSERT, rows)
                if deletes:
                    self._db.executemany(
                        "DELETE FROM rollouts WHERE seq = ?", [(i,) for i in deletes]
                    )
        except sqlite3.Error:
            self.write_errors += 1
            logger.exception("writing rollout state to %s failed", self.path)

    def close(self) -> None:
        """Flush and close (the lock is released with the file)."""
        self._closed = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.flush()
        self._db.close()
        self._lock_file.close()
