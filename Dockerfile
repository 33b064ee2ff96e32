# Two images from one Dockerfile, one target each (each part installs only what it needs, README.md):
#
#   docker build --target api -t torchyard-api .        # the API: server extra, no torch (the default target)
#   docker build --target worker -t torchyard-worker .  # a worker agent and its trainer: worker extra
#
# Both run the `torchyard` command: `serve …` in the API image, `worker …` in the worker image.
# The worker's torch comes from PyPI at the version pyproject.toml pins; its default Linux
# wheel is built with CUDA and brings the CUDA runtime libraries, so a worker container sees
# the node's GPUs through the NVIDIA container toolkit (the host provides the driver). The
# same worker image runs CPU-only nodes.

# ---------------------------------------------------------------- build stages
FROM python:3.11-slim AS build-base

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

RUN python -m venv /opt/torchyard
ENV PATH=/opt/torchyard/bin:$PATH
WORKDIR /src


FROM build-base AS build-api

COPY pyproject.toml README.md ./
COPY torchyard ./torchyard
COPY service ./service
COPY worker ./worker
COPY migrations ./migrations
# The API never trains: the image must not carry torch.
RUN pip install "./[server]" \
    && python -c "import sys, torchyard.cli, service.api.app; assert 'torch' not in sys.modules" \
    && ! python -c "import torch" 2>/dev/null


FROM build-base AS build-worker

# The heavy layer first, so that a change to torchyard's code does not download torch again.
RUN pip install torch==2.14.1 torchvision==0.29.1

COPY pyproject.toml README.md ./
COPY torchyard ./torchyard
COPY service ./service
COPY worker ./worker
COPY migrations ./migrations
RUN pip install "./[worker]" \
    && python -c "import torchyard.cli, worker.agent.agent, worker.trainer.runner, torchyard.modeldir"


# ---------------------------------------------------------------- what both images share
FROM python:3.11-slim AS runtime

ENV PATH=/opt/torchyard/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    TORCHYARD_DATA_DIR=/var/lib/torchyard

RUN groupadd --system --gid 10001 torchyard \
    && useradd --system --uid 10001 --gid torchyard --home-dir /var/lib/torchyard --shell /usr/sbin/nologin torchyard \
    && mkdir -p /var/lib/torchyard /var/lib/torchyard-worker \
    && chown torchyard:torchyard /var/lib/torchyard /var/lib/torchyard-worker

ENTRYPOINT ["torchyard"]


# ---------------------------------------------------------------- worker image
FROM runtime AS worker

LABEL org.opencontainers.image.title="torchyard-worker" \
      org.opencontainers.image.description="torchyard worker agent and trainer (torch with CUDA)"

COPY --from=build-worker /opt/torchyard /opt/torchyard

USER 10001:10001
WORKDIR /var/lib/torchyard-worker
VOLUME ["/var/lib/torchyard-worker"]
# No HTTP server in a worker: nothing to check from inside.
HEALTHCHECK NONE
CMD ["worker", "--api", "http://api:8000", "--work-dir", "/var/lib/torchyard-worker"]


# ---------------------------------------------------------------- API image (the default target: last)
FROM runtime AS api

LABEL org.opencontainers.image.title="torchyard-api" \
      org.opencontainers.image.description="torchyard API service (no torch)"

COPY --from=build-api /opt/torchyard /opt/torchyard

USER 10001:10001
WORKDIR /var/lib/torchyard
VOLUME ["/var/lib/torchyard"]
EXPOSE 8000

# The API's liveness (it also checks the database).
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('TORCHYARD_PORT', '8000') + '/healthz', timeout=4)"]

CMD ["serve", "--host", "0.0.0.0"]
