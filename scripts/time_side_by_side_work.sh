#!/usr/bin/env bash
# marft's seconds per iteration (rollout + update) on the work of ../shared/anchor/side_by_side.sh, marft alone:
# the same 3.7M model, MATH training data, the original MARFT's role prompts, 2 agents, 4 envs, 32 new tokens,
# one PPO epoch, policies updated on every batch (the "same work"). Extra flags override these (e.g. --n_agents 4
# --profile_path ORIG/marft/scripts/profiles/math_quartet.json, --max_new_tokens 128, --n_rollout_threads 16).
# Usage (from the marft checkout of the development workspace): scripts/time_side_by_side_work.sh ORIG_DIR ALGO [flags]
#   STEPS: env steps to run (default 40: 10 iterations of 4 envs; the first iteration is not timed).
#   PROFILE_FROM=N: run it under torch.profiler from iteration N (scripts/profile_training.py) and print the top ops too
#   (seconds and peak RSS then include the profiler's own work and records: use them for the op table only).
# Prints one JSON line: rollout_s, iteration_s (means over the timed iterations), peak_rss_mib.
set -euo pipefail
ORIG=$(cd "$1" && pwd); ALGO=$2; shift 2
PY=${PYTHON:-.venv/bin/python}
ANCHOR=$(cd ../shared/anchor && pwd); DATA=$(cd ../shared/data/MATH && pwd)/train.json
W=$("$PY" -c "import tempfile; print(tempfile.gettempdir())")/marft-side-by-side; mkdir -p "$W"
[[ -f $W/tiny37/config.json ]] || "$PY" "$ANCHOR/make_model.py" "$W/tiny37" --hidden 256 --layers 4 >/dev/null
rm -rf "$W/timed"
ENTRY=(scripts/train_math.py); [[ -n ${PROFILE_FROM:-} ]] && ENTRY=(scripts/profile_training.py --profile_from "$PROFILE_FROM")
OMP_NUM_THREADS=2 /usr/bin/time -v -o "$W/timed.time" "$PY" "${ENTRY[@]}" --algorithm_name "$ALGO" \
  --n_agents 2 --n_rollout_threads 4 --episode_length 1 --max_new_tokens 32 --context_window 512 --ppo_epoch 1 \
  --num_mini_batch 1 --horizon 1 --num_env_steps "${STEPS:-40}" --seed 10 --model_name_or_path "$W/tiny37" \
  --profile_path "$ORIG/marft/scripts/profiles/math_dual.json" --dataset_path "$DATA" --dtype float32 --device cpu \
  --eval_episodes 2 --n_eval_threads 2 --update_on_constant_rewards true --output_dir "$W/timed" "$@" >"$W/timed.log" 2>&1
[[ -n ${PROFILE_FROM:-} ]] && sed -n '/Name/,$p' "$W/timed.log" | grep -v "^USDT"
RSS=$(awk '/Maximum resident/ {printf "%.0f", $6/1024}' "$W/timed.time")
"$PY" - "$W/timed/logs" "$RSS" <<'PY'
import glob, json, statistics, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
ea = EventAccumulator(sorted(glob.glob(sys.argv[1] + "/events.out.tfevents.*"))[-1], size_guidance={"scalars": 0})
ea.Reload()
mean = lambda tag: round(statistics.mean(e.value for e in ea.Scalars(tag)[1:]), 3)
print(json.dumps({"rollout_s": mean("charts/rollout_seconds"), "iteration_s": mean("charts/iteration_seconds"), "peak_rss_mib": int(sys.argv[2])}))
PY
