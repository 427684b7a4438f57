#!/usr/bin/env bash
# The GPU check (issue 77): one short run on a lent GPU machine that records the rollout and iteration rows of the
# `gpu` suite (benchmarks/suites.yaml) for the Qwen2.5-1.5B shape in bf16, with random weights built on the device
# (no model hub is needed), into benchmarks/results/gpu.json, and copies that file to $OUT when the device tool runs it.
# About 5 minutes on an H100 (the first two rows took 144 s and 115 s on 2026-11-27; the third, rows of 4 adapters, is
# not yet timed there). Everything else is tested on CPU.
#   bash benchmarks/gpu_check.sh                      # on any machine with CUDA and marft's requirements
#   PYTHON=/path/to/python bash benchmarks/gpu_check.sh
# Afterwards, here: python scripts/render_benchmarks.py (the results page and the README table).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" - <<'PY'
import importlib.util, sys
import torch
if not torch.cuda.is_available():
    sys.exit("gpu_check: torch sees no CUDA device")
missing = [m for m in ("transformers", "peft", "tensorboard", "yaml") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"gpu_check: missing Python packages {missing}: carry them as wheels (pip download) or pip install -r requirements.txt")
print(f"gpu_check: torch {torch.__version__}, {torch.cuda.get_device_name(0)}", flush=True)
PY
"$PY" scripts/benchmark_suite.py gpu --rows "rollout, Qwen2.5-1.5B shape, bf16" "iteration, Qwen2.5-1.5B shape, bf16" \
    "rows of 4 adapters, Qwen2.5-1.5B shape, bf16"
if [[ -n ${OUT:-} ]]; then cp benchmarks/results/gpu.json "$OUT/gpu.json"; fi
