# Shardline images. Two targets share one wheel build:
#   docker build --target runtime  -t shardline-runtime:0.1.0 .    (CUDA PyTorch + the runtime extra)
#   docker build --target operator -t shardline-operator:0.1.0 .   (slim Python, no CUDA, no torch)

ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm
ARG PYTORCH_IMAGE=pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime

FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator/ operator/
COPY runtime/ runtime/
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${PYTHON_IMAGE} AS operator
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
COPY --from=wheel /wheels/ /wheels/
RUN pip install --no-cache-dir "$(ls /wheels/shardline-*.whl)[operator]" \
    && rm -rf /wheels \
    && useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin shardline
USER 10001:10001
EXPOSE 8080
ENTRYPOINT ["shardline-operator"]

FROM ${PYTORCH_IMAGE} AS runtime
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1
COPY --from=wheel /wheels/ /wheels/
RUN pip install --no-cache-dir "$(ls /wheels/shardline-*.whl)[runtime]" \
    && rm -rf /wheels \
    && useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin shardline
USER 10001:10001
WORKDIR /home/shardline
EXPOSE 8000 29500
ENTRYPOINT ["shardline-runtime"]
CMD ["serve", "--help"]
