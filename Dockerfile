# syntax=docker/dockerfile:1.7
# Two images from one file (tests/test_dockerfile.py checks stages, users, pins):
#   docker build --target runtime  -t ghcr.io/kvfleet/kvfleet:0.1.0 .
#   docker build --target operator -t ghcr.io/kvfleet/kvfleet-operator:0.1.0 .
# Build stages hold the tools; the final stages get only a ready virtualenv.

ARG PYTHON_IMAGE=python:3.12.10-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-base-ubuntu24.04

# ---------------------------------------------------------------- the kvfleet wheel
FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
RUN pip install --no-cache-dir build==1.2.2.post1
COPY pyproject.toml README.md ./
COPY runtime runtime
COPY kernels kernels
COPY operator operator
RUN python -m build --wheel --outdir /dist

# ---------------------------------------------------------------- operator virtualenv
FROM ${PYTHON_IMAGE} AS operator-venv
COPY --from=wheel /dist /dist
RUN python -m venv /opt/kvfleet \
 && /opt/kvfleet/bin/pip install --no-cache-dir \
      kopf==1.45.2 kubernetes==36.0.3 PyYAML==6.0.4 \
 && /opt/kvfleet/bin/pip install --no-cache-dir --no-deps /dist/kvfleet-0.1.0-py3-none-any.whl

# ---------------------------------------------------------------- operator image
FROM ${PYTHON_IMAGE} AS operator
RUN useradd --uid 1000 --user-group --no-create-home --home-dir /tmp kvfleet
COPY --from=operator-venv /opt/kvfleet /opt/kvfleet
ENV PATH=/opt/kvfleet/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/tmp
USER 1000:1000
EXPOSE 8080
ENTRYPOINT ["kvfleet-operator"]

# ---------------------------------------------------------------- runtime virtualenv
FROM ${CUDA_IMAGE} AS runtime-venv
# Distribution packages follow the base image tag, which pins the release.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.12 python3.12-venv \
 && rm -rf /var/lib/apt/lists/*
COPY --from=wheel /dist /dist
# torch's CUDA wheels carry their own CUDA libraries; the node brings the driver.
RUN python3.12 -m venv /opt/kvfleet \
 && /opt/kvfleet/bin/pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cu130 \
      torch==2.13.0 triton==3.9.0 \
 && /opt/kvfleet/bin/pip install --no-cache-dir \
      numpy==2.4.6 transformers==5.24.0 tokenizers==0.23.3 safetensors==0.8.0 gguf==0.19.0 \
      Jinja2==3.1.6 fastapi==0.165.0 uvicorn==0.54.0 uvloop==0.23.0 httptools==0.9.0 pydantic==2.14.4 prometheus-client==0.26.0 \
      xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 boto3==1.44.8 huggingface-hub==2.4.0 tqdm==4.70.1 aiohttp==3.14.5 matplotlib==3.11.2 PyYAML==6.0.4 \
 && /opt/kvfleet/bin/pip install --no-cache-dir --no-deps /dist/kvfleet-0.1.0-py3-none-any.whl

# ---------------------------------------------------------------- runtime image
FROM ${CUDA_IMAGE} AS runtime
# gcc and the Python headers are not build leftovers: Triton compiles its small
# CUDA launcher stubs with them on first use, at run time, on every node.
# (Distribution packages follow the base image tag, which pins the release.)
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.12 libpython3.12-dev gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --uid 1000 --user-group --no-create-home --home-dir /tmp kvfleet \
 && mkdir -p /models && chown 1000:1000 /models
COPY --from=runtime-venv /opt/kvfleet /opt/kvfleet
ENV PATH=/opt/kvfleet/bin:$PATH PYTHONUNBUFFERED=1 HOME=/tmp TRITON_CACHE_DIR=/tmp/triton \
    HF_HUB_OFFLINE=1
USER 1000:1000
WORKDIR /tmp
EXPOSE 8000
ENTRYPOINT ["kvfleet"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
