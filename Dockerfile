# The image of the prefect-worker and Dask services in docker-compose.yml: shardsmith and every
# dependency in pyproject.toml, so a flow's tasks import the same code on every worker.
FROM python:3.11-slim

# CPU torch by default (small image); for the GPU profile build with
#   docker compose build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PREFECT_SERVER_ANALYTICS_ENABLED=false \
    SHARDSMITH_HOME=/opt/shardsmith

RUN apt-get update \
    && apt-get install -y --no-install-recommends libgl1 libglib2.0-0 tini \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/shardsmith

# Dependencies first, so code changes do not reinstall them.
COPY pyproject.toml README.md ./
RUN mkdir -p cli flows tasks loaders deployments \
    && touch cli/__init__.py flows/__init__.py tasks/__init__.py loaders/__init__.py deployments/__init__.py \
    && pip install --extra-index-url "${TORCH_INDEX}" . \
    && pip uninstall -y shardsmith

COPY cli ./cli
COPY flows ./flows
COPY tasks ./tasks
COPY loaders ./loaders
COPY deployments ./deployments
COPY recipes ./recipes
# /shared (Prefect results) and /demo (the demo corpus) are mount points of named volumes; a
# new volume takes the owner of the folder it is mounted over, so the user below can write it.
RUN pip install --no-deps . \
    && useradd --create-home --uid 1000 shardsmith \
    && mkdir -p /shared /demo && chown shardsmith /shared /demo

USER shardsmith
ENTRYPOINT ["tini", "--"]
CMD ["prefect", "worker", "start", "--pool", "shardsmith-process", "--type", "process"]
