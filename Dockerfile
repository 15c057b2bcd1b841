# harbor-exec as a service. It drives the host's Docker engine through its socket:
#   .venv/bin/python scripts/service_wheels.py && docker build -t harbor-exec .
#   docker run --network host -v /var/run/docker.sock:/var/run/docker.sock harbor-exec \
#     serve --tasks-dir /opt/harbor-exec/tasks_examples/template --agent oracle --port 8000
# Host networking keeps the service on the host's loopback, where trial containers
# that talk to a loopback chat endpoint (host networking too) can be reached.
# Python 3.13 (Debian trixie's; `harbor-exec images bootstrap` makes a local stand-in):
# the native extra (Harbor's own agents, such as terminus-2) needs Python >= 3.12.
FROM python:3.13-slim-trixie

# scripts/service_wheels.py collects every wheel on the host into build/service-wheels;
# with it the build needs no registry. Without it, pip installs from PyPI.
WORKDIR /opt/harbor-exec/src
COPY pyproject.toml README.md build* ./
COPY harbor_exec ./harbor_exec
COPY bundler ./bundler
COPY images ./images
RUN python3 -m venv /opt/harbor-exec/venv \
 && if [ -d service-wheels ]; then \
      /opt/harbor-exec/venv/bin/pip install --no-cache-dir --disable-pip-version-check \
        --no-index --find-links service-wheels "harbor-exec[server,bundler,native]"; \
    else \
      /opt/harbor-exec/venv/bin/pip install --no-cache-dir --disable-pip-version-check \
        ".[server,bundler,native]"; \
    fi \
 && rm -rf service-wheels
# The service runs trials: the source of their seccomp profile (Docker's default) and the
# read-only container runtime (harbor_exec/sandbox/runtime_build.py), from
# build/service-sandbox when scripts/service_wheels.py put them there, else from Debian.
ENV HARBOR_EXEC_CACHE_DIR=/var/cache/harbor-exec
RUN profile=/usr/share/gocode/src/github.com/docker/docker/profiles/seccomp/default.json \
 && runtime="$(/opt/harbor-exec/venv/bin/python -c 'from harbor_exec.sandbox.runtime_build import runtime_build_dir; print(runtime_build_dir())')" \
 && if [ -d service-sandbox ]; then \
      install -D -m 0644 service-sandbox/seccomp-default.json "$profile" \
      && mkdir -p "$(dirname "$runtime")" && cp -r service-sandbox/runtime "$runtime"; \
    else \
      apt-get update -qq \
      && apt-get install -y -qq --no-install-recommends debootstrap patchelf \
      && (cd /tmp && apt-get download -qq golang-github-docker-docker-dev) \
      && dpkg-deb --fsys-tarfile /tmp/golang-github-docker-docker-dev_*.deb \
         | tar -x -C / ".$profile" \
      && /opt/harbor-exec/venv/bin/python -c 'from harbor_exec.sandbox.images import ensure_container_runtime as e; e()' \
      && rm -rf /tmp/*.deb /var/lib/apt/lists/*; \
    fi \
 && rm -rf service-sandbox && test -f "$profile" && test -f "$runtime/runtime.tar"
COPY tasks_examples /opt/harbor-exec/tasks_examples

ENV PATH=/opt/harbor-exec/venv/bin:$PATH
WORKDIR /var/lib/harbor-exec
ENTRYPOINT ["harbor-exec"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000", "--tasks-dir", "/opt/harbor-exec/tasks_examples/template", "--agent", "oracle"]
