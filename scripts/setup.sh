#!/usr/bin/env bash
# Install marft and its dependencies into ./.venv (created if missing).
# torch is pinned to 2.13.0 and installed first, so nothing pulls an unpinned (multi-GB CUDA) build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${MARFT_VENV:-.venv}"
if [[ ! -x "$VENV/bin/python" ]]; then
  "${PYTHON:-python3}" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "torch==2.13.0"
"$VENV/bin/python" -m pip install -q -r requirements.txt -r requirements-dev.txt  # dev: pytest, ruff, mkdocs
"$VENV/bin/python" -m pip install -q --no-deps -e .
echo "installed marft into $VENV"
