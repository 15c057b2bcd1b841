"""Image builds through the package cache with a real Docker engine: the build gateway
container (``harbor_exec.network.packages.build_gateway``, network ``none``) whose network
namespace the builds' RUN steps join, the predefined proxy build arguments, and the
local test apt mirror of ``test_package_cache_docker`` on 127.0.0.1 (the gateway's
proxy resolves only the test names, DNS off; a step has loopback and nothing else, so
nothing leaves loopback and the unix socket)."""

from __future__ import annotations

import hashlib
import shutil
import uuid
from pathlib import Path

import docker
import pip
import pytest

from harbor_exec.jobs.prewarm import prewarm_tasks
from harbor_exec.network.packages.build_gateway import KIND, build_proxy_args
from harbor_exec.network.packages.ca import CA_KEY, LocalCA
from harbor_exec.network.packages.service import PackageCacheService
from harbor_exec.network.packages.trust import trust_env
from harbor_exec.sandbox.docker import DockerRuntime
from harbor_exec.sandbox.runtime import LABEL_KIND, LABEL_OWNER
from harbor_exec.tasks.task import Task, load_task
from harbor_exec.trial import compose
from harbor_exec.trial.factory import run_trial
from harbor_exec.trial.policy import SandboxPolicy
from harbor_exec.trial.spec import TrialSpec
from harbor_exec.trial.trial import TrialRequest, image_tag_for
from tests.task_factory import make_compose_task, make_task
from tests.test_package_cache_docker import (  # the mirror fixture and its helpers
    DEB,
    INDEX,
    KEYRING,
    PACKAGES,
    TARBALL,
    WHEEL,
    Mirror,
    _egress,
    _service,
    mirror,
)

# engine_lane: each test its own upstream, cache and tasks; no engine-wide counts.
pytestmark = [
    pytest.mark.docker,
    pytest.mark.engine_lane("b"),
    pytest.mark.usefixtures("base_images"),
]

__all__ = ["build_tasks", "mirror"]  # mirror: a fixture, used by name

TASKS = 20
APT = (
    "rm -f /etc/apt/sources.list /etc/apt/sources.list.d/* && "
    "echo 'deb [trusted=yes] http://deb.test/debian stable main' "
    "> /etc/apt/sources.list.d/test.list && "
    "apt-get update -o Acquire::Languages=none && "
    "apt-get install -y --no-install-recommends hxdemo && "
    "grep -q 'from the mirror' /usr/share/hxdemo/ok"
)

#: The signed test repo as apt's only source, its lists fetched (in one RUN).
APT_SIGNED = (
    "rm -f /etc/apt/sources.list /etc/apt/sources.list.d/* && "
    f"echo 'deb [signed-by={KEYRING}] http://deb.test/debian stable main' "
    "> /etc/apt/sources.list.d/test.list && "
    "apt-get update -o Acquire::Languages=none"
)


def build_tasks(tmp_path: Path, nonce: str, count: int = TASKS) -> list[Task]:
    """``count`` tasks sharing a base and an apt package; each RUN differs (no shared
    layer), so every build runs apt itself (bench/bench_package_cache.py too)."""
    tasks = []
    for n in range(count):
        dockerfile = (
            "FROM debian:bookworm-slim\n"
            f'RUN echo "{nonce}-{n}" > /task-id && test -n "$HTTP_PROXY" && {APT}\n'
        )
        tasks.append(load_task(make_task(tmp_path, f"apt-{n:02d}", dockerfile=dockerfile)))
    return tasks


def _gateways(runtime: DockerRuntime) -> list[str]:
    """This process's build gateways (another process on the engine may have its own)."""
    client = docker.from_env()
    try:
        labels = [f"{LABEL_KIND}={KIND}", f"{LABEL_OWNER}={runtime.owner}"]
        found = client.api.containers(all=True, filters={"label": labels})
        return [str(c["Id"]) for c in found]
    finally:
        client.close()


def _proxy_traces(tag: str, url: str) -> list[str]:
    """Anything of the proxy in the image: a proxy variable in its config's env, the
    gateway's URL in its env or its history's commands."""
    client = docker.from_env()
    try:
        image = client.images.get(tag)
        env = image.attrs["Config"].get("Env") or []
        history = [str(step.get("CreatedBy", "")) for step in image.history()]
    finally:
        client.close()
    found = [line for line in env if "proxy" in line.split("=", 1)[0].lower()]
    return found + [line for line in [*env, *history] if url in line]


def _close(runtime: DockerRuntime, service: PackageCacheService, tags: list[str]) -> None:
    service.close()
    for tag in tags:
        if runtime.image_exists(tag):
            runtime.remove_image(tag)


def test_a_cold_build_of_twenty_tasks_fetches_each_package_once(
    docker_runtime: DockerRuntime, tmp_path: Path, mirror: tuple[Mirror, LocalCA]
) -> None:
    upstream, upstream_ca = mirror
    service = _service(tmp_path, upstream, upstream_ca)
    nonce = uuid.uuid4().hex
    tasks = build_tasks(tmp_path, nonce)
    opted_out = load_task(
        make_task(
            tmp_path,
            "opted-out",
            toml="[metadata]\nharbor_exec_package_cache = false\n",
            # Nothing of the cache: no proxy, no CA variable, no trust directory.
            dockerfile=f"FROM debian:bookworm-slim\nRUN echo {nonce} && "
            'test -z "$HTTP_PROXY$SSL_CERT_FILE$APT_CONFIG" && ! test -e /run/harbor-exec-trust\n',
        )
    )
    # BuildKit-only syntax: built by BuildKit, outside the cache, instead of failing.
    buildkit = load_task(
        make_task(
            tmp_path,
            "buildkit-only",
            dockerfile="FROM debian:bookworm-slim\n"
            f'RUN --mount=type=tmpfs,target=/scratch echo {nonce} && test -z "$HTTP_PROXY"\n',
        )
    )
    tags = [image_tag_for(task) for task in [*tasks, opted_out, buildkit]]
    try:
        outcomes = prewarm_tasks(
            docker_runtime,
            [*tasks, opted_out, buildkit],
            jobs=1,
            package_cache=service,
            egress=_egress(upstream),
        )
        assert [o.status for o in outcomes] == ["built"] * (TASKS + 2), [
            o.reason for o in outcomes if o.status == "failed"
        ]
        # Each package once from the upstream for all twenty builds; the index is
        # revalidated, never fetched in full more often than the builds asked.
        assert upstream.content_fetches(DEB) == 1
        assert upstream.http.count(DEB) == 1
        assert 1 <= upstream.content_fetches(PACKAGES) <= TASKS
        assert service.build_session is not None
        stats = service.build_session.stats.to_dict()
        assert stats["hits"] + stats["revalidated"] >= TASKS - 1, stats
        assert len(_gateways(docker_runtime)) == 1  # one gateway for the whole prewarm
        route = service.build_route(docker_runtime)  # the running gateway's
        url = route.build_args["HTTP_PROXY"]
        assert url == "http://127.0.0.1:3128" and route.network.startswith("container:")
        for tag in tags:
            assert _proxy_traces(tag, url) == [], tag
    finally:
        _close(docker_runtime, service, tags)
    assert _gateways(docker_runtime) == []


def test_a_build_cannot_reach_the_host_through_the_gateway(
    docker_runtime: DockerRuntime, tmp_path: Path, mirror: tuple[Mirror, LocalCA]
) -> None:
    """A RUN step has loopback only (the gateway's namespace, no bridge address); asking
    the proxy for a host address (the mirror's own port on 127.0.0.1) is refused; the
    public name the operator mapped is served."""
    upstream, upstream_ca = mirror
    service = _service(tmp_path, upstream, upstream_ca)
    port = upstream.http.port
    # Straight to the gateway (urllib would honour NO_PROXY for loopback names).
    probe = (
        "import http.client, os, socket, urllib.parse\n"
        "assert os.listdir('/sys/class/net') == ['lo'], os.listdir('/sys/class/net')\n"
        "assert urllib.parse.urlsplit(os.environ['HTTP_PROXY']).hostname == '127.0.0.1'\n"
        "probe = socket.socket()\n"
        f"assert probe.connect_ex(('127.0.0.1', {port})) != 0  # the host's port: not here\n"
        "gateway = urllib.parse.urlsplit(os.environ['HTTP_PROXY'])\n"
        "def get(url):\n"
        "    connection = http.client.HTTPConnection(gateway.hostname, gateway.port, timeout=30)\n"
        "    connection.request('GET', url)\n"
        "    status = connection.getresponse().status\n"
        "    connection.close()\n"
        "    print(url, status)\n"
        "    return status\n"
        f"assert get('http://127.0.0.1:{port}{DEB}') == 403\n"
        f"assert get('http://localhost:{port}{DEB}') == 403\n"
        f"assert get('http://deb.test{DEB}') == 200\n"
    )
    task_dir = make_task(
        tmp_path,
        "probe",
        dockerfile=f"FROM python:3.11-slim-bookworm\nCOPY probe.py /\n"
        f"RUN echo {uuid.uuid4().hex} && python3 /probe.py\n",
    )
    (task_dir / "environment" / "probe.py").write_text(probe)
    task = load_task(task_dir)
    tags = [image_tag_for(task)]
    try:
        [outcome] = prewarm_tasks(
            docker_runtime, [task], jobs=1, package_cache=service, egress=_egress(upstream)
        )
        assert outcome.status == "built", outcome.reason
        assert upstream.http.count(DEB) == 1  # only the mapped name reached the upstream
        # A gateway that went away (an engine restart) is replaced at the next build.
        [gone] = _gateways(docker_runtime)
        docker_runtime.remove(gone)
        [again] = build_tasks(tmp_path / "again", uuid.uuid4().hex, 1)
        tags.append(image_tag_for(again))
        [outcome] = prewarm_tasks(
            docker_runtime, [again], jobs=1, package_cache=service, egress=_egress(upstream)
        )
        assert outcome.status == "built", outcome.reason
        assert len(_gateways(docker_runtime)) == 1 and _gateways(docker_runtime) != [gone]
        assert upstream.content_fetches(DEB) == 1  # from the cache, through the new one
    finally:
        _close(docker_runtime, service, tags)
    assert _gateways(docker_runtime) == []


def test_a_compose_tasks_sidecar_image_builds_through_the_cache(
    docker_runtime: DockerRuntime, tmp_path: Path, mirror: tuple[Mirror, LocalCA]
) -> None:
    """A compose task whose ``build:`` sidecar apt-installs from the test mirror (a name
    only the cache's proxy resolves): its trial builds the sidecar through the cache,
    with the service's own build argument kept, and earns its reward."""
    upstream, upstream_ca = mirror
    service = _service(tmp_path, upstream, upstream_ca)
    nonce = uuid.uuid4().hex
    root = make_compose_task(tmp_path, "compose-apt")
    env = root / "environment"
    compose_yaml = env / "docker-compose.yaml"
    compose_yaml.write_text(
        compose_yaml.read_text().replace(
            "    build: ./db\n",
            f"    build:\n      context: ./db\n      args:\n        HX_NONCE: {nonce}\n",
        )
    )
    (env / "db" / "Dockerfile").write_text(
        "FROM python:3.11-slim-bookworm\nARG HX_NONCE\n"
        f'RUN test "$HX_NONCE" = "{nonce}" && test -n "$HTTP_PROXY" && {APT}\n'
    )
    task = load_task(root)
    project = compose.load_project(task, **compose.harbor_limits(task))
    tags = [compose._build_tag(task, s) for s in project.services.values() if s.build]
    assert len(tags) == 2  # main and db
    try:
        policy = SandboxPolicy(egress=_egress(upstream))
        result = run_trial(
            docker_runtime,
            TrialRequest(
                TrialSpec(task=task, trials_dir=tmp_path / "trials", policy=policy),
                package_cache=service,
            ),
        )
        assert result.exception_info is None, result.exception_info
        assert result.reward == 1.0
        # The sidecar's apt went through the cache: the package once from the mirror.
        assert upstream.content_fetches(DEB) == 1
        assert service.build_session is not None
        assert service.build_session.stats.to_dict()["misses"] >= 1
    finally:
        _close(docker_runtime, service, tags)
    assert _gateways(docker_runtime) == []


def _saved_image_contains(tag: str, needles: list[bytes]) -> list[bytes]:
    """Which of ``needles`` are anywhere in ``docker save`` of ``tag`` (every layer's
    files, the config, the history), scanned as a stream."""
    client = docker.from_env()
    found: set[bytes] = set()
    keep = max(len(n) for n in needles)
    tail = b""
    try:
        for chunk in client.images.get(tag).save(chunk_size=1024 * 1024):
            window = tail + chunk
            found.update(n for n in needles if n in window)
            tail = window[-keep:]
    finally:
        client.close()
    return [n for n in needles if n in found]


def test_cached_builds_cache_https_and_the_image_keeps_no_trust(
    docker_runtime: DockerRuntime, tmp_path: Path, mirror: tuple[Mirror, LocalCA]
) -> None:
    """Two cold builds (different first steps: nothing of the first in the layer cache
    the second uses) of a two-stage Dockerfile whose steps fetch over HTTPS with curl
    and pip from the local HTTPS host: the second fetches none of it from the upstream.
    The images have no proxy or CA variable in their config, the CA key in no layer;
    a hostile step that looks for the key finds nothing and one that overwrites its
    trust files changes no other build."""
    upstream, upstream_ca = mirror
    service = _service(tmp_path, upstream, upstream_ca)
    key = (service.ca.directory / CA_KEY).read_bytes()
    key_line = key.splitlines()[1]  # a base64 line of the key's body
    key_sha = hashlib.sha256(key).hexdigest()
    line_sha = hashlib.sha256(key_line).hexdigest()
    trust_before = {p.name: p.read_bytes() for p in service.trust_dir.iterdir()}
    tarball_sha = hashlib.sha256(upstream.tarball).hexdigest()
    wheel_sha = hashlib.sha256(upstream.wheels["1.0"]).hexdigest()
    # Looks for the CA key (the whole file, or a line of its body: by their hashes, so
    # the scan itself holds nothing of it) in every file of the step's filesystem.
    scan = (
        "import hashlib, os\n"
        "found = []\n"
        "for root, dirs, files in os.walk('/'):\n"
        "    if root.startswith(('/proc', '/sys', '/dev')):\n"
        "        dirs[:] = []\n"
        "    for name in files:\n"
        "        path = os.path.join(root, name)\n"
        "        try:\n"
        "            if not os.path.isfile(path) or os.path.islink(path):\n"
        "                continue\n"
        "            data = open(path, 'rb').read(1 << 22)\n"
        "        except OSError:\n"
        "            continue\n"
        f"        if hashlib.sha256(data).hexdigest() == '{key_sha}' or any(\n"
        f"            len(line) == {len(key_line)}\n"
        f"            and hashlib.sha256(line).hexdigest() == '{line_sha}'\n"
        "            for line in data.split()\n"
        "        ):\n"
        "            found.append(path)\n"
        "assert not found, found\n"
        "print('no key anywhere')\n"
    )

    def task(name: str, hostile: bool) -> Task:
        if hostile:  # looks for the key, then overwrites its trust files
            dockerfile = (
                "FROM python:3.11-slim-bookworm\nCOPY scan.py /scan.py\n"
                f"RUN echo {uuid.uuid4().hex} && python3 /scan.py && "
                "echo poison > /run/harbor-exec-trust/ca-bundle.pem && "
                "echo 'Acquire::https::Verify-Peer \"false\";' > /run/harbor-exec-trust/apt.conf"
                " && (mkdir -p /run/harbor-exec/egress && touch /run/harbor-exec/egress/x; true)\n"
            )
        else:
            dockerfile = (
                "# escape=\\\n"
                "from python:3.11-slim-bookworm \\\n"
                "    AS fetch\n"
                f"COPY hx-test-repo.gpg {KEYRING}\n"
                "COPY pip /usr/lib/python3/dist-packages/pip\n"
                f"RUN echo {uuid.uuid4().hex} && {APT_SIGNED} && \\\n"
                "    apt-get install -y --no-install-recommends curl\n"
                f"RUN curl -fsSL https://files.test{TARBALL} -o /tool.tar.gz && \\\n"
                f'    test "$(sha256sum < /tool.tar.gz | cut -d" " -f1)" = {tarball_sha}\n'
                f'RUN echo "demo==1.0 --hash=sha256:{wheel_sha}" > /req.txt && \\\n'
                "    python3 -m pip install --no-cache-dir --disable-pip-version-check \\\n"
                "    --target /site --require-hashes --index-url https://pypi.test/simple/ \\\n"
                "    -r /req.txt\n"
                "FROM debian:bookworm-slim\n"
                "COPY --from=fetch /tool.tar.gz /site/demo/__init__.py /out/\n"
                'RUN test -s "$SSL_CERT_FILE" && test "$APT_CONFIG" = /run/harbor-exec-trust/apt.conf'
                " && ! test -e /out/secret.txt\n"
            )
        root = make_task(tmp_path, name, dockerfile=dockerfile)
        (root / "environment" / "hx-test-repo.gpg").write_bytes(upstream.signer.keyring)
        (root / "environment" / "scan.py").write_text(scan)
        # The base image's python has no pip of its own (as test_package_cache_docker's).
        shutil.copytree(
            Path(pip.__file__).parent,
            root / "environment" / "pip",
            ignore=shutil.ignore_patterns("__pycache__"),
        )
        (root / "environment" / ".dockerignore").write_text("secret.txt\n")
        (root / "environment" / "secret.txt").write_text("not in the context\n")
        return load_task(root)

    tasks = [task("https-first", False), task("https-hostile", True), task("https-second", False)]
    tags = [image_tag_for(t) for t in tasks]
    try:
        for one in tasks:  # one after another: the second is a cold build of its own
            [outcome] = prewarm_tasks(
                docker_runtime, [one], jobs=1, package_cache=service, egress=_egress(upstream)
            )
            assert outcome.status == "built", outcome.reason
        # What the first build fetched over HTTPS, the second got from the cache.
        assert upstream.content_fetches(TARBALL) == 1
        assert upstream.content_fetches(WHEEL) == 1
        assert upstream.https.count(INDEX, 200, "GET") == 1  # then revalidated (304)
        assert upstream.https.count(INDEX, 304, "GET") >= 1
        assert upstream.content_fetches(upstream.debs[0]) == 1  # curl's deb, over HTTP
        assert service.build_session is not None
        assert service.build_session.stats.to_dict()["hits"] >= 3
        # The hostile step changed nothing outside its own layers.
        assert {p.name: p.read_bytes() for p in service.trust_dir.iterdir()} == trust_before
        client = docker.from_env()
        try:
            for tag in tags:
                image = client.images.get(tag)
                env = image.attrs["Config"].get("Env") or []
                names = {line.split("=", 1)[0] for line in env}
                assert not names & {*trust_env(), *build_proxy_args()}, env
                assert not [line for line in env if "harbor-exec" in line], env
                history = "\n".join(str(s.get("CreatedBy", "")) for s in image.history())
                assert "127.0.0.1:3128" not in history and "BEGIN" not in history
        finally:
            client.close()
        for tag in tags:
            assert _saved_image_contains(tag, [key, key_line]) == [], tag
        assert _proxy_traces(tags[2], "http://127.0.0.1:3128") == []
    finally:
        _close(docker_runtime, service, tags)
    assert _gateways(docker_runtime) == []
