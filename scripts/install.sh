#!/usr/bin/env bash
# Install AdaAttn and everything its pipeline and tests need, at the exact versions of requirements/cpu.lock
# (refreshed by scripts/lock.sh), into the current Python:
#   - torch first: the lock's CPU build where there is no NVIDIA driver (pip would otherwise pull gigabytes of
#     CUDA wheels; this workplace serves the CPU wheel from local disk, elsewhere set
#     TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu), the CUDA build of the same version where there is one;
#   - then every other locked package, then this package, editable (the pipeline runs from the checkout: the
#     studies in experiments/ are found there) and without resolving anything again;
#   - with --browser, Debian's chromium for the browser test (tests/test_browser.py), through apt-get as root.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOCK=requirements/cpu.lock
browser=0
for arg in "$@"; do
  case "$arg" in
    --browser) browser=1 ;;
    *) echo "install.sh: unknown option $arg; allowed: --browser" >&2; exit 2 ;;
  esac
done

torch=$(grep -E '^torch==' "$LOCK" | cut -d= -f3)  # 2.13.0+cpu
if command -v nvidia-smi >/dev/null 2>&1; then
  # a GPU machine: the CUDA build of the locked version, with the triton it brings
  "$PY" -m pip install "torch==${torch%+cpu}"
  grep -vE '^(torch|triton)==' "$LOCK" > /tmp/adaattn-lock.txt
  "$PY" -m pip install -r /tmp/adaattn-lock.txt
else
  "$PY" -m pip install "torch==${torch}" ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"}
  "$PY" -m pip install -r "$LOCK" ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"}
fi
"$PY" -m pip install --no-deps -e .

if [ "$browser" = 1 ] && ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  else
    echo "install.sh --browser: install Debian's chromium yourself (apt-get install chromium, as root)" >&2
    exit 1
  fi
fi
