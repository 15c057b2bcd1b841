"""Files over the command channel (``KIND_PUT``/``KIND_GET``) land and come back exactly
as through the engine's archive API (real Docker).

Two containers of one image, one with the channel and one without: the same archive,
put over a layout an agent could leave (``/logs`` a link elsewhere, a stale
``/logs/verifier`` tree with a reward in it, ``/tests`` a file, a directory where a file
goes), gives the same tree in both, with no engine call for the channel's; a get of a
tree (files, links, a fifo, owners, modes, times) gives the same entries; an archive
past the channel's cap, a missing path and a killed server take the engine's way.
"""

from __future__ import annotations

import io
import stat
import tarfile
from collections.abc import Iterator
from typing import Any

import pytest

from harbor_exec.sandbox import docker as docker_module
from harbor_exec.sandbox.archives import ArchiveEntry, build_archive
from harbor_exec.sandbox.docker import DockerRuntime
from tests.channel_utils import channel_pair, probe_spec
from tests.server_utils import wait_until

# engine_lane: its own two containers.
pytestmark = [pytest.mark.docker, pytest.mark.engine_lane, pytest.mark.usefixtures("base_images")]

#: What an agent (root) leaves before the verifier's files go in.
LEFT_BY_THE_AGENT = """
set -e
mkdir -p /tmp/elsewhere && echo theirs > /tmp/elsewhere/keep.txt
ln -s /tmp/elsewhere /logs
mkdir -p /tmp/stale/verifier/deep && echo 1 > /tmp/stale/verifier/reward.txt
echo x > /tests
mkdir -p /opt/thing/inside && echo y > /opt/thing/inside/file
"""

#: Every path the test compares, as find prints it (type, mode, owner, size, link); the
#: times of what the archive placed (the rest was made by each container at its time).
LISTING = (
    "find /logs /logs/ /tests /opt/thing /deep /tmp/elsewhere /tmp/stale "
    "-printf '%p %y %m %U:%G %s %l\\n' 2>/dev/null | sort; "
    "find /logs/verifier /tests /opt/thing /deep/a/b/file -printf '%p %T@\\n' | sort; "
    "cat /tests/test.sh /tests/data/x.txt /opt/thing /deep/a/b/file 2>&1"
)


@pytest.fixture(scope="module")
def pair(docker_runtime: DockerRuntime) -> Iterator[dict[str, Any]]:
    with channel_pair(docker_runtime, "hx-channel-files") as created:
        yield created


@pytest.fixture
def engine_calls(pair: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every archive call that reached the engine, by container ("on"/"off")."""
    runtime: DockerRuntime = pair["runtime"]
    calls: list[str] = []
    names = {pair["on"]: "on", pair["off"]: "off"}
    put, get = runtime._api.put_archive, runtime._engine_archive

    def counted_put(container: str, path: str, data: Any) -> Any:
        calls.append(f"put {names[container]}")
        return put(container, path, data)

    def counted_get(container: str, path: str) -> Any:
        calls.append(f"get {names[container]}")
        return get(container, path)

    monkeypatch.setattr(runtime._api, "put_archive", counted_put)
    monkeypatch.setattr(runtime, "_engine_archive", counted_get)
    return calls


def members(chunks: Iterator[bytes] | None) -> list[tuple[Any, ...]]:
    """An archive's entries as comparable tuples (content included)."""
    assert chunks is not None
    data = b"".join(chunks)
    out = []
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for m in tar:
            content = tar.extractfile(m).read() if m.isfile() else b""  # type: ignore[union-attr]
            name = m.name.rstrip("/")
            # The engine's headers carry the type bits in the mode too (Go's tar).
            mode = stat.S_IMODE(m.mode)
            out.append((name, m.type, mode, m.uid, m.gid, m.linkname, int(m.mtime), content))
    return sorted(out)


def test_a_put_over_what_the_agent_left_lands_as_through_the_engine(
    pair: dict[str, Any], engine_calls: list[str]
) -> None:
    runtime: DockerRuntime = pair["runtime"]
    archive = build_archive(
        [
            ArchiveEntry("/logs", None, 0o755),
            ArchiveEntry("/logs/verifier", None, 0o755, fresh=True, owner=(1000, 1000)),
            ArchiveEntry("/tests", None, 0o755, fresh=True),
            ArchiveEntry("/tests/test.sh", b"#!/bin/bash\necho ok\n", 0o755),
            ArchiveEntry("/tests/data", None, 0o750),
            ArchiveEntry("/tests/data/x.txt", b"data\n", 0o640, owner=(1000, 1001)),
            ArchiveEntry("/opt/thing", b"a file now\n", 0o600),
            ArchiveEntry("/deep/a/b/file", b"parents made\n", 0o644),
        ]
    )
    listings = {}
    for side in ("on", "off"):
        left = runtime.exec(pair[side], ["sh", "-c", LEFT_BY_THE_AGENT])
        assert left.exit_code == 0, left
        runtime.put_archive(pair[side], archive)
        listed = runtime.exec(pair[side], ["sh", "-c", LISTING])
        # Times of what the archive made are the archive's; the rest is compared whole.
        listings[side] = listed.output
    assert engine_calls == ["put off"]  # the channel's went through its server alone
    assert listings["on"] == listings["off"]
    text = listings["on"].decode()
    assert "/logs d 755 0:0" in text and "/logs/verifier d 755 1000:1000" in text
    assert "/tmp/elsewhere/keep.txt f 644" in text  # the link was replaced, not followed
    assert "/tmp/stale/verifier/reward.txt" in text  # (not under /logs: untouched)
    assert "/tests/data/x.txt f 640 1000:1001 5" in text
    assert "/opt/thing f 600 0:0 11" in text and "/opt/thing/inside" not in text
    assert "/deep/a/b/file f 644" in text and "/deep/a d 755 0:0" in text


GET_TREE = """
set -e
rm -rf /data && mkdir -p /data/sub/empty
printf 'hello\\n' > /data/a.txt && chmod 600 /data/a.txt && chown 1000:1001 /data/a.txt
: > /data/sub/empty.txt
head -c 300000 /dev/urandom > /data/sub/blob.bin
ln -s /etc/passwd /data/abs-link && ln -s ../a.txt /data/sub/rel-link
mkfifo /data/pipe
chmod 750 /data/sub && touch -d 2020-01-02T03:04:05 /data/a.txt /data/sub
"""


def test_a_get_packs_as_the_engine_does(pair: dict[str, Any], engine_calls: list[str]) -> None:
    runtime: DockerRuntime = pair["runtime"]
    # One tree, made once and copied (times kept) to the other container.
    made = runtime.exec(pair["on"], ["sh", "-c", GET_TREE])
    assert made.exit_code == 0, made
    tree = b"".join(runtime._engine_archive(pair["on"], "/data") or [])
    runtime._api.put_archive(pair["off"], "/", tree)
    engine_calls.clear()
    for path in ("/data", "/data/a.txt", "/data/sub/rel-link"):
        on = members(runtime.get_archive(pair["on"], path))
        off = members(runtime.get_archive(pair["off"], path))
        assert on == off, path
    assert engine_calls == ["get off"] * 3
    names = {m[0] for m in members(runtime.get_archive(pair["on"], "/data"))}
    assert {"data", "data/pipe", "data/abs-link", "data/sub/blob.bin"} <= names
    # A missing path is the engine's 404 in both.
    assert runtime.get_archive(pair["on"], "/no/such/path") is None
    assert runtime.get_archive(pair["off"], "/no/such/path") is None


def test_past_the_cap_the_engine_streams_it(
    pair: dict[str, Any], engine_calls: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime: DockerRuntime = pair["runtime"]
    monkeypatch.setattr(docker_module, "_CHANNEL_GET_CAP", 1 << 20)
    made = runtime.exec(pair["on"], ["sh", "-c", "head -c 3000000 /dev/urandom > /big.bin"])
    assert made.exit_code == 0
    got = members(runtime.get_archive(pair["on"], "/big.bin"))
    assert engine_calls == ["get on"]
    assert len(got) == 1 and len(got[0][-1]) == 3_000_000
    # The channel is still there: the server stopped packing and lives on.
    engine_calls.clear()
    assert members(runtime.get_archive(pair["on"], "/etc/hostname"))
    assert engine_calls == []


def test_a_killed_server_leaves_files_to_the_engine(docker_runtime: DockerRuntime) -> None:
    spec = probe_spec("hx-channel-files-killed", True, memory_mb=256, pids_limit=64)
    container = docker_runtime.create(spec)
    try:
        docker_runtime.start(container)
        channel = docker_runtime._channels[container]
        kill = (
            "kill -9 $(grep -l 'commands/c[.]sock' /proc/[0-9]*/cmdline | cut -d/ -f3 | grep -vx 1)"
        )
        docker_runtime.exec(container, ["sh", "-c", kill])
        assert wait_until(lambda: not channel.alive, timeout=10)
        docker_runtime.put_archive(container, build_archive([ArchiveEntry("/f.txt", b"in\n")]))
        got = members(docker_runtime.get_archive(container, "/f.txt"))
        assert [(m[0], m[-1]) for m in got] == [("f.txt", b"in\n")]
    finally:
        docker_runtime.remove(container)


def test_a_big_put_streams_through_the_server(
    pair: dict[str, Any], engine_calls: list[str]
) -> None:
    """A hand-over of tens of MB (a file object, as a separate verifier's): unpacked by
    the server as it arrives (a few chunks held at a time), byte for byte."""
    import hashlib
    import os
    import tempfile

    runtime: DockerRuntime = pair["runtime"]
    data = os.urandom(48 << 20)
    with tempfile.TemporaryFile() as archive:
        archive.write(build_archive([ArchiveEntry("/big/handover.bin", data, 0o644)]))
        archive.seek(0)
        runtime.put_archive(pair["on"], archive)
    assert engine_calls == []
    digest = runtime.exec(pair["on"], ["sh", "-c", "sha256sum /big/handover.bin"])
    assert digest.output.split()[0].decode() == hashlib.sha256(data).hexdigest()
