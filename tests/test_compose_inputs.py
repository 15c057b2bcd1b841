"""What a compose task may make the host read, checked before Docker Compose runs (no
engine: the refusals come first), and the registry a task-named image pulls from."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from harbor_exec.errors import TaskConfigError, UnsafeTaskPathError
from harbor_exec.sandbox.docker import image_registry
from harbor_exec.sandbox.dockerfile_syntax import base_images
from harbor_exec.tasks.task import load_task
from harbor_exec.trial.compose_inputs import (
    MAX_INPUT_BYTES,
    check_compose_inputs,
    sanitized_dotenv,
)
from tests.task_factory import make_compose_task


def compose_of(task: Path) -> Path:
    return task / "environment" / "docker-compose.yaml"


def check(task: Path) -> None:
    check_compose_inputs(load_task(task), compose_of(task))


def with_main(task: Path, lines: str) -> Path:
    compose = compose_of(task)
    compose.write_text(compose.read_text().replace("  main:\n", "  main:\n" + lines, 1))
    return task


def test_the_plain_task_passes(tmp_path: Path) -> None:
    task = make_compose_task(tmp_path, "plain")
    (task / "environment" / "vars.env").write_text("A=1\n")
    check(with_main(task, "    env_file: vars.env\n"))
    assert sanitized_dotenv(load_task(task)) is None


@pytest.mark.parametrize(
    ("lines", "field"),
    [
        ("    env_file: /etc/environment\n", "services.main.env_file[0]"),
        (
            "    env_file:\n      - path: ../../outside.env\n        required: false\n",
            "env_file[0]",
        ),
        ("    env_file: ${HOME}/.env\n", "spelled with a variable"),
        ("    extends:\n      file: /root/other.yaml\n      service: x\n", "extends.file"),
        ("    build:\n      context: https://example.com/repo.git\n", "remote context"),
        ("    build:\n      context: /\n", "build.context"),
        ("    build:\n      context: .\n      dockerfile: /dev/zero\n", "build.dockerfile"),
        ("    build:\n      context: .\n      ssh: [default]\n", "ssh and secrets"),
    ],
)
def test_host_reads_are_refused_by_name(tmp_path: Path, lines: str, field: str) -> None:
    with pytest.raises(TaskConfigError, match=field.replace("[", r"\[").replace("$", r"\$")):
        check(with_main(make_compose_task(tmp_path, "hostile"), lines))


def test_include_and_host_secrets_are_refused(tmp_path: Path) -> None:
    task = make_compose_task(tmp_path, "include")
    compose = compose_of(task)
    plain = compose.read_text()
    compose.write_text("include:\n  - http://127.0.0.1:9/repo.git\n" + plain)
    with pytest.raises(TaskConfigError, match="include"):
        check(task)
    compose.write_text(plain + "secrets:\n  key:\n    environment: OPENAI_API_KEY\n")
    with pytest.raises(TaskConfigError, match=r"secrets\.key\.environment"):
        check(task)


def test_a_dockerfile_that_never_ends_is_refused_unread(tmp_path: Path) -> None:
    task = make_compose_task(tmp_path, "huge")
    huge = task / "environment" / "db" / "Dockerfile.huge"
    huge.write_bytes(b"#" * (MAX_INPUT_BYTES + 1))
    fifo = task / "environment" / "db" / "Dockerfile.fifo"
    os.mkfifo(fifo)  # a read would wait forever
    compose = compose_of(task)
    plain = compose.read_text()
    for name, message in (("Dockerfile.huge", "over"), ("Dockerfile.fifo", "not a regular file")):
        compose.write_text(
            plain.replace(
                "    build: ./db\n", f"    build:\n      context: ./db\n      dockerfile: {name}\n"
            )
        )
        started = time.monotonic()
        with pytest.raises(TaskConfigError, match=message):
            check(task)
        assert time.monotonic() - started < 1.0
    # A link inside environment/ to /dev/zero never loads: the task snapshot refuses it.
    fifo.unlink()
    (task / "environment" / "db" / "Dockerfile.zero").symlink_to("/dev/zero")
    with pytest.raises(UnsafeTaskPathError, match="outside the task directory"):
        load_task(task)


def test_the_projects_env_may_not_set_composes_switches(tmp_path: Path) -> None:
    task = make_compose_task(tmp_path, "dotenv")
    dotenv = task / "environment" / ".env"
    dotenv.write_text("ANSWER=42\n# a comment\n")
    assert sanitized_dotenv(load_task(task)) == "ANSWER=42\n# a comment\n"
    for line in ("COMPOSE_EXPERIMENTAL_GIT_REMOTE=1", "export DOCKER_HOST=tcp://10.0.0.1:2375"):
        dotenv.write_text(f"ANSWER=42\n{line}\n")
        with pytest.raises(TaskConfigError, match=line.split("=")[0].split()[-1]):
            sanitized_dotenv(load_task(task))
    dotenv.unlink()
    dotenv.symlink_to("/etc/environment")
    with pytest.raises(UnsafeTaskPathError, match="outside the task directory"):
        load_task(task)


@pytest.mark.parametrize(
    ("image", "registry"),
    [
        ("debian:bookworm-slim", "docker.io"),
        ("library/python:3.11", "docker.io"),
        ("ghcr.io/org/image:tag", "ghcr.io"),
        ("127.0.0.1:5000/internal/probe:latest", "127.0.0.1:5000"),
        ("localhost/probe", "localhost"),
        ("[::1]:5000/probe", "[::1]:5000"),
    ],
)
def test_the_registry_an_image_pulls_from(image: str, registry: str) -> None:
    assert image_registry(image) == registry


def test_the_images_a_dockerfile_builds_from() -> None:
    dockerfile = (
        "ARG BASE=127.0.0.1:5000/internal/probe\n"
        "FROM $BASE AS build\n"
        "FROM --platform=linux/amd64 ${RUNTIME:-debian:bookworm-slim}\n"
        "COPY --from=build /x /y\n"
        "COPY --from=ghcr.io/org/tools:1 /bin/t /bin/t\n"
        "RUN --mount=type=bind,from=quay.io/org/data:2,target=/d true\n"
        "FROM scratch\n"
    )
    assert base_images(dockerfile) == [
        "127.0.0.1:5000/internal/probe",
        "debian:bookworm-slim",
        "ghcr.io/org/tools:1",
        "quay.io/org/data:2",
    ]
    assert base_images(dockerfile, {"BASE": "debian:bookworm-slim"})[0] == "debian:bookworm-slim"
    with pytest.raises(ValueError, match=r"\$UNSET"):
        base_images("FROM $UNSET\n")


def test_a_dockerfile_is_read_for_the_cache_with_a_bound(tmp_path: Path) -> None:
    """A plain task's Dockerfile is read in the server to send its build through the
    package cache: a device or a huge file is not read whole (the build goes around
    the cache instead)."""
    from harbor_exec.network.packages.build_route import MAX_DOCKERFILE_BYTES, read_dockerfile

    plain = tmp_path / "Dockerfile"
    plain.write_text("FROM debian:bookworm-slim\n")
    assert read_dockerfile(plain) == "FROM debian:bookworm-slim\n"
    zero = tmp_path / "zero"
    zero.symlink_to("/dev/zero")
    started = time.monotonic()
    assert read_dockerfile(zero) is None
    huge = tmp_path / "huge"
    with huge.open("wb") as out:
        out.truncate(MAX_DOCKERFILE_BYTES + 10)
    assert read_dockerfile(huge) is None
    assert time.monotonic() - started < 1.0
