"""The package cache with a real Docker engine: trials whose tests run ``apt-get update
&& apt-get install`` (a signed repo), ``pip install``, ``uv`` and ``curl https://...``
through the cache, against local upstreams on 127.0.0.1 standing in for a Debian
mirror, a package index and a file host (nothing leaves loopback: the egress proxies
resolve only the test names, DNS off).

The mirror serves real packages: Debian bookworm's curl with the libraries the image
lacks and uv's wheel, which scripts/setup.sh fetched from the registries
(``test_packages``; under CI the tests fail without them), so test.sh installs curl
and uv exactly as a real task does."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pip
import pytest

from harbor_exec.jobs.prewarm import prewarm_one
from harbor_exec.network.egress.plan import EgressSettings
from harbor_exec.network.packages.ca import CA_KEY, LocalCA
from harbor_exec.network.packages.service import PackageCacheConfig, PackageCacheService
from harbor_exec.network.packages.session import RESULT_FILE
from harbor_exec.sandbox.docker import DockerRuntime
from harbor_exec.tasks.task import load_task
from harbor_exec.trial.factory import run_trial
from harbor_exec.trial.policy import SandboxPolicy
from harbor_exec.trial.results import TrialResult
from harbor_exec.trial.spec import TrialSpec
from harbor_exec.trial.trial import TrialRequest
from tests.package_upstream import (
    TEST_TLS_HOSTS,
    AptSigner,
    Upstream,
    deb_stanza,
    release_file,
    serve_upstream,
    sni_context,
)
from tests.setup_files import TEST_PACKAGE_PATTERNS, TEST_PACKAGES, require_setup_files
from tests.task_factory import make_task

pytestmark = [pytest.mark.docker, pytest.mark.usefixtures("base_images")]

WHEEL = "/packages/demo-1.0-py3-none-any.whl"
INDEX = "/simple/demo/"
#: Installed by uv only (the demo wheel above is pip's).
UV_WHEEL = "/packages/uvdemo-1.0-py3-none-any.whl"
TARBALL = "/releases/tool-1.0.tar.gz"
DEB = "/debian/pool/main/h/hxdemo/hxdemo_1.0_all.deb"
PACKAGES = "/debian/dists/stable/main/binary-amd64/Packages"
RELEASE = "/debian/dists/stable/Release"
INRELEASE = "/debian/dists/stable/InRelease"
KEYRING = "/usr/share/keyrings/hx-test-repo.gpg"
# npm's own registry name, mapped to the local upstream like every test name (DNS off):
# its package documents take the cache's npm index rule.
NPM_REGISTRY = "registry.npmjs.org"
# Room for the uv wheel (~17 MB; one object may take a quarter of the bound).
BOUND = 128 * 1024 * 1024
HTML = {"Content-Type": "text/html"}


def _wheel(version: str, project: str = "demo") -> bytes:
    out = io.BytesIO()
    name = f"{project}-{version}"
    files = {
        f"{project}/__init__.py": f"VALUE = {version!r}\n".encode(),
        f"{name}.dist-info/METADATA": (
            f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n".encode()
        ),
        f"{name}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    with zipfile.ZipFile(out, "w") as archive:
        for path, data in files.items():
            archive.writestr(path, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{path},sha256={digest},{len(data)}")
        record.append(f"{name}.dist-info/RECORD,,")
        archive.writestr(f"{name}.dist-info/RECORD", "\n".join(record) + "\n")
    return out.getvalue()


def _deb(tmp: Path, padding: int = 0) -> bytes:
    """The ``hxdemo`` package (``padding`` random bytes in it: a bigger download)."""
    root = tmp / "deb"
    (root / "DEBIAN").mkdir(parents=True)
    (root / "usr/share/hxdemo").mkdir(parents=True)
    (root / "usr/share/hxdemo/ok").write_text("from the mirror\n")
    if padding:
        (root / "usr/share/hxdemo/padding").write_bytes(os.urandom(padding))
    (root / "DEBIAN/control").write_text(
        "Package: hxdemo\nVersion: 1.0\nArchitecture: all\nMaintainer: t <t@t>\n"
        "Description: test package\n"
    )
    subprocess.run(
        ["dpkg-deb", "--build", "-Zgzip", str(root), str(tmp / "x.deb")],
        check=True,
        capture_output=True,
    )
    return (tmp / "x.deb").read_bytes()


def _index(versions: list[str], wheels: dict[str, bytes]) -> bytes:
    return _links({f"demo-{v}-py3-none-any.whl": wheels[v] for v in versions})


def _links(files: dict[str, bytes]) -> bytes:
    """A PEP 503 project page: each file on the file host, with its sha256."""
    links = "".join(
        f'<a href="https://files.test/packages/{name}#sha256='
        f'{hashlib.sha256(data).hexdigest()}">{name}</a>\n'
        for name, data in files.items()
    )
    return f"<html><body>\n{links}</body></html>\n".encode()


def _npm_package(https: Upstream, name: str, version: str) -> str:
    """A package on the npm registry stand-in: its document and its tarball's path."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as archive:
        for member, data in (
            ("package/package.json", json.dumps({"name": name, "version": version}).encode()),
            ("package/index.js", f"module.exports = {json.dumps(version)};\n".encode()),
        ):
            info = tarfile.TarInfo(member)
            info.size, info.mode = len(data), 0o644
            archive.addfile(info, io.BytesIO(data))
    tgz = out.getvalue()
    path = f"/{name}/-/{name}-{version}.tgz"
    https.set(path, tgz)
    integrity = "sha512-" + base64.b64encode(hashlib.sha512(tgz).digest()).decode()
    dist = {
        "tarball": f"https://{NPM_REGISTRY}{path}",
        "integrity": integrity,
        "shasum": hashlib.sha1(tgz).hexdigest(),
    }
    document = {
        "name": name,
        "dist-tags": {"latest": version},
        "versions": {version: {"name": name, "version": version, "dist": dist}},
    }
    https.set(
        f"/{name}", json.dumps(document).encode(), headers={"Content-Type": "application/json"}
    )
    return path


class Mirror:
    """What the upstreams serve: a signed Debian repo (hxdemo, and the real curl debs
    from ``packages``), a PyPI index (demo for pip, uvdemo for uv, the real uv wheel) and
    a release tarball. ``signer``/``packages`` default to a throwaway key and
    scripts/setup.sh's files (the bench makes its mirror this way)."""

    def __init__(
        self,
        https: Upstream,
        http: Upstream,
        tmp: Path,
        deb_padding: int = 0,
        *,
        signer: AptSigner | None = None,
        packages: dict[str, list[Path]] | None = None,
    ) -> None:
        self.https, self.http = https, http
        if signer is None:
            home = Path(tempfile.mkdtemp(prefix="hx-gpg-"))
            home.chmod(0o700)
            signer = AptSigner(home)
        self.signer = signer
        if packages is None:
            packages = require_setup_files(TEST_PACKAGES, *TEST_PACKAGE_PATTERNS)
        self.wheels = {"1.0": _wheel("1.0"), "2.0": _wheel("2.0")}
        https.set(WHEEL, self.wheels["1.0"])
        https.set("/packages/demo-2.0-py3-none-any.whl", self.wheels["2.0"])
        https.set(INDEX, _index(["1.0"], self.wheels), headers=HTML)
        uvdemo = _wheel("1.0", "uvdemo")
        https.set(UV_WHEEL, uvdemo)
        https.set("/simple/uvdemo/", _links({Path(UV_WHEEL).name: uvdemo}), headers=HTML)
        uv = packages["pypi/uv-*.whl"][-1]
        self.uv_version = uv.name.split("-")[1]
        self.uv_wheel = f"/packages/{uv.name}"
        https.set(self.uv_wheel, uv.read_bytes())
        https.set("/simple/uv/", _links({uv.name: uv.read_bytes()}), headers=HTML)
        npm = packages["npm/npm-*.tgz"][-1]
        self.npm_version = npm.name.removeprefix("npm-").removesuffix(".tgz")
        self.npm_cli = f"/npm/-/{npm.name}"
        https.set(self.npm_cli, npm.read_bytes())
        self.npm_demo = _npm_package(https, "hxnpmdemo", "1.0.0")
        self.tarball = b"tool-1.0 release\n" * 4096
        https.set(TARBALL, self.tarball, headers={"Cache-Control": "max-age=3600"})
        deb = _deb(tmp, deb_padding)
        http.set(DEB, deb)
        stanzas = [
            deb_stanza(
                deb,
                DEB.removeprefix("/debian/"),
                control="Package: hxdemo\nVersion: 1.0\nArchitecture: all\n"
                "Maintainer: t <t@t>\nDescription: test package",
            )
        ]
        #: The real debs' paths on the mirror (curl's first).
        self.debs: list[str] = []
        #: nodejs's beyond curl's (the npm test's).
        self.node_debs: list[str] = []
        for group, found in (
            (self.debs, packages["debian/*.deb"]),
            (self.node_debs, packages["debian-node/*.deb"]),
        ):
            for path in found:
                # Only unreserved characters ("+" and "~" come as "%2b", "%7e": the
                # upstream matches paths as sent).
                served = f"/debian/pool/main/{re.sub(r'[^A-Za-z0-9._-]', '_', path.name)}"
                http.set(served, path.read_bytes())
                stanzas.append(deb_stanza(path, served.removeprefix("/debian/")))
                group.append(served)
        self.debs.sort(key=lambda d: not Path(d).name.startswith("curl_"))
        self.packages = b"".join(stanzas)
        self.publish()

    def publish(self, signer: AptSigner | None = None) -> None:
        """``Packages`` and its ``Release``, signed (``InRelease``, ``Release.gpg``) by
        ``signer`` (default: the key the image trusts)."""
        signer = signer or self.signer
        self.http.set(PACKAGES, self.packages)
        release = release_file("stable", [("main/binary-amd64/Packages", self.packages)])
        self.http.set(RELEASE, release)
        self.http.set(INRELEASE, signer.inrelease(release))
        self.http.set(RELEASE + ".gpg", signer.detached(release))

    def artifacts(self) -> list[str]:
        """Every package a trial's test.sh downloads (named by content)."""
        return [WHEEL, UV_WHEEL, self.uv_wheel, TARBALL, DEB, *self.debs]

    def content_fetches(self, path: str) -> int:
        upstream = self.http if path.startswith("/debian") else self.https
        return upstream.count(path, 200, "GET")

    def fetched(self) -> dict[str, int]:
        return {p: self.content_fetches(p) for p in self.artifacts()}


#: An HTTPS host that is no package host: the cache tunnels it untouched.
UNTOUCHED = "elsewhere.test"
UNTOUCHED_PATH = "/elsewhere/ok"


def apt_preamble(root: str = "/debian") -> str:
    """What the test scripts start with: a reward of 0 on failure, and the signed test
    repo at ``http://deb.test<root>`` as apt's only source, its lists fetched."""
    return f"""
set -eu
fail() {{ echo "FAIL: $*"; echo 0 > /logs/verifier/reward.txt; exit 0; }}
rm -f /etc/apt/sources.list /etc/apt/sources.list.d/*
echo 'deb [signed-by={KEYRING}] http://deb.test{root} stable main' \\
    > /etc/apt/sources.list.d/test.list
apt-get update -o Acquire::Languages=none || fail apt-get update
"""


APT_PREAMBLE = apt_preamble()


TEST_SH = f"""{APT_PREAMBLE}apt-get install -y --no-install-recommends hxdemo curl || fail apt-get install
grep -q 'from the mirror' /usr/share/hxdemo/ok || fail deb content
curl -fsSL https://files.test{TARBALL} -o /tmp/tool.tar.gz || fail curl
[ "$(sha256sum < /tmp/tool.tar.gz | cut -d' ' -f1)" = "$(cat /tests/tarball.sha256)" ] \\
    || fail curl content
echo "demo==1.0 --hash=sha256:$(cat /tests/wheel.sha256)" > /tmp/req.txt
python3 -m pip install --no-cache-dir --disable-pip-version-check --target /tmp/site \\
    --require-hashes --index-url https://pypi.test/simple/ -r /tmp/req.txt || fail pip
PYTHONPATH=/tmp/site python3 -c "import demo; assert demo.VALUE == '1.0'" || fail import
python3 -m pip install --no-cache-dir --disable-pip-version-check --target /tmp/uv \\
    --index-url https://pypi.test/simple/ "uv==$(cat /tests/uv.version)" || fail pip install uv
export UV_PYTHON_DOWNLOADS=never
/tmp/uv/bin/uv venv /tmp/venv || fail uv venv
/tmp/uv/bin/uv pip install --python /tmp/venv/bin/python --index-url https://pypi.test/simple/ \\
    uvdemo==1.0 || fail uv pip install
/tmp/venv/bin/python -c "import uvdemo; assert uvdemo.VALUE == '1.0'" || fail uv import
python3 - <<'PY' || fail https download
import hashlib, urllib.request
data = urllib.request.urlopen("https://files.test{TARBALL}").read()
assert hashlib.sha256(data).hexdigest() == open("/tests/tarball.sha256").read().strip()
index = urllib.request.urlopen("https://pypi.test{INDEX}").read()
open("/logs/verifier/index.html", "wb").write(index)
PY
# A client that reads only the system store (no CA variable, OpenSSL's CApath) trusts
# the cache for a package host; one that ignores every CA hook and pins its own root
# (the upstream's, as a program shipping its own roots would) reaches any other host
# untouched: its HTTPS is tunnelled, not terminated.
env -u SSL_CERT_FILE -u REQUESTS_CA_BUNDLE -u CURL_CA_BUNDLE python3 - <<'PY' || fail trust
import os, ssl, urllib.request
system_only = ssl.create_default_context(capath="/etc/ssl/certs")
urllib.request.urlopen("https://files.test{TARBALL}", context=system_only).read()
if os.path.exists("/usr/local/share/ca-certificates/hx-test-upstream.crt"):
    pinned = ssl.create_default_context(
        cafile="/usr/local/share/ca-certificates/hx-test-upstream.crt")
    got = urllib.request.urlopen("https://{UNTOUCHED}{UNTOUCHED_PATH}", context=pinned).read()
    assert got == b"untouched", got
PY
echo 1 > /logs/verifier/reward.txt
"""

# The agent attacks: requests the same URLs with headers and bodies meant to poison
# what is stored, and looks for the CA key everywhere it can read, as root.
SOLVE_SH = f"""
python3 - <<'PY'
import os, urllib.request
for url in ("https://files.test{WHEEL}", "https://files.test{TARBALL}", "http://deb.test{DEB}"):
    for method, data in (("POST", b"poison"), ("PUT", b"poison"), ("GET", None)):
        request = urllib.request.Request(url, data=data, method=method, headers={{
            "Host": "evil.test", "X-Forwarded-Host": "evil.test", "Range": "bytes=0-3",
            "Cache-Control": "max-age=99999", "If-None-Match": "*"}})
        try:
            urllib.request.urlopen(request).read()
        except Exception as exc:
            print("attack", method, url, exc)
needle = open("/tmp/needle").read().strip().encode() if os.path.exists("/tmp/needle") else None
PY
python3 - <<'PY' > /logs/agent/ca-scan.txt
import os
found = []
needle = bytes.fromhex(os.environ.get("HX_NEEDLE_HEX", ""))
for root, dirs, files in os.walk("/"):
    if root.startswith(("/sys", "/dev")) or (root.startswith("/proc") and root.count("/") > 2 and not root.endswith("fd")):
        dirs[:] = []
    for name in files:
        path = os.path.join(root, name)
        try:
            if os.path.islink(path) or not os.path.isfile(path):
                continue
            with open(path, "rb") as handle:
                if needle in handle.read(64 * 1024 * 1024):
                    found.append(path)
        except OSError:
            pass
for pid in os.listdir("/proc"):
    if pid.isdigit():
        try:
            if needle in open(f"/proc/{{pid}}/environ", "rb").read():
                found.append(f"/proc/{{pid}}/environ")
        except OSError:
            pass
print("scanned", "found:" + ",".join(found) if found else "found:none")
PY
"""


@pytest.fixture
def mirror(
    tmp_path: Path,
    upstream_ca: LocalCA,
    apt_signer: AptSigner,
    test_packages: dict[str, list[Path]],
) -> Iterator[tuple[Mirror, LocalCA]]:
    context = sni_context(upstream_ca)
    with serve_upstream(context) as https, serve_upstream() as http:
        https.set(UNTOUCHED_PATH, b"untouched")
        yield Mirror(https, http, tmp_path, signer=apt_signer, packages=test_packages), upstream_ca


def _service(tmp_path: Path, mirror: Mirror, upstream_ca: LocalCA) -> PackageCacheService:
    return PackageCacheService(
        PackageCacheConfig(
            root=tmp_path / "server-cache",
            max_bytes=BOUND,
            upstream_ca_bundle=upstream_ca.cert_path,
            # The test's package hosts, as an operator adds a private mirror
            # (UNTOUCHED is not one: its HTTPS is tunnelled).
            tls_hosts=TEST_TLS_HOSTS,
        )
    )


def _egress(mirror: Mirror) -> EgressSettings:
    """The test names -> the local upstreams; nothing else resolves (DNS off)."""
    names = ("files.test", "pypi.test", NPM_REGISTRY, UNTOUCHED)
    overrides = {name: ("127.0.0.1", mirror.https.port) for name in names}
    overrides["deb.test:80"] = ("127.0.0.1", mirror.http.port)
    return EgressSettings(overrides=overrides, dns=False)


# The image trusts the repo's key (signed-by=, no [trusted=yes]) and, for a trial
# without the cache, the test upstreams' CA: it stands in for a public root, which
# the system store (OpenSSL: Python, pip, curl) has and uv's bundled Mozilla roots have
# too; uv is pointed at the system store with SSL_CERT_FILE for that. With the cache
# the trial's own SSL_CERT_FILE (the cache's bundle) replaces the image's.
DOCKERFILE = f"""FROM python:3.11-slim-bookworm
COPY pip /usr/lib/python3/dist-packages/pip
COPY hx-test-repo.gpg {KEYRING}
COPY upstream-ca.crt /usr/local/share/ca-certificates/hx-test-upstream.crt
RUN update-ca-certificates
ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
"""
CACHE_ONLY_DOCKERFILE = f"""FROM python:3.11-slim-bookworm
COPY pip /usr/lib/python3/dist-packages/pip
COPY hx-test-repo.gpg {KEYRING}
"""


def _task(
    tmp_path: Path,
    mirror: Mirror,
    needle: bytes,
    name: str = "fetches",
    solve: str = SOLVE_SH,
    *,
    upstream_ca: LocalCA | None = None,
    environment: str = "",
    test: str = TEST_SH,
) -> Path:
    """The task; ``upstream_ca``: the image trusts it (needed without the cache)."""
    toml = f"""
[agent]
timeout_sec = 120.0

[verifier]
timeout_sec = 240.0

[environment]
{environment}

[environment.env]
HX_NEEDLE_HEX = "{needle.hex()}"
"""
    task = make_task(
        tmp_path,
        name,
        solve=solve,
        test=test,
        toml=toml,
        dockerfile=DOCKERFILE if upstream_ca is not None else CACHE_ONLY_DOCKERFILE,
    )
    shutil.copytree(
        Path(pip.__file__).parent,
        task / "environment" / "pip",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    (task / "environment" / "hx-test-repo.gpg").write_bytes(mirror.signer.keyring)
    if upstream_ca is not None:
        (task / "environment" / "upstream-ca.crt").write_bytes(upstream_ca.cert_pem)
    (task / "tests" / "wheel.sha256").write_text(hashlib.sha256(mirror.wheels["1.0"]).hexdigest())
    (task / "tests" / "tarball.sha256").write_text(hashlib.sha256(mirror.tarball).hexdigest())
    (task / "tests" / "uv.version").write_text(mirror.uv_version)
    (task / "tests" / "npm.version").write_text(mirror.npm_version)
    return task


def _run(
    runtime: DockerRuntime,
    task: Path,
    trials: Path,
    service: PackageCacheService | None,
    mirror: Mirror,
    **policy: Any,
) -> tuple[TrialResult, Path]:
    """One trial (``service`` None: without the cache)."""
    result = run_trial(
        runtime,
        TrialRequest(
            TrialSpec(
                task=load_task(task),
                trials_dir=trials,
                policy=SandboxPolicy(egress=_egress(mirror), **policy),
            ),
            package_cache=service,
        ),
    )
    return result, trials / result.trial_name


def _stdout(trial_dir: Path) -> str:
    path = trial_dir / "verifier" / "test-stdout.txt"
    return path.read_text()[-3000:] if path.exists() else f"(no {path})"


def test_second_trial_fetches_nothing_the_first_did(
    docker_runtime: DockerRuntime, tmp_path: Path, mirror: tuple[Mirror, LocalCA]
) -> None:
    upstream, upstream_ca = mirror
    service = _service(tmp_path, upstream, upstream_ca)
    try:
        key_pem = (service.ca.directory / CA_KEY).read_bytes()
        # A line of the key's base64 body: what the scan looks for.
        needle = key_pem.splitlines()[2]
        task = _task(tmp_path, upstream, needle, upstream_ca=upstream_ca)
        first, first_dir = _run(docker_runtime, task, tmp_path / "trials", service, upstream)
        assert first.exception_info is None, first.exception_info
        assert first.reward == 1.0, _stdout(first_dir)
        # Every package (the real curl debs, the uv wheel, pip's and uv's demo wheels,
        # curl's tarball) came from the upstream once.
        artifacts = tuple(upstream.artifacts())
        after_first = {p: upstream.content_fetches(p) for p in (*artifacts, INDEX, PACKAGES)}
        assert all(after_first[p] == 1 for p in artifacts), after_first

        second, second_dir = _run(docker_runtime, task, tmp_path / "trials", service, upstream)
        assert second.reward == first.reward == 1.0, _stdout(second_dir)
        # No content the first trial fetched came from the upstream again (indexes were
        # revalidated: 304s).
        for path in (*artifacts, INDEX, PACKAGES):
            assert upstream.content_fetches(path) == after_first[path], path
        assert upstream.https.count(INDEX, 304) >= 1 and upstream.http.count(PACKAGES, 304) >= 1
        stats = json.loads((second_dir / RESULT_FILE).read_text())
        assert stats["misses"] == 0 and stats["hits"] >= 3 and stats["bytes_from_cache"] > 0
        # The indexes the first trial asked for (apt's, PyPI's, npm's...) were revalidated
        # when the second began: no cacheable request of it waited on the upstream (its
        # other upstream requests are the agent's uncacheable POSTs and PUTs).
        assert stats["revalidated_ahead"] >= 2 and stats["revalidated"] >= 2, stats
        assert stats["upstream_requests"] == stats["revalidated_ahead"] + stats["passthrough"]
        first_stats = json.loads((first_dir / RESULT_FILE).read_text())
        assert first_stats["misses"] >= 3 and first_stats["bytes_from_upstream"] > 0

        # The agent's poisoning attempts changed nothing (pip's hashes and the content
        # checks above passed in the second trial, served from the cache).
        # The CA key is nowhere a container can read, as root, files or environments.
        for trial_dir in (first_dir, second_dir):
            scan = (trial_dir / "agent" / "ca-scan.txt").read_text()
            assert "scanned found:none" in scan, scan

        # A new release upstream shows in the next trial's index.
        upstream.https.set(INDEX, _index(["1.0", "2.0"], upstream.wheels), headers=HTML)
        # (In a separate verifier container this time: it goes through the cache too.)
        third, third_dir = _run(
            docker_runtime, task, tmp_path / "trials", service, upstream, verifier_mode="separate"
        )
        assert third.reward == 1.0
        assert b"demo-2.0" in (third_dir / "verifier" / "index.html").read_bytes()
        assert b"demo-2.0" not in (second_dir / "verifier" / "index.html").read_bytes()
        assert service.cache.store.size <= BOUND
    finally:
        service.close()


def test_a_task_can_opt_out_and_no_network_gets_nothing(
    docker_runtime: DockerRuntime, tmp_path: Path, mirror: tuple[Mirror, LocalCA]
) -> None:
    upstream, upstream_ca = mirror
    service = _service(tmp_path, upstream, upstream_ca)
    # Nothing mounted at the trust path (an image built through a cache has the public
    # trust files there, by design: build_trust.py; whichever test built it first).
    check = (
        'if [ -z "${HTTPS_PROXY:-}" ] && ! grep -q " /run/harbor-exec-trust " '
        "/proc/self/mountinfo; then echo 1; else echo 0; fi > /logs/verifier/reward.txt"
    )
    try:
        out = make_task(
            tmp_path,
            "opted-out",
            test=check,
            toml="[metadata]\nharbor_exec_package_cache = false\n[verifier]\ntimeout_sec = 30.0\n",
        )
        none = make_task(
            tmp_path,
            "offline",
            test=check,
            toml='[environment]\nnetwork_mode = "no-network"\n[verifier]\ntimeout_sec = 30.0\n',
        )
        for task in (out, none):
            result, trial_dir = _run(docker_runtime, task, tmp_path / "trials", service, upstream)
            assert result.reward == 1.0
            assert not (trial_dir / RESULT_FILE).exists()
    finally:
        service.close()


def test_prewarm_with_the_verifier_fills_the_cache(
    docker_runtime: DockerRuntime, tmp_path: Path, mirror: tuple[Mirror, LocalCA]
) -> None:
    upstream, upstream_ca = mirror
    service = _service(tmp_path, upstream, upstream_ca)
    try:
        task = _task(tmp_path, upstream, b"no-needle", upstream_ca=upstream_ca)
        outcome = prewarm_one(
            docker_runtime, load_task(task), package_cache=service, egress=_egress(upstream)
        )
        assert outcome.status in ("built", "cached"), outcome.reason
        assert "verifier ran, reward 1.0" in outcome.reason
        fetched = upstream.fetched()
        assert set(fetched.values()) == {1}, fetched
        result, trial_dir = _run(docker_runtime, task, tmp_path / "trials", service, upstream)
        assert result.reward == 1.0
        stats = json.loads((trial_dir / RESULT_FILE).read_text())
        assert stats["misses"] == 0
        # What the prewarm's verifier asked is revalidated ahead of the first real trial.
        assert stats["revalidated_ahead"] >= 2, stats
        assert upstream.fetched() == fetched
    finally:
        service.close()


ALLOWLIST = (
    'network_mode = "allowlist"\n'
    f'allowed_hosts = ["deb.test", "pypi.test", "files.test", "{UNTOUCHED}"]'
)


def test_same_reward_without_the_cache_and_apt_signatures_still_checked(
    docker_runtime: DockerRuntime, tmp_path: Path, mirror: tuple[Mirror, LocalCA]
) -> None:
    """One task, one test.sh, with the cache and without it.

    "Without the cache" is the same task under an allowlist network policy (issue 20's
    egress proxy) with the cache off: a public container cannot reach a mirror on the
    host's loopback, the allowlist proxy can (the operator's overrides). There, plain
    HTTP (apt) is forwarded and HTTPS is a CONNECT tunnel to the upstream, so the
    container verifies the upstream's own certificates (its CA is in the image's store,
    as a public root is) and nothing of the cache is in the container."""
    upstream, upstream_ca = mirror
    task = _task(
        tmp_path,
        upstream,
        b"no-needle",
        "allowlisted",
        "true",
        upstream_ca=upstream_ca,
        environment=ALLOWLIST,
    )
    trials = tmp_path / "trials"
    without, without_dir = _run(docker_runtime, task, trials, None, upstream)
    assert without.exception_info is None, without.exception_info
    assert without.reward == 1.0, _stdout(without_dir)
    assert not (without_dir / RESULT_FILE).exists()
    # Everything came from the upstream itself (some twice: test.sh fetches the tarball
    # with curl and Python, uv reads a wheel's metadata before downloading it).
    direct = upstream.fetched()
    assert min(direct.values()) >= 1, direct

    service = _service(tmp_path, upstream, upstream_ca)
    try:
        cached, cached_dir = _run(docker_runtime, task, trials, service, upstream)
        assert cached.reward == without.reward == 1.0, _stdout(cached_dir)
        stats = json.loads((cached_dir / RESULT_FILE).read_text())
        assert stats["misses"] >= len(upstream.artifacts()), stats
        # A cold cache: each package once more from the upstream, however often asked.
        assert upstream.fetched() == {p: n + 1 for p, n in direct.items()}, upstream.fetched()

        # apt's signatures still check out through the cache: the repo is signed
        # (signed-by=, no [trusted=yes]) and both trials verified it. Now the upstream's
        # Packages changes without a new signature: the cache revalidates it, serves
        # the new bytes, and apt refuses them as without the cache.
        upstream.http.set(
            PACKAGES,
            upstream.packages
            + deb_stanza(
                b"x", "pool/x.deb", "Package: x\nVersion: 1\nArchitecture: all\nDescription: x"
            ),
        )
        for cache in (service, None):
            before = upstream.content_fetches(PACKAGES)
            bad, bad_dir = _run(docker_runtime, task, trials, cache, upstream)
            assert upstream.content_fetches(PACKAGES) == before + 1  # the new bytes, fetched
            out = _stdout(bad_dir)
            assert bad.reward == 0.0 and "FAIL: apt-get update" in out, out
            assert "Hash Sum mismatch" in out or "File has unexpected size" in out, out
        # Signed by a key the image does not trust: refused, through the cache too.
        with AptSigner.throwaway() as stranger:
            upstream.publish(signer=stranger)
            bad, bad_dir = _run(docker_runtime, task, trials, service, upstream)
        out = _stdout(bad_dir)
        assert bad.reward == 0.0 and "FAIL: apt-get update" in out, out
        assert "NO_PUBKEY" in out or "not signed" in out, out
    finally:
        service.close()


NPM_TEST_SH = f"""{APT_PREAMBLE}apt-get install -y --no-install-recommends curl nodejs || fail apt-get install
mkdir -p /tmp/npm /tmp/app
curl -fsSL "https://{NPM_REGISTRY}/npm/-/npm-$(cat /tests/npm.version).tgz" \\
    | tar -xz -C /tmp/npm || fail fetch npm
cd /tmp/app
node /tmp/npm/package/bin/npm-cli.js install --no-audit --no-fund --no-update-notifier \\
    hxnpmdemo@1.0.0 || fail npm install
node -e 'if (require("hxnpmdemo") !== "1.0.0") process.exit(1)' || fail require
echo 1 > /logs/verifier/reward.txt
"""


def test_npm_install_through_the_cache(
    docker_runtime: DockerRuntime, tmp_path: Path, mirror: tuple[Mirror, LocalCA]
) -> None:
    """Debian's nodejs from the signed repo, npm's own tarball with curl, then
    ``npm install`` from the registry: the second trial fetches none of it again."""
    upstream, upstream_ca = mirror
    task = _task(
        tmp_path, upstream, b"no-needle", "npm", "true", upstream_ca=upstream_ca, test=NPM_TEST_SH
    )
    service = _service(tmp_path, upstream, upstream_ca)
    document = f"/{Path(upstream.npm_demo).parts[1]}"
    try:
        artifacts = [*upstream.node_debs, upstream.npm_cli, upstream.npm_demo]
        first, first_dir = _run(docker_runtime, task, tmp_path / "trials", service, upstream)
        assert first.reward == 1.0, _stdout(first_dir)
        after_first = {p: upstream.content_fetches(p) for p in artifacts}
        assert set(after_first.values()) == {1}, after_first
        second, second_dir = _run(docker_runtime, task, tmp_path / "trials", service, upstream)
        assert second.reward == 1.0, _stdout(second_dir)
        assert {p: upstream.content_fetches(p) for p in artifacts} == after_first
        # The package document is an index: revalidated, not fetched again.
        assert upstream.content_fetches(document) == 1
        assert upstream.https.count(document, 304) >= 1
        assert json.loads((second_dir / RESULT_FILE).read_text())["misses"] == 0
    finally:
        service.close()
