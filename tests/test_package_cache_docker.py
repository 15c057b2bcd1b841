"""The package cache with a real Docker engine: trials whose tests run apt-get, pip and
an HTTPS download through the cache, against local upstreams on 127.0.0.1 standing in
for a Debian mirror, a package index and a file host (nothing leaves loopback: the
egress proxies resolve only the test names, DNS off)."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import shutil
import subprocess
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pip
import pytest

from harbor_exec.jobs.prewarm import prewarm_one
from harbor_exec.sandbox.docker import DockerRuntime
from harbor_exec.sandbox.egress.ca import CA_KEY, LocalCA
from harbor_exec.sandbox.egress.service import PackageCacheConfig, PackageCacheService
from harbor_exec.trial.egress import EgressSettings
from harbor_exec.trial.package_cache import RESULT_FILE
from harbor_exec.trial.results import TrialResult
from harbor_exec.trial.task import load_task
from harbor_exec.trial.trial import SandboxPolicy, TrialRequest, run_trial
from tests.package_upstream import Upstream, serve_upstream, sni_context
from tests.task_factory import make_task

pytestmark = [pytest.mark.docker, pytest.mark.usefixtures("base_images")]

WHEEL = "/packages/demo-1.0-py3-none-any.whl"
INDEX = "/simple/demo/"
TARBALL = "/releases/tool-1.0.tar.gz"
DEB = "/debian/pool/main/h/hxdemo/hxdemo_1.0_all.deb"
PACKAGES = "/debian/dists/stable/main/binary-all/Packages"
RELEASE = "/debian/dists/stable/Release"
BOUND = 64 * 1024 * 1024
HTML = {"Content-Type": "text/html"}


def _wheel(version: str) -> bytes:
    out = io.BytesIO()
    name = f"demo-{version}"
    files = {
        "demo/__init__.py": f"VALUE = {version!r}\n".encode(),
        f"{name}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: demo\nVersion: {version}\n".encode(),
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
    links = "".join(
        f'<a href="https://files.test/packages/demo-{v}-py3-none-any.whl#sha256='
        f'{hashlib.sha256(wheels[v]).hexdigest()}">demo-{v}-py3-none-any.whl</a>\n'
        for v in versions
    )
    return f"<html><body>\n{links}</body></html>\n".encode()


class Mirror:
    def __init__(self, https: Upstream, http: Upstream, tmp: Path, deb_padding: int = 0) -> None:
        self.https, self.http = https, http
        self.wheels = {"1.0": _wheel("1.0"), "2.0": _wheel("2.0")}
        https.set(WHEEL, self.wheels["1.0"])
        https.set("/packages/demo-2.0-py3-none-any.whl", self.wheels["2.0"])
        https.set(INDEX, _index(["1.0"], self.wheels), headers=HTML)
        self.tarball = b"tool-1.0 release\n" * 4096
        https.set(TARBALL, self.tarball, headers={"Cache-Control": "max-age=3600"})
        deb = _deb(tmp, deb_padding)
        http.set(DEB, deb)
        md5 = hashlib.md5(deb).hexdigest()
        sha = hashlib.sha256(deb).hexdigest()
        packages = (
            "Package: hxdemo\nVersion: 1.0\nArchitecture: all\nMaintainer: t <t@t>\n"
            f"Filename: pool/main/h/hxdemo/hxdemo_1.0_all.deb\nSize: {len(deb)}\n"
            f"MD5sum: {md5}\nSHA256: {sha}\nDescription: test package\n\n"
        ).encode()
        http.set(PACKAGES, packages)
        release = (
            "Origin: test\nLabel: test\nSuite: stable\nCodename: stable\n"
            "Architectures: all amd64 arm64\nComponents: main\nSHA256:\n"
            f" {hashlib.sha256(packages).hexdigest()} {len(packages)} main/binary-all/Packages\n"
        ).encode()
        http.set(RELEASE, release)

    def content_fetches(self, path: str) -> int:
        upstream = self.http if path.startswith("/debian") else self.https
        return upstream.count(path, 200, "GET")


TEST_SH = f"""
set -eu
fail() {{ echo "FAIL: $*"; echo 0 > /logs/verifier/reward.txt; exit 0; }}
rm -f /etc/apt/sources.list /etc/apt/sources.list.d/*
echo 'deb [trusted=yes] http://deb.test/debian stable main' > /etc/apt/sources.list.d/test.list
apt-get update -o Acquire::Languages=none || fail apt-get update
apt-get install -y --no-install-recommends hxdemo || fail apt-get install
grep -q 'from the mirror' /usr/share/hxdemo/ok || fail deb content
echo "demo==1.0 --hash=sha256:$(cat /tests/wheel.sha256)" > /tmp/req.txt
python3 -m pip install --no-cache-dir --disable-pip-version-check --target /tmp/site \\
    --require-hashes --index-url https://pypi.test/simple/ -r /tmp/req.txt || fail pip
PYTHONPATH=/tmp/site python3 -c "import demo; assert demo.VALUE == '1.0'" || fail import
python3 - <<'PY' || fail https download
import hashlib, urllib.request
data = urllib.request.urlopen("https://files.test{TARBALL}").read()
assert hashlib.sha256(data).hexdigest() == open("/tests/tarball.sha256").read().strip()
index = urllib.request.urlopen("https://pypi.test{INDEX}").read()
open("/logs/verifier/index.html", "wb").write(index)
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
def mirror(tmp_path: Path) -> Iterator[tuple[Mirror, LocalCA]]:
    upstream_ca = LocalCA(tmp_path / "public-ca")
    context = sni_context(upstream_ca)
    with serve_upstream(context) as https, serve_upstream() as http:
        yield Mirror(https, http, tmp_path), upstream_ca


def _service(tmp_path: Path, mirror: Mirror, upstream_ca: LocalCA) -> PackageCacheService:
    return PackageCacheService(
        PackageCacheConfig(
            root=tmp_path / "server-cache",
            max_bytes=BOUND,
            upstream_ca_bundle=upstream_ca.cert_path,
        )
    )


def _egress(mirror: Mirror) -> EgressSettings:
    """The test names -> the local upstreams; nothing else resolves (DNS off)."""
    overrides = {name: ("127.0.0.1", mirror.https.port) for name in ("files.test", "pypi.test")}
    overrides["deb.test:80"] = ("127.0.0.1", mirror.http.port)
    return EgressSettings(overrides=overrides, dns=False)


def _task(
    tmp_path: Path, mirror: Mirror, needle: bytes, name: str = "fetches", solve: str = SOLVE_SH
) -> Path:
    toml = f"""
[agent]
timeout_sec = 120.0

[verifier]
timeout_sec = 240.0

[environment.env]
HX_NEEDLE_HEX = "{needle.hex()}"
"""
    task = make_task(
        tmp_path,
        name,
        solve=solve,
        test=TEST_SH,
        toml=toml,
        dockerfile="FROM python:3.11-slim-bookworm\nCOPY pip /usr/lib/python3/dist-packages/pip\n",
    )
    shutil.copytree(
        Path(pip.__file__).parent,
        task / "environment" / "pip",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    (task / "tests" / "wheel.sha256").write_text(hashlib.sha256(mirror.wheels["1.0"]).hexdigest())
    (task / "tests" / "tarball.sha256").write_text(hashlib.sha256(mirror.tarball).hexdigest())
    return task


def _run(
    runtime: DockerRuntime,
    task: Path,
    trials: Path,
    service: PackageCacheService,
    mirror: Mirror,
    **policy: Any,
) -> tuple[TrialResult, Path]:
    result = run_trial(
        runtime,
        TrialRequest(
            task=load_task(task),
            trials_dir=trials,
            policy=SandboxPolicy(package_cache=service, egress=_egress(mirror), **policy),
        ),
    )
    return result, trials / result.trial_name


def test_second_trial_fetches_nothing_the_first_did(
    docker_runtime: DockerRuntime, tmp_path: Path, mirror: tuple[Mirror, LocalCA]
) -> None:
    upstream, upstream_ca = mirror
    service = _service(tmp_path, upstream, upstream_ca)
    try:
        key_pem = (service.ca.directory / CA_KEY).read_bytes()
        # A line of the key's base64 body: what the scan looks for.
        needle = key_pem.splitlines()[2]
        task = _task(tmp_path, upstream, needle)
        first, first_dir = _run(docker_runtime, task, tmp_path / "trials", service, upstream)
        assert first.exception_info is None, first.exception_info
        assert first.reward == 1.0, (first_dir / "verifier" / "test-stdout.txt").read_text()[-3000:]
        artifacts = (WHEEL, TARBALL, DEB)
        after_first = {p: upstream.content_fetches(p) for p in (*artifacts, INDEX, PACKAGES)}
        assert all(after_first[p] == 1 for p in artifacts), after_first

        second, second_dir = _run(docker_runtime, task, tmp_path / "trials", service, upstream)
        assert second.reward == first.reward == 1.0
        # No content the first trial fetched came from the upstream again (indexes were
        # revalidated: 304s).
        for path in (*artifacts, INDEX, PACKAGES):
            assert upstream.content_fetches(path) == after_first[path], path
        assert upstream.https.count(INDEX, 304) >= 1 and upstream.http.count(PACKAGES, 304) >= 1
        stats = json.loads((second_dir / RESULT_FILE).read_text())
        assert stats["misses"] == 0 and stats["hits"] >= 3 and stats["bytes_from_cache"] > 0
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
    check = (
        'if [ -z "${HTTPS_PROXY:-}" ] && [ ! -e /run/harbor-exec-trust ]; then echo 1; '
        "else echo 0; fi > /logs/verifier/reward.txt"
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
        task = _task(tmp_path, upstream, b"no-needle")
        outcome = prewarm_one(
            docker_runtime, load_task(task), package_cache=service, egress=_egress(upstream)
        )
        assert outcome.status in ("built", "cached"), outcome.reason
        assert "verifier ran, reward 1.0" in outcome.reason
        fetched = {p: upstream.content_fetches(p) for p in (WHEEL, TARBALL, DEB)}
        assert set(fetched.values()) == {1}, fetched
        result, trial_dir = _run(docker_runtime, task, tmp_path / "trials", service, upstream)
        assert result.reward == 1.0
        assert json.loads((trial_dir / RESULT_FILE).read_text())["misses"] == 0
        assert {p: upstream.content_fetches(p) for p in (WHEEL, TARBALL, DEB)} == fetched
    finally:
        service.close()
