#!/usr/bin/env bash
# Set up a bare GPU machine that has torch/triton but no network: install the wheels carried in
# .whl/ (pydantic, xformers, ...; see docs/gpu-box.md) and this
# package, without touching the machine's torch, and restore the compile caches a call carried (.gpu-cache).
# Source it: `. scripts/device_setup.sh`.
set -e
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . > /tmp/adaattn-install.log 2>&1 \
  || { cat /tmp/adaattn-install.log; return 1 2>/dev/null || exit 1; }
. scripts/gpu_cache.sh restore  # compile caches from the last call, where carried (scripts/gpu_cache.sh)
set +e
