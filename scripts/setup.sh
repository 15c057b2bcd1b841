#!/usr/bin/env bash
# Set up harbor-exec on this machine and validate the example dataset.
#
#   ./scripts/setup.sh [--no-validate]
#
# Idempotent. On a bare Debian 12/13 machine (as root) it:
#   1. installs Docker (Debian's docker.io), debootstrap and docker-compose when
#      `docker info` fails, starts dockerd in the background and waits for it;
#      the Docker Compose v2 CLI plugin (`docker compose`, from Debian's
#      docker-compose 2.x package) when `docker compose version` fails;
#      busybox-static and Docker's default seccomp profile (from Debian's
#      golang-github-docker-docker-dev) for the trial containers' sandbox;
#   2. creates .venv (Python 3.12 when available, else python3 >= 3.11) with
#      harbor-exec and its development extras, and .venv-harbor with the real
#      Harbor 0.26 (used by the tests to check that our examples are valid tasks);
#   3. makes the base images and the read-only container runtime
#      (`harbor-exec images bootstrap`);
#   4. installs Debian's chromium and chromium-driver (the console's browser test drives
#      them with selenium, from the dev extra);
#   5. fetches the files the package cache's engine test serves from its local upstreams
#      into .cache/test-packages/ (Debian bookworm's curl and nodejs with the libraries
#      the test image lacks, the uv wheel, npm's tarball) and installs gnupg (the test
#      signs its Debian repo);
#   6. runs `harbor-exec validate tasks_examples/dataset`.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$(pwd)"
DOCKERD_LOG="${HARBOR_EXEC_DOCKERD_LOG:-/var/log/harbor-exec-dockerd.log}"
VALIDATE=1
for arg in "$@"; do
  case "$arg" in
    --no-validate) VALIDATE=0 ;;
    -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
    *) echo "setup.sh: unknown option $arg" >&2; exit 2 ;;
  esac
done

say() { printf '\033[1m==> %s\033[0m\n' "$*"; }
die() { printf 'setup.sh: error: %s\n' "$*" >&2; exit 1; }

apt_update_once() {
  [ "$(id -u)" = 0 ] || die "installing $* needs root (run as root, or install them yourself)"
  command -v apt-get >/dev/null || die "no apt-get here: install $* with your package manager"
  if [ -z "${_APT_UPDATED:-}" ]; then
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    _APT_UPDATED=1
  fi
}

apt_install() {
  apt_update_once "$@"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

ensure_docker() {
  if docker info >/dev/null 2>&1; then
    say "Docker engine is running"
  else
    if ! command -v dockerd >/dev/null; then
      say "installing Docker (docker.io)"
      apt_install docker.io
    fi
    [ "$(id -u)" = 0 ] || die "dockerd is not running and starting it needs root"
    say "starting dockerd (log: $DOCKERD_LOG)"
    nohup dockerd >"$DOCKERD_LOG" 2>&1 &
    for _ in $(seq 1 60); do
      docker info >/dev/null 2>&1 && break
      sleep 1
    done
    docker info >/dev/null 2>&1 || die "dockerd did not answer within 60 s; see $DOCKERD_LOG"
    say "Docker engine is running"
  fi
  local missing=()
  command -v debootstrap >/dev/null || missing+=(debootstrap)
  # The read-only container runtime (harbor_exec/sandbox/runtime_build.py) is patched with it.
  command -v patchelf >/dev/null || missing+=(patchelf)
  # tests/test_service_image.py drives Compose through pytest-docker as docker-compose.
  command -v docker-compose >/dev/null || missing+=(docker-compose)
  if [ "${#missing[@]}" -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      say "installing ${missing[*]}"
      apt_install "${missing[@]}"
    else
      echo "note: ${missing[*]} missing; base image bootstrap / service-image tests need them" >&2
    fi
  fi
}

# `docker compose` (v2: Harbor's own docker environment runs it, bench/ compares against it).
# Debian 13's docker-compose package is that CLI plugin; Debian 12's is Compose v1 in Python
# (kept: tests drive it as docker-compose). There the plugin, a static Go binary needing only
# libc6 >= 2.34, is taken from Debian 13's package without installing it, through a private
# apt state so the machine's sources stay as they are.
COMPOSE_PLUGIN_DIR=/usr/local/lib/docker/cli-plugins
COMPOSE_SUITE="${HARBOR_EXEC_COMPOSE_SUITE:-trixie}"
ensure_compose_v2() {
  if docker compose version >/dev/null 2>&1; then
    say "$(docker compose version)"
    return 0
  fi
  apt_update_once docker-compose
  local candidate
  candidate="$(apt-cache policy docker-compose | sed -n 's/^ *Candidate: *//p')"
  if [ "${candidate%%.*}" = 2 ]; then
    say "installing Docker Compose v2 (docker-compose $candidate)"
    apt_install docker-compose
  else
    say "installing the Docker Compose v2 plugin from Debian $COMPOSE_SUITE's docker-compose"
    local tmp apt_opts codename mirror
    # The Debian mirror this machine's own release comes from, for the other suite.
    codename="$(. /etc/os-release && echo "${VERSION_CODENAME:-}")"
    mirror="$(apt-get indextargets --format '$(REPO_URI) $(RELEASE)' 'Created-By: Packages' \
      | awk -v c="$codename" '$2 == c { print $1; exit }')"
    [ -n "$mirror" ] || die "no apt source for Debian $codename to fetch docker-compose v2 from"
    tmp="$(mktemp -d)"
    chmod 755 "$tmp"  # apt downloads as _apt
    mkdir -p "$tmp/lists/partial"
    printf 'Types: deb\nURIs: %s\nSuites: %s\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
      "$mirror" "$COMPOSE_SUITE" >"$tmp/compose.sources"
    apt_opts=(-o "Dir::Etc::SourceList=$tmp/compose.sources" -o Dir::Etc::SourceParts=/dev/null
      -o "Dir::State::Lists=$tmp/lists" -o Dir::Cache::pkgcache= -o Dir::Cache::srcpkgcache=)
    apt-get "${apt_opts[@]}" update -qq \
      || die "cannot read Debian $COMPOSE_SUITE's package list (for docker-compose v2)"
    (cd "$tmp" && apt-get "${apt_opts[@]}" download -qq docker-compose 2>/dev/null) \
      || die "cannot download docker-compose from Debian $COMPOSE_SUITE"
    dpkg-deb --fsys-tarfile "$tmp"/docker-compose_*.deb \
      | tar -x -C "$tmp" ./usr/libexec/docker/cli-plugins/docker-compose
    install -D -m 0755 "$tmp/usr/libexec/docker/cli-plugins/docker-compose" \
      "$COMPOSE_PLUGIN_DIR/docker-compose"
    rm -rf "$tmp"
  fi
  docker compose version >/dev/null 2>&1 || die "docker compose version fails after installing Compose v2"
  say "$(docker compose version)"
}

# Trial containers run under Docker's default seccomp profile without ptrace, derived at
# run time from Debian's copy of it (harbor_exec/sandbox/seccomp.py). The tests build a
# musl image from a static busybox and Debian's musl loader (tests/test_runtime_images.py),
# and one with a static bash too (tests/test_native_opencode_docker.py).
PROFILE_IN_PACKAGE=/usr/share/gocode/src/github.com/docker/docker/profiles/seccomp/default.json
SECCOMP_PROFILE="$PROFILE_IN_PACKAGE"
ensure_sandbox_sources() {
  if [ ! -x /bin/busybox ] || ! /bin/busybox true 2>/dev/null; then
    say "installing busybox-static (for the tests' musl image)"
    apt_install busybox-static
  fi
  if [ ! -f /usr/lib/x86_64-linux-musl/libc.so ]; then
    say "installing musl (for the tests' musl image)"
    apt_install musl
  fi
  if [ ! -x /bin/bash-static ]; then
    say "installing bash-static (for the tests' musl image with bash: tests/test_native_opencode_docker.py)"
    apt_install bash-static
  fi
  [ -f "$SECCOMP_PROFILE" ] && return 0
  if [ -n "${HARBOR_EXEC_SECCOMP_PROFILE:-}" ]; then
    [ -f "$HARBOR_EXEC_SECCOMP_PROFILE" ] || die "HARBOR_EXEC_SECCOMP_PROFILE=$HARBOR_EXEC_SECCOMP_PROFILE is no file"
    return 0
  fi
  say "installing Docker's default seccomp profile (golang-github-docker-docker-dev)"
  # The package drags ~250 Go source packages (~900 MB) in as dependencies; only this
  # one file of it is needed, so it is taken from the package without installing it.
  apt_update_once golang-github-docker-docker-dev
  local tmp
  tmp="$(mktemp -d)"
  chmod 755 "$tmp"  # apt downloads as _apt
  (cd "$tmp" && apt-get download -qq golang-github-docker-docker-dev) \
    || die "cannot download golang-github-docker-docker-dev (set HARBOR_EXEC_SECCOMP_PROFILE to a profile)"
  dpkg-deb --fsys-tarfile "$tmp"/golang-github-docker-docker-dev_*.deb \
    | tar -x -C "$tmp" ".$PROFILE_IN_PACKAGE"
  install -D -m 0644 "$tmp$PROFILE_IN_PACKAGE" "$SECCOMP_PROFILE"
  rm -rf "$tmp"
}

# tests/test_console_browser_docker.py opens the console in headless Chromium through its
# driver (Debian's packages; the test fails under CI without them).
ensure_browser() {
  local missing=()
  command -v chromium >/dev/null || missing+=(chromium)
  command -v chromedriver >/dev/null || missing+=(chromium-driver)
  if [ "${#missing[@]}" -eq 0 ]; then
    say "chromium and chromedriver present"
    return 0
  fi
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "installing ${missing[*]} (the console's browser test)"
    apt_install "${missing[@]}"
  else
    echo "note: ${missing[*]} missing; the console's browser test needs them" >&2
  fi
}

pick_python() {
  if PYENV_VERSION=3.12.1 python3.12 -V >/dev/null 2>&1; then
    echo "env PYENV_VERSION=3.12.1 python3.12"
  elif command -v python3.12 >/dev/null; then
    echo python3.12
  elif python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo python3
  else
    die "harbor-exec needs Python >= 3.11 (3.12 for the full test suite)"
  fi
}

ensure_venvs() {
  local python
  python="$(pick_python)"
  if [ ! -x .venv/bin/python ]; then
    say "creating .venv with $($python -V)"
    $python -m venv .venv
  fi
  say "installing harbor-exec[dev] into .venv"
  .venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v -i warning || true
  .venv/bin/python -m pip install -q -e ".[dev]" 2>&1 | grep -v -i warning || true
  .venv/bin/python -c "import harbor_exec, fastapi, docker" || die "installing harbor-exec failed"
  if ! .venv-harbor/bin/python -c "import harbor.models.task.task" >/dev/null 2>&1; then
    say "creating .venv-harbor with harbor==0.26.0 (the reference implementation, for tests)"
    $python -m venv .venv-harbor
    .venv-harbor/bin/python -m pip install -q "harbor==0.26.0" 2>&1 | grep -v -i warning || true
    .venv-harbor/bin/python -c "import harbor.models.task.task" || die "installing harbor failed"
  fi
}

# tests/test_package_cache_docker.py serves real packages from its local upstreams, so
# the trial's test.sh runs `apt-get install curl` and `pip install uv` as real tasks do:
# Debian bookworm's curl and nodejs with the libraries python:3.11-slim-bookworm lacks (from
# the mirror the base images come from, through a private apt state so the machine's
# sources stay as they are), uv's manylinux wheel and npm's tarball, pinned. The test
# fails under CI when they are missing (tests/setup_files.py).
TEST_PACKAGES_DIR="$ROOT/.cache/test-packages"
TEST_UV_VERSION=0.13.8
TEST_NPM_VERSION=10.9.9
ensure_test_packages() {
  command -v gpg >/dev/null || { say "installing gnupg (the package cache test signs its Debian repo)"; apt_install gnupg; }
  local stamp="$TEST_PACKAGES_DIR/complete" want
  want="uv=$TEST_UV_VERSION npm=$TEST_NPM_VERSION debs=curl,nodejs"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    say "test packages present ($TEST_PACKAGES_DIR)"
    return 0
  fi
  say "fetching the package cache test's packages into $TEST_PACKAGES_DIR"
  rm -rf "$TEST_PACKAGES_DIR"
  mkdir -p "$TEST_PACKAGES_DIR/debian" "$TEST_PACKAGES_DIR/debian-node" \
    "$TEST_PACKAGES_DIR/pypi" "$TEST_PACKAGES_DIR/npm"
  local mirror tmp apt_opts curl_set node_set
  mirror="${HARBOR_EXEC_DEBIAN_MIRROR:-$(.venv/bin/python -c \
    'from harbor_exec.sandbox.images import debian_mirror; print(debian_mirror()[0])')}"
  tmp="$(mktemp -d)"
  chmod 755 "$tmp"
  mkdir -p "$tmp/lists/partial"
  printf 'Types: deb\nURIs: %s\nSuites: bookworm\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
    "$mirror" >"$tmp/test.sources"
  apt_opts=(-o "Dir::Etc::SourceList=$tmp/test.sources" -o Dir::Etc::SourceParts=/dev/null
    -o "Dir::State::Lists=$tmp/lists" -o Dir::Cache::pkgcache= -o Dir::Cache::srcpkgcache=
    -o APT::Architecture=amd64 -o APT::Architectures=amd64 -o APT::Sandbox::User=root)
  apt-get "${apt_opts[@]}" update -qq || die "cannot read Debian bookworm's package list from $mirror"
  # Exactly what apt in the test image installs (simulated against the image's dpkg
  # status): what the image has already is not served.
  docker run --rm --network none python:3.11-slim-bookworm cat /var/lib/dpkg/status \
    >"$tmp/status" || die "cannot read python:3.11-slim-bookworm's dpkg status"
  apt_opts+=(-o "Dir::State::status=$tmp/status")
  closure() {
    apt-get "${apt_opts[@]}" -s install --no-install-recommends "$@" \
      | awk '$1 == "Inst" { print $2 }' | sort -u
  }
  curl_set="$(closure curl)"
  # nodejs's packages beyond curl's (the npm test installs both).
  node_set="$(closure curl nodejs | grep -vxF -f <(printf '%s\n' "$curl_set"))"
  # shellcheck disable=SC2086  # one package name a word
  (cd "$TEST_PACKAGES_DIR/debian" && apt-get "${apt_opts[@]}" download -qq $curl_set) \
    || die "cannot download $curl_set from Debian bookworm"
  # shellcheck disable=SC2086
  (cd "$TEST_PACKAGES_DIR/debian-node" && apt-get "${apt_opts[@]}" download -qq $node_set) \
    || die "cannot download $node_set from Debian bookworm"
  rm -rf "$tmp"
  .venv/bin/python -m pip download -q "uv==$TEST_UV_VERSION" --only-binary :all: --no-deps \
    --platform manylinux2014_x86_64 --python-version 3.11 -d "$TEST_PACKAGES_DIR/pypi" \
    || die "cannot download the uv $TEST_UV_VERSION wheel"
  # npm's own tarball bundles its dependencies: the test runs it with Debian's node.
  if ! command -v npm >/dev/null; then
    say "installing npm (to fetch the npm CLI's tarball for the package cache test)"
    apt_install npm
  fi
  (cd "$TEST_PACKAGES_DIR/npm" && npm pack -q "npm@$TEST_NPM_VERSION" >/dev/null) \
    || die "cannot fetch npm $TEST_NPM_VERSION's tarball"
  echo "$want" >"$stamp"
}

ensure_docker
ensure_compose_v2
ensure_sandbox_sources
ensure_venvs
say "making base images"
.venv/bin/harbor-exec images bootstrap
ensure_browser
ensure_test_packages
if [ "$VALIDATE" = 1 ]; then
  say "validating the example dataset with the oracle"
  .venv/bin/harbor-exec validate tasks_examples/dataset --jobs-dir "$ROOT/jobs"
fi
say "done"
