"""The seccomp profile's derivation and the runtime's content, without an engine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from harbor_exec.sandbox.runtime_build import runtime_build_dir
from harbor_exec.sandbox.runtime_volume import (
    INIT_COMMAND,
    KEEP_ALIVE_COMMAND,
    KEEP_ALIVE_UID,
    KEEP_ALIVE_USER,
    RUNTIME_MOUNT,
    RuntimeContent,
    RuntimeVolumeError,
)
from harbor_exec.sandbox.seccomp import (
    DENIED_SYSCALLS,
    SeccompProfileError,
    SeccompProfiles,
    derive_profile,
    requested_syscalls,
)

# The shapes Docker's default profile uses: a big allow list, a kernel-gated ptrace
# rule, a capability-gated rule, a deny rule and an arch map.
SAMPLE: dict[str, Any] = {
    "defaultAction": "SCMP_ACT_ERRNO",
    "archMap": [{"architecture": "SCMP_ARCH_X86_64", "subArchitectures": ["SCMP_ARCH_X86"]}],
    "syscalls": [
        {"names": ["read", "write", "process_vm_readv"], "action": "SCMP_ACT_ALLOW"},
        {"names": ["ptrace"], "action": "SCMP_ACT_ALLOW", "includes": {"minKernel": "4.8"}},
        {
            "names": ["ptrace", "process_vm_writev", "kcmp"],
            "action": "SCMP_ACT_ALLOW",
            "includes": {"caps": ["CAP_SYS_PTRACE"]},
        },
        {"names": ["ptrace"], "action": "SCMP_ACT_ERRNO", "errnoRet": 1},
    ],
}


def _allowed(profile: dict[str, Any]) -> set[str]:
    return {
        name
        for rule in profile["syscalls"]
        if rule["action"] == "SCMP_ACT_ALLOW"
        for name in rule["names"]
    }


def test_the_derived_profile_allows_none_of_the_denied_syscalls() -> None:
    derived = derive_profile(SAMPLE, DENIED_SYSCALLS)
    assert _allowed(derived) == {"read", "write", "kcmp"}
    # The emptied ptrace rule is gone; everything else is kept as it was.
    assert derived["syscalls"] == [
        {"names": ["read", "write"], "action": "SCMP_ACT_ALLOW"},
        {"names": ["kcmp"], "action": "SCMP_ACT_ALLOW", "includes": {"caps": ["CAP_SYS_PTRACE"]}},
        SAMPLE["syscalls"][3],
    ]
    assert derived["defaultAction"] == SAMPLE["defaultAction"]
    assert derived["archMap"] == SAMPLE["archMap"]
    assert "ptrace" in SAMPLE["syscalls"][1]["names"]  # the source is not modified


def test_a_task_asks_for_denied_syscalls_back_by_label() -> None:
    assert requested_syscalls(" PTRACE, process_vm_readv ,mount") == ("ptrace", "process_vm_readv")
    assert requested_syscalls(None) == ()


def _profile_of(security_opt: str) -> dict[str, Any]:
    assert security_opt.startswith("seccomp=")
    return dict(json.loads(security_opt.removeprefix("seccomp=")))


def test_profiles_are_derived_from_the_named_file_and_cached(tmp_path: Path) -> None:
    source = tmp_path / "profile.json"
    source.write_text(json.dumps(SAMPLE))
    profiles = SeccompProfiles(source)
    denied = _profile_of(profiles.security_opt())
    assert "ptrace" not in _allowed(denied)
    assert profiles.security_opt() == profiles.security_opt()
    given_back = _profile_of(profiles.security_opt(["ptrace", "mount"]))
    assert _allowed(given_back) == {"read", "write", "kcmp", "ptrace"}
    # A changed file (another digest) is derived again.
    source.write_text(json.dumps({**SAMPLE, "syscalls": SAMPLE["syscalls"][:1]}))
    assert _allowed(_profile_of(profiles.security_opt())) == {"read", "write"}


def test_profiles_come_from_the_environment_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = tmp_path / "mine.json"
    source.write_text(json.dumps(SAMPLE))
    monkeypatch.setenv("HARBOR_EXEC_SECCOMP_PROFILE", str(source))
    assert SeccompProfiles().source == source


def test_a_missing_or_broken_profile_fails_closed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HARBOR_EXEC_SECCOMP_PROFILE", raising=False)
    default = SeccompProfiles()
    monkeypatch.setattr(default, "source", tmp_path / "absent.json")
    with pytest.raises(SeccompProfileError, match="golang-github-docker-docker-dev") as caught:
        default.security_opt()
    assert "HARBOR_EXEC_SECCOMP_PROFILE" in str(caught.value)
    with pytest.raises(SeccompProfileError, match=r"\$HARBOR_EXEC_SECCOMP_PROFILE"):
        SeccompProfiles(tmp_path / "absent.json").security_opt()
    broken = tmp_path / "broken.json"
    broken.write_text('{"syscalls": []}')
    with pytest.raises(SeccompProfileError, match="not a Docker profile"):
        SeccompProfiles(broken).security_opt()


def test_the_runtime_comes_from_the_build_and_init_and_keep_alive_are_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import harbor_exec.sandbox.runtime_volume as runtime_volume
    from harbor_exec.sandbox.runtime_build import RuntimeBuildError, load_runtime_build

    asked: list[Path | None] = []

    def cannot_build(mirror: str, *, cache_dir: Path | None = None, **_: object) -> object:
        asked.append(cache_dir)
        raise RuntimeBuildError("building the container runtime with debootstrap needs root")

    # None built: the first need builds it; a build that cannot run says how to.
    monkeypatch.setattr(runtime_volume, "build_runtime", cannot_build)
    monkeypatch.setenv("HARBOR_EXEC_DEBIAN_MIRROR", "http://deb.test/debian")
    with pytest.raises(RuntimeVolumeError, match=r"needs root.*images bootstrap"):
        RuntimeContent.load(tmp_path)
    assert asked == [tmp_path]

    def builds(mirror: str, *, cache_dir: Path | None = None, **_: object) -> object:
        asked.append(cache_dir)
        built = runtime_build_dir(cache_dir)
        built.mkdir(parents=True)
        (built / "runtime.tar").write_bytes(b"")
        (built / "runtime.json").write_text('{"digest": "' + "ab" * 32 + '"}')
        return load_runtime_build(cache_dir)

    monkeypatch.setattr(runtime_volume, "build_runtime", builds)
    content = RuntimeContent.load(tmp_path)
    assert asked == [tmp_path, tmp_path]
    assert RuntimeContent.load(tmp_path) == content and len(asked) == 2  # built once
    assert content.volume_name == "harbor-exec-runtime-" + "ab" * 8
    assert content.marker_size == len('{"digest": "' + "ab" * 32 + '"}')
    # By absolute path into the read-only mount: no PATH lookup, no image entrypoint.
    assert INIT_COMMAND[0] == f"{RUNTIME_MOUNT}/bin/setpriv"
    assert f"--reuid={KEEP_ALIVE_UID}" in INIT_COMMAND
    assert INIT_COMMAND[-2:] == (f"{RUNTIME_MOUNT}/bin/tini", "--")
    assert KEEP_ALIVE_COMMAND[0] == f"{RUNTIME_MOUNT}/bin/busybox"
    assert f"{KEEP_ALIVE_UID}:{KEEP_ALIVE_UID}" == KEEP_ALIVE_USER and KEEP_ALIVE_UID > 65535
