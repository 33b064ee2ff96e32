# One image for the API and the worker agents: `torchyard serve …` or `torchyard worker …`.
#
# torch comes from PyPI at the version pyproject.toml pins; its default Linux wheel
# is built with CUDA and brings the CUDA runtime libraries, so a worker container sees
# the node's GPUs through the NVIDIA container toolkit (the host provides the driver).
# The same image runs CPU-only nodes and the API, which never use a GPU.

FROM python:3.11-slim AS build

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

RUN python -m venv /opt/torchyard
ENV PATH=/opt/torchyard/bin:$PATH

# The heavy layer first, so that a change to torchyard's code does not download torch again.
RUN pip install torch==2.14.1 torchvision==0.29.1

WORKDIR /src
COPY pyproject.toml README.md ./
COPY torchyard ./torchyard
COPY service ./service
COPY worker ./worker
COPY migrations ./migrations
RUN pip install . \
    && python -c "import torchyard.cli, service.api.app, worker.agent.agent, worker.trainer"


FROM python:3.11-slim

LABEL org.opencontainers.image.title="torchyard" \
      org.opencontainers.image.description="Train PyTorch image classifiers on a cluster: API and worker agent"

ENV PATH=/opt/torchyard/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    TORCHYARD_DATA_DIR=/var/lib/torchyard

RUN groupadd --system --gid 10001 torchyard \
    && useradd --system --uid 10001 --gid torchyard --home-dir /var/lib/torchyard --shell /usr/sbin/nologin torchyard \
    && mkdir -p /var/lib/torchyard /var/lib/torchyard-worker \
    && chown torchyard:torchyard /var/lib/torchyard /var/lib/torchyard-worker

COPY --from=build /opt/torchyard /opt/torchyard

USER 10001:10001
WORKDIR /var/lib/torchyard
VOLUME ["/var/lib/torchyard"]
EXPOSE 8000

# The API's liveness (it also checks the database). Worker containers have no HTTP
# server: compose turns this check off for them.
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('TORCHYARD_PORT', '8000') + '/healthz', timeout=4)"]

ENTRYPOINT ["torchyard"]
CMD ["serve", "--host", "0.0.0.0"]
