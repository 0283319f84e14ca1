# kvroute's container image (docs/deployment.md):
#
#   docker build -t kvroute .
#   docker run -p 8080:8080 kvroute serve --worker http://gpu0:8000 --worker http://gpu1:8000
#   docker run -p 8080:8080 -v ./kvroute.toml:/etc/kvroute/kvroute.toml:ro \
#       -e KVROUTE_CONFIG=/etc/kvroute/kvroute.toml -e KVROUTE_ADMIN_TOKEN=... kvroute
#
# Configuration as anywhere else: KVROUTE_<SETTING> variables, a TOML file (KVROUTE_CONFIG or
# --config) and flags after `serve`.  The same image runs the other commands (`kvroute sim`, `doctor`,
# `canary`).  PYTHON_IMAGE: any Debian-based image with python3 >= 3.11 and its venv module.
ARG PYTHON_IMAGE=python:3.12-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY src ./src
# kvroute's wheel and its dependencies' wheels, then a virtual environment installed from those
# alone; only the environment goes into the final image (no build tools, no sources, no wheels).
RUN python3 -m venv /opt/kvroute \
 && /opt/kvroute/bin/pip wheel --wheel-dir /wheels . \
 && /opt/kvroute/bin/pip install --no-index --find-links /wheels kvroute \
 && /opt/kvroute/bin/kvroute --help >/dev/null

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="kvroute" \
      org.opencontainers.image.description="A prefix-cache- and session-aware router for fleets of LLM inference replicas" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /opt/kvroute /opt/kvroute
# A numeric, unprivileged user, so that Kubernetes' runAsNonRoot can check it.
RUN useradd --system --uid 10001 --user-group --create-home --home-dir /home/kvroute \
        --shell /usr/sbin/nologin kvroute
# In a container the router listens on every interface (the default, 127.0.0.1, would be
# unreachable from outside it); the health check reads KVROUTE_PORT, so change the port with it.
ENV PATH=/opt/kvroute/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    KVROUTE_HOST=0.0.0.0 \
    KVROUTE_PORT=8080
USER 10001:10001
WORKDIR /home/kvroute
EXPOSE 8080
# /ready: 200 while at least one worker takes requests and the router is not shutting down, else 503.
HEALTHCHECK --interval=10s --timeout=3s --start-period=15s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/ready' % os.environ.get('KVROUTE_PORT', '8080'), timeout=2)"]
# SIGTERM (docker stop, a pod's deletion) lets in-flight requests finish (shutdown_timeout_s).
STOPSIGNAL SIGTERM
ENTRYPOINT ["kvroute"]
CMD ["serve"]
