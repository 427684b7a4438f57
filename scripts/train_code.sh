#!/usr/bin/env bash
# Train an agent team on programming problems (CodeEnv). Extra flags are passed through, e.g.
#   bash scripts/train_code.sh --profile_path planner_coder_debugger --n_agents 3 --dataset_path data/deepcoder.jsonl
# With no flags: the embedded tiny model, a Reasoner -> Actor team, the generated f(x) task family, CPU.
# The first call installs everything into ./.venv (scripts/setup.sh); set PYTHON to use another interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${PYTHON:-}" ]]; then
  [[ -x .venv/bin/python ]] || bash scripts/setup.sh
  PYTHON=.venv/bin/python
fi
exec "$PYTHON" scripts/train_math.py --env_name code "$@"
