"""Subprocess smoke runs of ``scripts/benchmark.py`` with tiny settings: each ends with one JSON line."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--n_rollout_threads", "2", "--episode_length", "1", "--max_new_tokens", "4", "--context_window", "128", "--ppo_epoch", "1"]


def run_bench(*args) -> dict:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "benchmark.py"), *args], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("algo", ["APPO", "TPPO"])
@pytest.mark.slow
def test_learning_bench_writes_figures_and_a_plot(random_model_dir, tmp_path, algo):
    out = tmp_path / "run"
    result = run_bench("learning", "--model", random_model_dir, "--algorithm_name", algo, "--num_env_steps", "4",
                       "--eval_episodes", "2", "--output_dir", str(out), *TINY)
    assert result["bench"] == "learning" and result["algo"] == algo and result["iterations"] == 2
    for key in ("success_before", "success_after", "train_tasks_success_before", "train_tasks_success_after"):
        assert 0 <= result[key] <= 1, key
    assert result["seconds"] > 0
    assert (out / "logs" / "learning_curve.png").stat().st_size > 0
    assert [block["iterations"] for block in result["curve"]] == [[1, 1], [2, 2]]  # no --eval_interval: blocks of 1 here


def test_learning_curve_summary_matches_the_logged_scalars(tmp_path):
    """The numbers behind the benchmarks page's learning curves, against a hand computation from known scalars."""
    from torch.utils.tensorboard import SummaryWriter

    sys.path.insert(0, str(ROOT / "scripts"))
    from benchmark import learning_curve_summary

    success = {1: 0.0, 2: 0.5, 3: 1.0, 4: 0.25, 5: 0.75}
    entropy_a = {i: 0.1 * i for i in success}
    entropy_b = {1: 0.4, 2: 0.2, 4: 0.3}  # a role that did not act in every iteration
    with SummaryWriter(str(tmp_path)) as writer:
        for i in success:
            writer.add_scalar("charts/accuracy", success[i], i)
            writer.add_scalar("losses/agent_Player A/entropy", entropy_a[i], i)
            if i in entropy_b:
                writer.add_scalar("losses/agent_Player B/entropy", entropy_b[i], i)
        for i, held_out in ((0, 0.1), (3, 0.6), (5, 0.9)):
            writer.add_scalar("eval/accuracy", held_out, i)
    curve = learning_curve_summary(tmp_path, block=3)
    assert curve == [
        {"iterations": [1, 3], "success": 0.5, "held_out": 0.6, "entropy": {"Player A": 0.2, "Player B": 0.3}},
        {"iterations": [4, 5], "success": 0.5, "held_out": 0.9, "entropy": {"Player A": 0.45, "Player B": 0.3}},
    ]
    assert learning_curve_summary(tmp_path, block=2)[0]["held_out"] is None  # no evaluation at iteration 2


@pytest.mark.slow
def test_rollout_and_update_benches(random_model_dir):
    rollout = run_bench("rollout", "--model", random_model_dir, "--repeats", "1", *TINY)
    assert rollout["bench"] == "rollout" and rollout["marft_tokens_per_s"] > 0 and rollout["generate_tokens_per_s"] > 0
    assert rollout["ratio"] == pytest.approx(rollout["marft_tokens_per_s"] / rollout["generate_tokens_per_s"])
    assert rollout["profile_s"]["generate"] > 0
    update = run_bench("update", "--model", random_model_dir, "--repeats", "1", *TINY)
    assert update["bench"] == "update" and update["marft_s"] > 0 and update["plain_s"] > 0


@pytest.mark.slow
@pytest.mark.slow
def test_adapters_bench_times_one_batch_against_a_batch_per_adapter(random_model_dir):
    result = run_bench("adapters", "--model", random_model_dir, "--adapters", "3", "--repeats", "1", *TINY)
    assert result["bench"] == "adapters" and result["adapters"] == 3 and result["team_uses"] == "one_batch"
    assert result["one_batch_reply_tokens_per_s"] > 0 and result["batch_per_adapter_reply_tokens_per_s"] > 0


def test_iteration_bench_reports_time_and_memory(random_model_dir):
    result = run_bench("iteration", "--model", random_model_dir, "--n_agents", "4", "--repeats", "1", *TINY)
    assert result["bench"] == "iteration" and result["n_agents"] == 4
    assert result["seconds_per_iteration"] == pytest.approx(result["rollout_s"] + result["update_s"])
    assert result["peak_rss_mib"] > 0 and result["adapter_params_m"] > 0
    assert 0 < result["update_bound_s"] < result["update_s"]  # the --max_update_kl line search runs (the default), inside the update
    # the update's FLOPs counted by torch and its utilization of this machine's large-product rate
    assert result["update_tflop"] > 0 and result["peak_matmul_tflops"] > 0
    assert result["update_mfu"] == pytest.approx(result["update_tflops_per_s"] / result["peak_matmul_tflops"])
    assert 0 < result["update_mfu"] < 1.5  # a measured peak, not the data sheet's: a little above 1 would still be honest
    unbounded = run_bench("iteration", "--model", random_model_dir, "--repeats", "1", "--max_update_kl", "none", *TINY)
    assert unbounded["update_bound_s"] == 0 and unbounded["cut_updates"] == 0


def load_benchmark_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("marft_benchmark_script", ROOT / "scripts" / "benchmark.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_default_budgets_are_iterations_and_grpo_learns_on_more_groups():
    bench = load_benchmark_module()
    appo = bench.parse_args(["learning"])
    assert (appo.n_rollout_threads, appo.num_env_steps) == (32, 384 * 32 * 2)  # what the benchmarks page's seeds ran
    assert bench.parse_args(["learning", "--algorithm_name", "TPPO"]).n_rollout_threads == 32
    assert bench.parse_args(["learning", "--workflow", "orchestrated"]).n_rollout_threads == 16  # route: its recorded runs
    assert bench.parse_args(["iteration"]).n_rollout_threads == 16  # timings keep their size
    grpo = bench.parse_args(["learning", "--algorithm_name", "GRPO", "--group_size", "4"])
    assert (grpo.n_rollout_threads, grpo.num_env_steps) == (32, 384 * 32 * 2)  # 8 groups of 4, same 384 iterations
    assert bench.parse_args(["learning", "--algorithm_name", "GRPO"]).n_rollout_threads == 32  # 4 groups of 8 (the default size)
    assert bench.parse_args(["learning", "--algorithm_name", "GRPO", "--group_size", "5"]).n_rollout_threads == 35  # 7 whole groups
    assert bench.parse_args(["iteration", "--algorithm_name", "GRPO"]).n_rollout_threads == 16  # timings: APPO's settings
    code = bench.parse_args(["learning", "--env_name", "code"])
    assert code.num_env_steps == 4096
    given = bench.parse_args(["learning", "--algorithm_name", "GRPO", "--n_rollout_threads", "8", "--num_env_steps", "64"])
    assert (given.n_rollout_threads, given.num_env_steps) == (8, 64)
