# Shardline images. Two targets share one wheel build:
#   docker build --target runtime  -t REGISTRY/shardline-runtime:0.1.0 .   (PyTorch + the runtime extra)
#   docker build --target operator -t REGISTRY/shardline-operator:0.1.0 .  (slim Python, no torch)
#
# Both bases are Debian bookworm with CPython 3.11. `make images` (hack/images) overrides them
# with a bookworm base bootstrapped by mmdebstrap (PYTHON_IMAGE, RUNTIME_BASE_IMAGE) and points
# pip at a local wheelhouse only (PIP_FIND_LINKS, PIP_NO_INDEX=1), so the same steps run where
# no registry is reachable.
#
# Both images run as uid 10001 with a read-only root file system: every path they write is a
# volume the chart or the operator mounts (an emptyDir): HOME, the cache root below (Triton,
# torch inductor, Hugging Face) and /tmp.

ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm
# torch comes from PyPI at TORCH_VERSION (pyproject's lower bound, checked by
# tests/chart/test_dockerfile.py); its wheels bring the CUDA libraries.
ARG RUNTIME_BASE_IMAGE=${PYTHON_IMAGE}
# Prints pyproject's dependencies plus one extra (argv[1]), one per line.
ARG REQUIREMENTS="import sys, tomllib; p = tomllib.load(open('/tmp/build/pyproject.toml', 'rb'))['project']; print(*p['dependencies'], *p['optional-dependencies'][sys.argv[1]], sep=chr(10))"

FROM ${PYTHON_IMAGE} AS wheel
ARG PIP_FIND_LINKS=""
ARG PIP_NO_INDEX
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator/ operator/
COPY runtime/ runtime/
RUN python3 -m venv /opt/build \
    && /opt/build/bin/pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${PYTHON_IMAGE} AS operator
ARG PIP_FIND_LINKS=""
ARG PIP_NO_INDEX
ARG REQUIREMENTS
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    HOME=/tmp
# Dependencies first, read from pyproject (a layer that changes only with them), then the
# project's own wheel without them: a source change rebuilds a layer of a few hundred kB.
COPY pyproject.toml /tmp/build/
RUN python3 -m venv /opt/venv \
    && /opt/venv/bin/python -c "$REQUIREMENTS" operator > /tmp/build/requirements.txt \
    && /opt/venv/bin/pip install --no-cache-dir -r /tmp/build/requirements.txt \
    && rm -rf /tmp/build
COPY --from=wheel /wheels/ /wheels/
RUN /opt/venv/bin/pip install --no-cache-dir --no-deps "$(ls /wheels/shardline-*.whl)[operator]" \
    && rm -rf /wheels \
    && useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin shardline
USER 10001:10001
EXPOSE 8080
ENTRYPOINT ["shardline-operator"]

FROM ${RUNTIME_BASE_IMAGE} AS runtime
ARG TORCH_VERSION=2.15.0
ARG PIP_FIND_LINKS=""
ARG PIP_NO_INDEX
# Cache root: one emptyDir ("cache") in the pod; HOME and /tmp are two more.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    HOME=/home/shardline \
    TMPDIR=/tmp \
    XDG_CACHE_HOME=/var/cache/shardline \
    TRITON_HOME=/var/cache/shardline \
    TRITON_CACHE_DIR=/var/cache/shardline/triton \
    TORCHINDUCTOR_CACHE_DIR=/var/cache/shardline/torchinductor \
    TORCH_HOME=/var/cache/shardline/torch \
    HF_HOME=/var/cache/shardline/huggingface \
    HF_HUB_OFFLINE=1
# Triton compiles its GPU launcher (C, including Python.h) at run time: gcc and the libc
# headers stay in the image. Package versions follow the base's Debian point release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
# torch (with its CUDA wheels, the bulk of the image) in a layer of its own: a source change
# rebuilds only the layers below it.
RUN python3 -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir "torch==${TORCH_VERSION}"
# The other dependencies, then the project's wheel alone (as in the operator target). The
# ARG comes only here: declared above, it would be part of the torch layer's cache key.
ARG REQUIREMENTS
COPY pyproject.toml /tmp/build/
RUN /opt/venv/bin/python -c "$REQUIREMENTS" runtime > /tmp/build/requirements.txt \
    && /opt/venv/bin/pip install --no-cache-dir "torch==${TORCH_VERSION}" \
        -r /tmp/build/requirements.txt \
    && rm -rf /tmp/build
COPY --from=wheel /wheels/ /wheels/
RUN /opt/venv/bin/pip install --no-cache-dir --no-deps "$(ls /wheels/shardline-*.whl)[runtime]" \
    && rm -rf /wheels \
    && useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin shardline \
    && install -d -o 10001 -g 10001 /var/cache/shardline
USER 10001:10001
WORKDIR /home/shardline
EXPOSE 8000 29500
ENTRYPOINT ["shardline-runtime"]
CMD ["serve", "--help"]
