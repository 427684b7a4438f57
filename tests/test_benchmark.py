"""Subprocess smoke runs of ``scripts/benchmark.py`` with tiny settings: each ends with one JSON line."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--n_rollout_threads", "2", "--episode_length", "1", "--max_new_tokens", "4", "--context_window", "128", "--ppo_epoch", "1"]


def run_bench(*args) -> dict:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "benchmark.py"), *args], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("algo", ["APPO", "TPPO"])
def test_learning_bench_writes_figures_and_a_plot(random_model_dir, tmp_path, algo):
    out = tmp_path / "run"
    result = run_bench("learning", "--model", random_model_dir, "--algorithm_name", algo, "--num_env_steps", "4",
                       "--eval_episodes", "2", "--output_dir", str(out), *TINY)
    assert result["bench"] == "learning" and result["algo"] == algo and result["iterations"] == 2
    for key in ("success_before", "success_after", "train_tasks_success_before", "train_tasks_success_after"):
        assert 0 <= result[key] <= 1, key
    assert result["seconds"] > 0
    assert (out / "logs" / "learning_curve.png").stat().st_size > 0


def test_rollout_and_update_benches(random_model_dir):
    rollout = run_bench("rollout", "--model", random_model_dir, "--repeats", "1", *TINY)
    assert rollout["bench"] == "rollout" and rollout["marft_tokens_per_s"] > 0 and rollout["generate_tokens_per_s"] > 0
    assert rollout["ratio"] == pytest.approx(rollout["marft_tokens_per_s"] / rollout["generate_tokens_per_s"])
    assert rollout["profile_s"]["generate"] > 0
    update = run_bench("update", "--model", random_model_dir, "--repeats", "1", *TINY)
    assert update["bench"] == "update" and update["marft_s"] > 0 and update["plain_s"] > 0


def test_iteration_bench_reports_time_and_memory(random_model_dir):
    result = run_bench("iteration", "--model", random_model_dir, "--n_agents", "4", "--repeats", "1", *TINY)
    assert result["bench"] == "iteration" and result["n_agents"] == 4
    assert result["seconds_per_iteration"] == pytest.approx(result["rollout_s"] + result["update_s"])
    assert result["peak_rss_mib"] > 0 and result["adapter_params_m"] > 0
