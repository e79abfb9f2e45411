# lmhead: serve language-model heads. Targets:
#   docker build -t lmhead .                  CPU image (default, last stage)
#   docker build --target gpu -t lmhead:gpu . onnxruntime-gpu on a CUDA runtime image
# Configuration is only by LMHEAD_* environment variables (see README). The image serves
# /models, follows it (poll mode), keeps the load/unload API off unless a token is given, and
# writes the demo heads at first start when /models is empty (LMHEAD_CREATE_DEMO_MODELS=false
# turns that off).
ARG PYTHON_IMAGE=python:3.11-slim
# onnxruntime-gpu 1.31 is built for CUDA 13 (and cuDNN 9): the base image's CUDA major must match.
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-cudnn-runtime-ubuntu24.04
ARG ORT_GPU=1.31.1

# ---- build: dependencies in their own layer, then the package ------------------------------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
RUN python -m venv /opt/lmhead
COPY pyproject.toml ./
# A stub package lets pip resolve and install the dependencies from pyproject.toml alone, so
# this layer is rebuilt only when the dependencies change, not on every source edit.
RUN mkdir service && touch service/__init__.py \
    && /opt/lmhead/bin/pip install ".[cpu,grpc]" \
    && /opt/lmhead/bin/pip uninstall --yes lmhead \
    && rm -rf service build ./*.egg-info
COPY service ./service
RUN /opt/lmhead/bin/pip install --no-deps . && rm -rf /src

# ---- gpu: onnxruntime-gpu on a CUDA runtime base (the CUDA provider, CPU fallback) --------
FROM ${CUDA_IMAGE} AS gpu
ARG ORT_GPU
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
    && apt-get install --yes --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/lmhead
WORKDIR /src
COPY pyproject.toml ./
# The build stage's stub package: onnxruntime-gpu (255 MB) is not installed again per edit.
RUN mkdir service && touch service/__init__.py \
    && /opt/lmhead/bin/pip install ".[gpu,grpc]" "onnxruntime-gpu==${ORT_GPU}" \
    && /opt/lmhead/bin/pip uninstall --yes lmhead \
    && rm -rf service build ./*.egg-info
COPY service ./service
RUN /opt/lmhead/bin/pip install --no-deps . && rm -rf /src
RUN groupadd --system --gid 10001 lmhead \
    && useradd --system --uid 10001 --gid 10001 --create-home lmhead \
    && mkdir -p /models && chown lmhead /models
ENV PATH=/opt/lmhead/bin:$PATH \
    LMHEAD_HOST=0.0.0.0 LMHEAD_PORT=8000 LMHEAD_GRPC_PORT=8001 LMHEAD_REPOSITORY=/models \
    LMHEAD_PROVIDER=cuda LMHEAD_CONTROL_MODE=poll LMHEAD_READ_ONLY=true \
    LMHEAD_CREATE_DEMO_MODELS=true
USER 10001:10001
WORKDIR /home/lmhead
VOLUME ["/models"]
EXPOSE 8000 8001
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 CMD ["lmhead", "health"]
CMD ["lmhead", "serve"]

# ---- runtime (CPU, default) --------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS cpu
RUN groupadd --system --gid 10001 lmhead \
    && useradd --system --uid 10001 --gid 10001 --create-home lmhead \
    && mkdir -p /models && chown lmhead /models
COPY --from=build /opt/lmhead /opt/lmhead
ENV PATH=/opt/lmhead/bin:$PATH \
    LMHEAD_HOST=0.0.0.0 LMHEAD_PORT=8000 LMHEAD_GRPC_PORT=8001 LMHEAD_REPOSITORY=/models \
    LMHEAD_PROVIDER=cpu LMHEAD_CONTROL_MODE=poll LMHEAD_READ_ONLY=true \
    LMHEAD_CREATE_DEMO_MODELS=true
USER 10001:10001
WORKDIR /home/lmhead
VOLUME ["/models"]
EXPOSE 8000 8001
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 CMD ["lmhead", "health"]
CMD ["lmhead", "serve"]
