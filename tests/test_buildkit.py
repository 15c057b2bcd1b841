"""BuildKit progress decoding, without an engine: StatusResponse messages in, log lines out."""

from __future__ import annotations

import base64

import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from harbor_exec.sandbox._buildkit.control_pb2 import (
    StatusResponse,
    Vertex,
    VertexLog,
    VertexStatus,
    VertexWarning,
)
from harbor_exec.sandbox.buildkit import BuildkitProgress


def at(seconds: float) -> Timestamp:
    stamp = Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


def aux(message: StatusResponse) -> str:
    """What the engine puts in a ``moby.buildkit.trace`` entry."""
    return base64.b64encode(message.SerializeToString()).decode()


def test_steps_output_cached_and_done() -> None:
    progress = BuildkitProgress()
    lines = progress.feed(
        aux(
            StatusResponse(
                vertexes=[
                    Vertex(
                        digest="sha256:a",
                        name="[1/3] FROM debian",
                        cached=True,
                        started=at(99),
                        completed=at(99),
                    ),
                    Vertex(digest="sha256:b", name="[2/3] RUN make", started=at(100)),
                ]
            )
        )
    )
    assert lines == ["#1 [1/3] FROM debian", "#1 CACHED", "#2 [2/3] RUN make"]
    # Output split mid-line across messages comes out as whole lines.
    lines = progress.feed(
        aux(
            StatusResponse(
                logs=[VertexLog(vertex="sha256:b", timestamp=at(100.5), msg=b"compil")],
                statuses=[VertexStatus(ID="x", vertex="sha256:b", current=1, total=2)],
            )
        )
    )
    assert lines == []
    lines = progress.feed(
        aux(
            StatusResponse(
                logs=[VertexLog(vertex="sha256:b", timestamp=at(101.25), msg=b"ing\nlinking\npart")]
            )
        )
    )
    assert lines == ["#2 1.250 compiling", "#2 1.250 linking"]
    lines = progress.feed(
        aux(
            StatusResponse(
                vertexes=[
                    Vertex(
                        digest="sha256:b",
                        name="[2/3] RUN make",
                        started=at(100),
                        completed=at(102.5),
                    )
                ]
            )
        )
    )
    assert lines == ["#2 part", "#2 DONE 2.5s"]
    # A vertex reported again after it finished adds nothing.
    again = Vertex(digest="sha256:b", name="[2/3] RUN make", started=at(100), completed=at(102.5))
    assert progress.feed(aux(StatusResponse(vertexes=[again]))) == []
    assert progress.errors == []


def test_failed_step_is_recorded_with_its_output() -> None:
    progress = BuildkitProgress()
    progress.feed(
        aux(StatusResponse(vertexes=[Vertex(digest="d", name="[2/2] RUN exit 3", started=at(1))]))
    )
    lines = progress.feed(
        aux(
            StatusResponse(
                logs=[VertexLog(vertex="d", timestamp=at(1.1), stream=2, msg=b"boom")],
                warnings=[VertexWarning(vertex="d", short=b"deprecated syntax")],
            )
        )
    )
    assert lines == ["#1 WARNING: deprecated syntax"]
    failed = Vertex(digest="d", name="[2/2] RUN exit 3", error="exit code: 3", completed=at(2))
    lines = progress.feed(aux(StatusResponse(vertexes=[failed])))
    assert lines == ["#1 boom", "#1 ERROR: exit code: 3"]
    assert progress.errors == [("[2/2] RUN exit 3", "exit code: 3")]


def test_unknown_fields_are_skipped() -> None:
    # A newer engine adds fields (e.g. Vertex.progressGroup = 8); the decoder skips them.
    known = StatusResponse(vertexes=[Vertex(digest="d", name="step", cached=True, completed=at(1))])
    extra = b"\x42\x03\x0a\x01x"  # field 8, length-delimited, a nested message
    vertex_bytes = known.vertexes[0].SerializeToString() + extra
    wire = b"\x0a" + bytes([len(vertex_bytes)]) + vertex_bytes
    lines = BuildkitProgress().feed(base64.b64encode(wire).decode())
    assert lines == ["#1 step", "#1 CACHED"]


def test_close_flushes_a_last_line_without_newline() -> None:
    progress = BuildkitProgress()
    progress.feed(aux(StatusResponse(vertexes=[Vertex(digest="d", name="s", started=at(1))])))
    progress.feed(aux(StatusResponse(logs=[VertexLog(vertex="d", msg=b"tail")])))
    assert progress.close() == ["#1 tail"]


@pytest.mark.parametrize("payload", ["not base64!", base64.b64encode(b"\xff\xff\xff").decode()])
def test_corrupt_entry_is_a_clear_error(payload: str) -> None:
    with pytest.raises(ValueError, match="not a BuildKit status message"):
        BuildkitProgress().feed(payload)


def test_a_step_is_cached_only_once_it_completed() -> None:
    """BuildKit may flag a step cached before it completes; a build that fails
    first never finished it, and the log must not call it CACHED."""
    progress = BuildkitProgress()
    early = Vertex(digest="c", name="[3/3] COPY . /app", cached=True, started=at(1))
    assert progress.feed(aux(StatusResponse(vertexes=[early]))) == ["#1 [3/3] COPY . /app"]
    stopped = Vertex(
        digest="c", name="[3/3] COPY . /app", cached=True, error="context canceled", completed=at(2)
    )
    assert progress.feed(aux(StatusResponse(vertexes=[stopped]))) == ["#1 CANCELED"]
    assert progress.errors == []


def test_the_failed_build_names_the_step_whose_error_it_quotes() -> None:
    """Two stages at once: ``a`` fails, which cancels ``b``; the engine's final error
    quotes ``a``'s, and the message must name ``a``, not the step that stopped last."""
    progress = BuildkitProgress()
    real = "executor failed running [/bin/sh -c false]: exit code: 1"
    progress.feed(
        aux(
            StatusResponse(
                vertexes=[
                    Vertex(digest="a", name="[a 2/2] RUN false", error=real, completed=at(2)),
                    Vertex(
                        digest="b",
                        name="[b 2/2] RUN sleep 4",
                        error="executor failed running [/bin/sh -c sleep 4]: exit code: 137: "
                        "context canceled: context canceled",
                        completed=at(2),
                    ),
                ]
            )
        )
    )
    assert progress.failed_step(real) == "[a 2/2] RUN false"
    assert progress.failed_step("something else") == "[a 2/2] RUN false"
    assert BuildkitProgress().failed_step(real) is None
