# harbor-exec as a service. It drives the host's Docker engine through its socket:
#   docker build -t harbor-exec .
#   docker run --network host -v /var/run/docker.sock:/var/run/docker.sock harbor-exec \
#     serve --tasks-dir /opt/harbor-exec/tasks_examples/template --agent oracle --port 8000
# Host networking keeps the service on the host's loopback, where trial containers
# that talk to a loopback chat endpoint (host networking too) can be reached.
FROM python:3.11-slim-bookworm

WORKDIR /opt/harbor-exec/src
COPY pyproject.toml README.md ./
COPY harbor_exec ./harbor_exec
COPY bundler ./bundler
COPY images ./images
RUN python3 -m venv /opt/harbor-exec/venv \
 && /opt/harbor-exec/venv/bin/pip install --no-cache-dir --disable-pip-version-check ".[server,bundler]"
COPY tasks_examples /opt/harbor-exec/tasks_examples

ENV PATH=/opt/harbor-exec/venv/bin:$PATH \
    HARBOR_EXEC_CACHE_DIR=/var/cache/harbor-exec
WORKDIR /var/lib/harbor-exec
ENTRYPOINT ["harbor-exec"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000", "--tasks-dir", "/opt/harbor-exec/tasks_examples/template", "--agent", "oracle"]
