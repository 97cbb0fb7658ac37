#!/usr/bin/env bash
# Refresh requirements/cpu.lock, the exact versions of everything the CPU stack installs (scripts/install.sh,
# .ci/run, environment.yml): the newest that pyproject.toml's ranges admit today, for Python 3.11 on x86-64
# Linux, torch pinned to its CPU build (requirements/constraints.in). Commit the result after the tests pass
# on a fresh install from it (`bash scripts/install.sh` in a new virtualenv, then `python3 -m pytest`).
set -euo pipefail
cd "$(dirname "$0")/.."
command -v uv >/dev/null 2>&1 || python3 -m pip install -q uv
uv pip compile pyproject.toml --extra pipeline --extra triton --extra test --extra real \
  --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
  --find-links "${TORCH_FIND_LINKS:-/opt/wheels}" -c requirements/constraints.in \
  --custom-compile-command "bash scripts/lock.sh" -o requirements/cpu.lock
