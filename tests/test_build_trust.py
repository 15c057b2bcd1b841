"""The Dockerfile rewrite and the trust files of a cached image build
(``harbor_exec.network.packages.build_trust``), and the context tar that carries them
(the real engine: tests/test_build_cache_docker.py)."""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest

from harbor_exec.network.packages.build_trust import (
    TRUST_CONTEXT_DIR,
    rewrite_dockerfile,
    trust_conflict,
    trust_context_files,
    trust_lines,
)
from harbor_exec.network.packages.ca import CA_KEY, LocalCA
from harbor_exec.network.packages.trust import TRUST_MOUNT, trust_env, write_trust_dir
from harbor_exec.sandbox.docker import _context_tar

T = trust_lines()


def test_the_trust_lines_copy_the_directory_and_declare_every_variable() -> None:
    copy, arg = T.splitlines()
    assert copy == f"COPY {TRUST_CONTEXT_DIR}/ {TRUST_MOUNT}/"
    assert arg.split()[0] == "ARG" and set(arg.split()[1:]) == set(trust_env())
    assert "ENV" not in T


@pytest.mark.parametrize(
    ("dockerfile", "expected"),
    [
        # One stage; no final newline.
        ("FROM debian\nRUN apt-get update", f"FROM debian\n{T}RUN apt-get update\n"),
        # Multi-stage, lower case, AS, --platform; a global ARG before FROM stays global.
        (
            "ARG BASE=debian\nfrom --platform=linux/amd64 $BASE as build\nRUN make\n"
            "FROM build AS test\nRUN test\nFROM python:3.11\nCOPY --from=build /a /a\n",
            f"ARG BASE=debian\nfrom --platform=linux/amd64 $BASE as build\n{T}RUN make\n"
            f"FROM build AS test\n{T}RUN test\nFROM python:3.11\n{T}COPY --from=build /a /a\n",
        ),
        # A FROM continued over lines, a comment inside: after its last line.
        (
            "FROM \\\n  # the base\n  debian \\\n  AS base\nRUN x\n",
            f"FROM \\\n  # the base\n  debian \\\n  AS base\n{T}RUN x\n",
        ),
        # scratch has no tool to fetch with: nothing added (any case, with AS).
        (
            "FROM debian AS b\nRUN x\nFROM SCRATCH AS final\nCOPY --from=b /x /x\n",
            f"FROM debian AS b\n{T}RUN x\nFROM SCRATCH AS final\nCOPY --from=b /x /x\n",
        ),
        # Parser directives stay first; the escape character is the directive's.
        (
            "# escape=`\n# check=skip=all\nFROM debian `\n  AS a\nRUN echo `\n  from x\n",
            f"# escape=`\n# check=skip=all\nFROM debian `\n  AS a\n{T}RUN echo `\n  from x\n",
        ),
        # A "from" inside a RUN's continuation or a comment is no FROM; CRLF kept.
        (
            "FROM a\r\nRUN echo \\\r\n from b\r\n# FROM c\r\n",
            f"FROM a\r\n{T}RUN echo \\\r\n from b\r\n# FROM c\r\n",
        ),
        # A line break only "\n" is (a form feed in a RUN is not one).
        ("FROM a\nRUN echo 1\x0cFROM b\n", f"FROM a\n{T}RUN echo 1\x0cFROM b\n"),
        # No FROM at all: unchanged.
        ("# just a comment\n", "# just a comment\n"),
    ],
)
def test_the_rewrite_adds_trust_after_every_from(dockerfile: str, expected: str) -> None:
    assert rewrite_dockerfile(dockerfile) == expected


def test_a_directive_stays_first_even_with_trust() -> None:
    out = rewrite_dockerfile("# syntax-free\n#escape=\\\nFROM a\n")
    assert out.startswith("# syntax-free\n#escape=\\\nFROM a\nCOPY ")


@pytest.mark.parametrize(
    ("dockerfile", "args", "found"),
    [
        ("FROM a\nENV SSL_CERT_FILE=/etc/ssl/x.pem\n", None, "line 2: ENV SSL_CERT_FILE"),
        ("FROM a\nenv PIP_CERT /x\n", None, "line 2: ENV PIP_CERT"),
        ("FROM a\nENV A=1 \\\n  REQUESTS_CA_BUNDLE=/x\n", None, "line 2: ENV REQUESTS_CA_BUNDLE"),
        ("FROM a\n", {"NODE_EXTRA_CA_CERTS": "/x"}, "the build's own build argument"),
    ],
)
def test_a_dockerfile_that_sets_a_ca_variable_is_named(
    dockerfile: str, args: dict[str, str] | None, found: str
) -> None:
    reason = trust_conflict(dockerfile, args)
    assert reason is not None and reason.startswith(found), reason


@pytest.mark.parametrize(
    "dockerfile",
    ["FROM a\nENV PATH=/x:$PATH HOME=/root\n", "FROM a\nARG SSL_CERT_FILE\nRUN x\n", "FROM a\n"],
)
def test_other_dockerfiles_have_no_conflict(dockerfile: str) -> None:
    assert trust_conflict(dockerfile, {"HTTP_PROXY": "x"}) is None


def test_the_trust_files_are_the_public_ones_only(tmp_path: Path) -> None:
    ca = LocalCA(tmp_path / "ca")
    trust = write_trust_dir(ca, tmp_path / "trust")
    (trust / "stray").write_text("not sent")
    files = trust_context_files(trust)
    assert sorted(files) == [f"{TRUST_CONTEXT_DIR}/apt.conf", f"{TRUST_CONTEXT_DIR}/ca-bundle.pem"]
    key = (ca.directory / CA_KEY).read_bytes()
    assert all(key not in data and b"PRIVATE KEY" not in data for data in files.values())
    assert files[f"{TRUST_CONTEXT_DIR}/ca-bundle.pem"].startswith(ca.cert_pem.rstrip(b"\n"))


def test_the_context_tar_carries_the_overlay_and_keeps_dockerignore(tmp_path: Path) -> None:
    context = tmp_path / "ctx"
    (context / "sub").mkdir(parents=True)
    (context / "sub" / "Dockerfile").write_text("FROM a\n")
    (context / "keep.txt").write_text("kept")
    (context / "secret.txt").write_text("ignored")
    (context / ".dockerignore").write_text("secret.txt\n")
    extra = {"sub/Dockerfile": b"FROM rewritten\n", f"{TRUST_CONTEXT_DIR}/ca-bundle.pem": b"pem"}
    with (
        _context_tar(context, "sub/Dockerfile", extra) as fileobj,
        tarfile.open(fileobj=fileobj) as tar,
    ):
        members = tar.getmembers()
        names = [m.name for m in members]
        assert names[0] == "sub/Dockerfile"  # first, as BuildKit needs
        assert names.count("sub/Dockerfile") == 1
        assert "secret.txt" not in names and "keep.txt" in names
        dockerfile = tar.extractfile("sub/Dockerfile")
        assert dockerfile is not None and dockerfile.read() == b"FROM rewritten\n"
        bundle = tar.getmember(f"{TRUST_CONTEXT_DIR}/ca-bundle.pem")
        directory = tar.getmember(TRUST_CONTEXT_DIR)
        assert (bundle.mode, bundle.uid, directory.isdir(), directory.mode) == (
            0o644,
            0,
            True,
            0o755,
        )
