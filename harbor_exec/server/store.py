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
every write lands on the last few pages of the table and a commit rewrites few pages.
One server process owns a data dir, enforced with an exclusive ``flock`` on
``server.lock``.

A row outlives its rollout's retention as history (``GET /rollouts``): once the id is
free again the row is only marked ``retired`` (a restart does not serve it again, and
the id may be admitted anew, as a new row), and the oldest retired rows beyond
``history_rows`` are deleted. Listing reads through a connection of its own, newest
first by sequence number, with an index per filter (status, task, id), so a page costs
the same whatever the table's size.
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

__all__ = [
    "DEFAULT_HISTORY_ROWS",
    "DataDirLockedError",
    "RolloutQuery",
    "RolloutRecord",
    "RolloutStore",
    "StoredRollout",
    "default_data_dir",
]

logger = logging.getLogger(__name__)

DB_NAME: Final = "rollouts.sqlite3"
LOCK_NAME: Final = "server.lock"
RESTARTED_MESSAGE: Final = "harbor-exec restarted while this rollout was running"

#: Retired rows kept as history (the newest ones), by default.
DEFAULT_HISTORY_ROWS: Final = 100_000
#: Retired rows beyond the bound are deleted once this many have piled up.
_PRUNE_BATCH: Final = 1000

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
# Added after the first release: a data dir written by an older server gains them.
_COLUMNS: Final = (
    ("task", "TEXT"),
    ("running_at", "REAL"),
    ("detail", "TEXT"),
    ("retired", "INTEGER NOT NULL DEFAULT 0"),
)
_INDEXES: Final = (
    "CREATE INDEX IF NOT EXISTS rollouts_by_status ON rollouts (status, seq)",
    "CREATE INDEX IF NOT EXISTS rollouts_by_task ON rollouts (task, seq) WHERE task IS NOT NULL",
    "CREATE INDEX IF NOT EXISTS rollouts_by_id ON rollouts (id)",
)
_UPSERT: Final = """
INSERT INTO rollouts (seq, id, lease_digest, request, status, admitted_at, finished_at,
                      final_body, reward, err_message, err_category, task, running_at, detail)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT(seq) DO UPDATE SET
    status = excluded.status,
    finished_at = excluded.finished_at,
    final_body = excluded.final_body,
    reward = excluded.reward,
    err_message = excluded.err_message,
    err_category = excluded.err_category,
    task = coalesce(excluded.task, task),
    running_at = coalesce(excluded.running_at, running_at),
    detail = coalesce(excluded.detail, detail)
"""
# Row positions (a pending row is a list in _UPSERT's order).
_STATUS, _FINISHED, _TASK, _RUNNING, _DETAIL = 4, 6, 11, 12, 13
_LISTED: Final = (
    "seq, id, status, task, admitted_at, running_at, finished_at, reward, err_category,"
    " err_message, detail"
)


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


@dataclass(frozen=True)
class RolloutQuery:
    """What ``GET /rollouts`` asks: filters (None: any), and the page: rollouts admitted
    before sequence number ``before`` (None: from the newest), at most ``limit``."""

    status: str | None = None
    task: str | None = None
    since: float | None = None  # admitted at or after (Unix seconds)
    until: float | None = None  # admitted before
    before: int | None = None
    limit: int = 50


@dataclass
class RolloutRecord:
    """One rollout as listed, from the store or the registry (times are Unix seconds;
    ``detail`` is what the server kept of the backend's report, already scrubbed)."""

    seq: int
    rollout_id: str
    status: str
    task: str | None
    admitted_at: float
    running_at: float | None
    finished_at: float | None
    reward: float | None
    err_category: str | None
    err_message: str | None
    detail: dict[str, Any] | None
    request: dict[str, Any] | None = None
    final_body: bytes | None = None


class RolloutStore:
    """The SQLite file and its batching writer (see the module doc)."""

    def __init__(
        self,
        data_dir: Path | str,
        *,
        flush_interval_sec: float = 0.1,
        history_rows: int = DEFAULT_HISTORY_ROWS,
    ) -> None:
        self.data_dir = Path(data_dir).expanduser()
        self.flush_interval_sec = flush_interval_sec
        self.history_rows = history_rows
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
        present = {row[1] for row in self._db.execute("PRAGMA table_info(rollouts)")}
        for name, declaration in _COLUMNS:
            if name not in present:
                self._db.execute(f"ALTER TABLE rollouts ADD COLUMN {name} {declaration}")
        for index in _INDEXES:
            self._db.execute(index)
        # Listing reads through its own connection (WAL: readers never block the writer).
        self._reader = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._reader.execute("PRAGMA query_only=1")
        self._read_lock = threading.Lock()
        # id -> full row (as _UPSERT takes it); sequence numbers to retire.
        self._pending: dict[str, list[Any]] = {}
        self._retires: list[int] = []
        self._seq_of: dict[str, int] = {}  # rows held, by rollout id
        last = self._db.execute("SELECT max(seq) FROM rollouts").fetchone()[0]
        self._next_seq = 1 + (last or 0)
        self._pruned_through = 0
        self._guard = threading.Lock()
        # One flush at a time: the writer thread's, or a reader's that wants it all written.
        self._write_lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.write_errors = 0

    # ------------------------------------------------------------------ reading

    def load(self) -> list[StoredRollout]:
        """Every stored rollout not yet retired (call before serving)."""
        rows = self._db.execute(
            "SELECT seq, id, lease_digest, request, status, admitted_at, finished_at, final_body,"
            " reward, err_message, err_category FROM rollouts WHERE retired = 0 ORDER BY seq"
        ).fetchall()
        loaded: list[StoredRollout] = []
        for seq, *row in rows:
            self._seq_of[row[0]] = seq
            loaded.append(StoredRollout(row[0], bytes(row[1]), _json(row[2]), *row[3:]))
        return loaded

    def page(self, query: RolloutQuery) -> list[RolloutRecord]:
        """Up to ``query.limit`` rollouts matching ``query``, newest first, everything
        changed so far written first (blocking: call from a worker thread)."""
        clauses: list[str] = []
        values: list[Any] = []
        for clause, value in (
            ("status = ?", query.status),
            ("task = ?", query.task),
            ("admitted_at >= ?", query.since),
            ("admitted_at < ?", query.until),
            ("seq < ?", query.before),
        ):
            if value is not None:
                clauses.append(clause)
                values.append(value)
        where = f" WHERE {' AND '.join(clauses)}" if clauses else ""
        sql = f"SELECT {_LISTED} FROM rollouts{where} ORDER BY seq DESC LIMIT ?"
        self.flush()
        with self._read_lock:
            rows = self._reader.execute(sql, (*values, query.limit)).fetchall()
        return [_record(row) for row in rows]

    def find(self, rollout_id: str) -> RolloutRecord | None:
        """The newest row of ``rollout_id`` with its request and final body (blocking)."""
        self.flush()
        with self._read_lock:
            row = self._reader.execute(
                f"SELECT {_LISTED}, request, final_body FROM rollouts WHERE id = ?"
                " ORDER BY seq DESC LIMIT 1",
                (rollout_id,),
            ).fetchone()
        if row is None:
            return None
        record = _record(row)
        record.request = _json(row[11])
        body = row[12]
        record.final_body = (
            (body.encode() if isinstance(body, str) else bytes(body)) if body else None
        )
        return record

    def history(self, limit: int) -> list[tuple[RolloutRecord, str | None]]:
        """The newest ``limit`` finished rollouts, oldest first, each with its group
        (``metadata.group_id``, else ``metadata.group``; None where SQLite has no JSON
        functions). For the console at start-up."""
        group = "coalesce(json_extract(request, '$.metadata.group_id'),"
        group += " json_extract(request, '$.metadata.group'))"
        base = f"SELECT {_LISTED}, %s FROM rollouts WHERE finished_at IS NOT NULL"
        base += " ORDER BY seq DESC LIMIT ?"
        with self._read_lock:
            try:
                rows = self._reader.execute(base % group, (limit,)).fetchall()
            except sqlite3.OperationalError:  # no JSON1, or a request that is not JSON
                rows = self._reader.execute(base % "NULL", (limit,)).fetchall()
        return [
            (_record(row), None if row[11] is None else str(row[11])[:256])
            for row in reversed(rows)
        ]

    # ------------------------------------------------------------------ writing (event loop)

    def admitted(
        self,
        rollout_id: str,
        lease_digest: bytes,
        request_json: str,
        *,
        task: str | None = None,
        at: float | None = None,
    ) -> None:
        with self._guard:
            seq = self._next_seq
            self._next_seq += 1
            self._seq_of[rollout_id] = seq
            row = [seq, rollout_id, lease_digest, request_json, "queued", at or time.time()]
            row += [None, None, None, None, None, task, None, None]
            self._pending[rollout_id] = row
        self._kick()

    def status(self, rollout_id: str, status: str, *, running_at: float | None = None) -> None:
        with self._guard:
            row = self._pending_row(rollout_id)
            if row is None:
                return
            row[_STATUS] = status
            if running_at is not None:
                row[_RUNNING] = running_at
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
        task: str | None = None,
        detail: str | None = None,
        at: float | None = None,
    ) -> None:
        with self._guard:
            row = self._pending_row(rollout_id)
            if row is None:
                return
            row[_STATUS] = status
            row[_FINISHED:_TASK] = [at or time.time(), body, reward, err_message, err_category]
            if task is not None:
                row[_TASK] = task
            row[_DETAIL] = detail
        self._kick()

    def _pending_row(self, rollout_id: str) -> list[Any] | None:
        """The unwritten row of ``rollout_id`` (a stub for a known one already written);
        None for an id never admitted. Call with ``_guard`` held."""
        row = self._pending.get(rollout_id)
        if row is None and (row := self._stub(rollout_id)) is not None:
            self._pending[rollout_id] = row
        return row

    def forget(self, rollout_id: str) -> None:
        """A rollout whose retention ended: its row stays as history, retired (not
        served again after a restart; the id may be admitted anew)."""
        with self._guard:
            seq = self._seq_of.pop(rollout_id, None)
            if seq is not None:
                self._retires.append(seq)
        self._kick()

    def _stub(self, rollout_id: str) -> list[Any] | None:
        # An update for a row already written: the upsert only touches the
        # status/result columns (and keeps task, running_at and detail unless
        # given), so these placeholders never overwrite anything.
        seq = self._seq_of.get(rollout_id)
        if seq is None:
            return None  # not ours (never admitted through this store)
        return [seq, rollout_id, b"", "", "queued", 0.0, *[None] * 8]

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
        with self._write_lock:
            with self._guard:
                rows = list(self._pending.values())
                retires = self._retires
                self._pending = {}
                self._retires = []
                prune_through = self._next_seq - 1 - self.history_rows
            if prune_through < self._pruned_through + _PRUNE_BATCH:
                prune_through = 0
            if not rows and not retires and not prune_through:
                return
            try:
                with self._db:
                    self._db.execute("BEGIN")
                    if rows:
                        self._db.executemany(_UPSERT, rows)
                    if retires:
                        self._db.executemany(
                            "UPDATE rollouts SET retired = 1 WHERE seq = ?",
                            [(i,) for i in retires],
                        )
                    if prune_through:
                        self._db.execute(
                            "DELETE FROM rollouts WHERE seq <= ? AND retired = 1",
                            (prune_through,),
                        )
                if prune_through:
                    self._pruned_through = prune_through
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
        with self._read_lock:
            self._reader.close()
        self._lock_file.close()


def _json(text: str | None) -> Any:
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return None


def _record(row: tuple[Any, ...]) -> RolloutRecord:
    """A row of ``_LISTED`` columns."""
    seq, rollout_id, status, task, admitted, running, finished, reward, category, message = row[:10]
    return RolloutRecord(
        seq=seq,
        rollout_id=rollout_id,
        status=status,
        task=task,
        admitted_at=admitted,
        running_at=running,
        finished_at=finished,
        reward=reward,
        err_category=category,
        err_message=message,
        detail=_json(row[10]),
    )
