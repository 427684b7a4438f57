#!/usr/bin/env bash
# Train an agent team on math with multi-agent PPO. Extra flags are passed through, e.g.
#   bash scripts/train_math.sh --model_name_or_path /models/Qwen2.5-1.5B-Instruct --device cuda
# With no flags: the embedded tiny model, a 2-agent Reasoner -> Actor team, generated arithmetic, CPU.
# The first call installs everything into ./.venv (scripts/setup.sh); set PYTHON to use another interpreter.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"  # the checkout; the run stays where it is called from (relative paths are the caller's)
if [[ -z "${PYTHON:-}" ]]; then
  [[ -x "$root/.venv/bin/python" ]] || bash "$root/scripts/setup.sh"
  PYTHON="$root/.venv/bin/python"
fi
exec "$PYTHON" "$root/scripts/train_math.py" "$@"
