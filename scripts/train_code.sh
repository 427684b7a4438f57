#!/usr/bin/env bash
# Train an agent team on programming problems (CodeEnv). Extra flags are passed through, e.g.
#   bash scripts/train_code.sh --profile_path planner_coder_debugger --n_agents 3 --dataset_path data/deepcoder.jsonl
# With no flags: the embedded instruct model (marft-tiny-instruct, whose warm start writes ```python blocks),
# a Reasoner -> Actor code team (reasoner_actor_code), the generated f(x) task family, 24-token replies, CPU.
# Each of those three defaults applies only when its flag is not given, and none on resume (--load_path keeps the
# checkpoint's). The first call installs everything into ./.venv (scripts/setup.sh); set PYTHON to use another interpreter.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"  # the checkout; the run stays where it is called from (relative paths are the caller's)
if [[ -z "${PYTHON:-}" ]]; then
  [[ -x "$root/.venv/bin/python" ]] || bash "$root/scripts/setup.sh"
  PYTHON="$root/.venv/bin/python"
fi
given() { local arg; for arg in "${@:2}"; do [[ "$arg" == "$1" || "$arg" == "$1="* ]] && return 0; done; return 1; }
defaults=()
if ! given --load_path "$@"; then
  given --model_name_or_path "$@" || defaults+=(--model_name_or_path marft-tiny-instruct)
  given --profile_path "$@" || defaults+=(--profile_path reasoner_actor_code)
  given --max_new_tokens "$@" || defaults+=(--max_new_tokens 24)
fi
exec "$PYTHON" "$root/scripts/train_math.py" --env_name code "${defaults[@]}" "$@"
