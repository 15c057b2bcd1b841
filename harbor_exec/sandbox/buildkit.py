"""BuildKit's build progress, as the readable log we keep for every build.

A ``POST /build?version=2`` progress stream carries ``{"id": "moby.buildkit.trace",
"aux": "<base64>"}`` entries; each ``aux`` is one serialised
``moby.buildkit.v1.StatusResponse`` (vertexes = build steps, their logs, statuses
and warnings). ``BuildkitProgress`` decodes them with the code ``protoc``
generated from BuildKit's own ``control.proto`` (``harbor_exec/sandbox/_buildkit/``) and
prints lines the way ``docker build --progress=plain`` does::

    #5 [2/3] RUN apt-get update
    #5 0.412 Get:1 http://deb.debian.org/debian bookworm InRelease [151 kB]
    #5 DONE 3.1s
    #6 [3/3] COPY tests/ /tests
    #6 CACHED

This module does not import ``docker``: it only turns bytes into lines.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field

from google.protobuf.message import DecodeError

from harbor_exec.sandbox._buildkit.control_pb2 import StatusResponse, Vertex

TRACE_ID = "moby.buildkit.trace"
#: The end of the error BuildKit gives a step stopped by another step's failure.
CANCELED = "context canceled"


@dataclass
class _Step:
    number: int
    name: str = ""
    announced: bool = False
    finished: bool = False
    partial: dict[int, str] = field(default_factory=dict)  # stream -> unterminated line


@dataclass
class BuildkitProgress:
    """Decodes ``moby.buildkit.trace`` payloads into log lines; keeps only per-step state.

    ``errors`` holds ``(step name, error)`` for every step that failed (not those
    cancelled because another failed), so a failed build can say which step broke
    even when the log is long.
    """

    errors: list[tuple[str, str]] = field(default_factory=list)
    _steps: dict[str, _Step] = field(default_factory=dict)
    # When each step started: log lines carry their offset into the step, as buildctl prints.
    _started_ns: dict[str, int] = field(default_factory=dict)

    def feed(self, aux: str | bytes) -> list[str]:
        """The log lines one trace entry adds (raises ``ValueError`` on a corrupt entry)."""
        try:
            status = StatusResponse.FromString(base64.b64decode(aux, validate=True))
        except (binascii.Error, DecodeError) as exc:
            raise ValueError(f"not a BuildKit status message: {exc}") from None
        lines: list[str] = []
        for vertex in status.vertexes:
            lines.extend(self._vertex(vertex))
        for log in status.logs:
            step = self._step(log.vertex)
            lines.extend(self._announce(step))
            text = step.partial.pop(log.stream, "") + log.msg.decode("utf-8", "replace")
            *complete, rest = text.replace("\r\n", "\n").split("\n")
            if rest:
                step.partial[log.stream] = rest
            elapsed = ""
            if log.HasField("timestamp"):
                elapsed = self._elapsed(log.vertex, log.timestamp.ToNanoseconds())
            lines.extend(f"#{step.number} {elapsed}{line}".rstrip() for line in complete)
        for warning in status.warnings:
            step = self._step(warning.vertex)
            lines.append(f"#{step.number} WARNING: {warning.short.decode('utf-8', 'replace')}")
        return lines

    def _elapsed(self, digest: str, at_ns: int) -> str:
        started = self._started_ns.get(digest)
        if started is None:
            return ""
        return f"{max(0, at_ns - started) / 1e9:.3f} "

    def _step(self, digest: str) -> _Step:
        step = self._steps.get(digest)
        if step is None:
            step = self._steps[digest] = _Step(number=len(self._steps) + 1)
        return step

    def _announce(self, step: _Step) -> list[str]:
        if step.announced or not step.name:
            return []
        step.announced = True
        return [f"#{step.number} {step.name}"]

    def _flush(self, step: _Step) -> list[str]:
        rest = [f"#{step.number} {text}" for text in step.partial.values() if text.strip()]
        step.partial.clear()
        return rest

    def _vertex(self, vertex: Vertex) -> list[str]:
        step = self._step(vertex.digest)
        if vertex.name:
            step.name = vertex.name
        if vertex.HasField("started") and vertex.digest not in self._started_ns:
            self._started_ns[vertex.digest] = vertex.started.ToNanoseconds()
        lines: list[str] = []
        if step.finished:
            return lines
        # As ``docker build --progress=plain`` (BuildKit's progressui): a step's last
        # line comes when it completed (or failed), an error before a cache flag.
        if not (vertex.HasField("completed") or vertex.error):
            if vertex.HasField("started"):
                lines.extend(self._announce(step))
            return lines
        lines.extend(self._announce(step))
        lines.extend(self._flush(step))
        step.finished = True
        if vertex.error.endswith(CANCELED):
            # Stopped because another step failed: not this step's error.
            lines.append(f"#{step.number} CANCELED")
        elif vertex.error:
            lines.append(f"#{step.number} ERROR: {vertex.error}")
            self.errors.append((step.name, vertex.error))
        elif vertex.cached:
            lines.append(f"#{step.number} CACHED")
        else:
            seconds = 0.0
            if vertex.HasField("started"):
                seconds = (vertex.completed.ToNanoseconds() - vertex.started.ToNanoseconds()) / 1e9
            lines.append(f"#{step.number} DONE {max(seconds, 0.0):.1f}s")
        return lines

    def failed_step(self, error: str) -> str | None:
        """The step whose error the build's final ``error`` quotes (else the first
        that failed): the one a message about the failed build names."""
        for name, message in self.errors:
            if message in error or error in message:
                return name
        return self.errors[0][0] if self.errors else None

    def close(self) -> list[str]:
        """Lines still buffered (a step's last output without a newline)."""
        lines: list[str] = []
        for step in self._steps.values():
            lines.extend(self._flush(step))
        return lines
