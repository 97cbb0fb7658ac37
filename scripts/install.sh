#!/usr/bin/env bash
# Install AdaAttn and everything its pipeline and tests need, into the current Python.
#   - torch first: a CPU build where there is no NVIDIA driver (pip would otherwise pull
#     gigabytes of CUDA wheels), the default build where there is one;
#   - the package with its pipeline (dvc, mlflow, seaborn, ...), test and real-inputs extras;
#   - Debian's chromium for the browser test, when apt-get is there and we are root.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}

if ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "$PY" -m pip install "torch==${TORCH_VERSION}"
  else
    # A CPU wheel: this workplace serves one from local disk; elsewhere add
    # --index-url https://download.pytorch.org/whl/cpu
    "$PY" -m pip install "torch==${TORCH_VERSION}" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
  fi
fi
"$PY" -m pip install -e ".[triton,test,real]"

if ! command -v chromium >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  else
    echo "note: the browser test needs Debian's chromium (apt-get install chromium)" >&2
  fi
fi
