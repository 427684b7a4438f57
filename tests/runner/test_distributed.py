"""Data parallelism on CPU: ``torchrun --standalone --nproc_per_node 2`` (gloo), what ``accelerate launch`` runs on GPUs.

(``accelerate launch --cpu`` would start ONE process whatever ``--num_processes`` says.) Each launch runs
``tests/dist_worker.py`` in two processes on the tiny random model (the learning test: the embedded model).

* one update with 2 processes on the two halves of a batch == one process on the whole batch, per algorithm
  and adapter layout; a NaN on one process skips the step on both;
* 2N iterations in one go == N, stop, resume N more, with 2 processes; resuming with 1 process is an error;
* killing one process: the other stops with an error within a bounded time, the last checkpoint is intact, and
  the run resumes from it;
* a 2-process run of ``relay_sum`` learns, and both processes end with identical weights.
"""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import marft.envs
from marft.cli.train import main
from marft.runner.shared.checkpoint import find_checkpoint, read_checkpoint_meta

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "dist_worker.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
E = 4  # n_rollout_threads: two envs per process


@pytest.fixture(autouse=True, scope="module")
def dense_relay_sum():
    """The workers' ``dense_relay_sum``, registered in this process too for the one-process runs here."""
    spec = importlib.util.spec_from_file_location("dist_worker", WORKER)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    before = marft.envs._REGISTRY.get("dense_relay_sum")
    marft.envs.register("dense_relay_sum", worker.DenseRelaySum)
    yield
    marft.envs._REGISTRY.pop("dense_relay_sum")
    if before is not None:  # conftest's, for the modules after this one
        marft.envs._REGISTRY["dense_relay_sum"] = before


def launch(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([*TORCHRUN, str(WORKER), *args], env=ENV, capture_output=True, text=True, timeout=timeout)


def workers_said(done: subprocess.CompletedProcess) -> str:
    """The end of what the workers printed, without library warnings and before torchrun's own traceback (which
    only repeats that a worker failed): where a failure shows what happened (a Python error, or the stacks
    ``faulthandler`` prints when a worker dies in native code)."""
    said = done.stderr.split("Traceback (most recent call last):\n  File \"<frozen runpy>\"")[0]
    lines = [line for line in said.splitlines() if "Warning" not in line and "warnings.warn" not in line]
    return "\n".join(lines)[-4000:]


def ranks(out: Path) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def flags(model_dir, iterations: int, run: Path, *extra: str) -> list[str]:
    return [
        "--model_name_or_path", str(model_dir), "--env_name", "dense_relay_sum", "--horizon", "3",
        "--max_new_tokens", "6", "--context_window", "128", "--n_rollout_threads", str(E), "--episode_length", "1",
        "--eval_episodes", "2", "--n_eval_threads", "1", "--num_env_steps", str(E * iterations), "--output_dir", str(run), *extra,
    ]


def train(out: Path, argv: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    out.mkdir(parents=True, exist_ok=True)
    return launch("train", str(out), "--", *argv, timeout=timeout)


# ---------------------------------------------------------------------- one update: 2 processes == 1 on the union
@pytest.fixture(scope="module")
def update_results(random_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("update")
    done = launch("update", random_model_dir, str(out))
    assert done.returncode == 0, workers_said(done)
    return ranks(out)


@pytest.mark.parametrize("case", ["APPO_per_agent", "APPO_shared", "TPPO_per_agent", "TPPO_shared"])
@pytest.mark.slow
def test_two_processes_on_halves_update_as_one_process_on_the_whole_batch(update_results, case):
    """Two epochs, two accumulation chunks, active clipping. With SGD the weights are linear in the clipped global
    gradient: equal to 1e-5 (measured ~1e-8). AdamW divides by ``sqrt(v) + eps`` and so magnifies float32
    summation-order noise of gradients near zero, up to its step size lr = 1e-3 (measured 1.4e-5): 1e-4 there."""
    for rank in update_results:
        sgd, adamw = rank[f"{case}/sgd"], rank[f"{case}/adamw"]
        assert sgd["moved"] > 1e-3 and adamw["moved"] > 1e-3, "the update did not move the weights"
        assert sgd["max_diff"] < 1e-5, sgd
        assert adamw["max_diff"] < 1e-4, adamw
    assert update_results[0][f"{case}/adamw"]["hash"] == update_results[1][f"{case}/adamw"]["hash"]


def test_a_nan_on_one_process_skips_the_step_on_all(update_results):
    first, second = (rank["nan_on_one_rank"] for rank in update_results)
    assert first["skipped"] == second["skipped"] == 1
    assert first["hash"] == second["hash"], "the processes' weights diverged"


# ---------------------------------------------------------------------- unequal shares: 9 and 12 turns == 21 in one process
@pytest.fixture(scope="module")
def unequal_results(random_model_dir, tmp_path_factory):
    """Before the shares agreed on a minibatch count, 9 vs 12 rows with --num_mini_batch 4 ran 3 and 4 minibatches:
    the fourth all-reduce waited for gloo's timeout (the worker's: 60 s). The subprocess's own timeout turns a hang
    into a failure."""
    out = tmp_path_factory.mktemp("unequal")
    done = launch("unequal", random_model_dir, str(out), timeout=400)
    assert done.returncode == 0, workers_said(done)
    return ranks(out)


@pytest.mark.parametrize("case", ["APPO_9", "TPPO_9", "GRPO_9", "APPO_21", "GRPO_9_bounded"])
@pytest.mark.slow
def test_two_processes_with_unequal_shares_update_as_one_process_on_the_union(unequal_results, case):
    """4 minibatches of the 21 rows (6, 6, 6, 3), two chunks each, two epochs, clipping and the reference KL;
    SGD (lr 1), so the weights are linear in the clipped global gradient (float32 summation order: 1e-5)."""
    for job in ("policy", "critic"):
        if f"{case}/{job}" not in unequal_results[0]:  # GRPO has no critic
            continue
        for rank in unequal_results:
            result = rank[f"{case}/{job}"]
            assert result["moved"] > 1e-3, f"{job}: the update did not move the weights"
            assert result["max_diff"] < 1e-5, (job, result)
            if case.endswith("_bounded"):  # the step was cut, by the KL summed over both processes
                assert 0 < result["step_scale"] < 1, result
        assert unequal_results[0][f"{case}/{job}"]["hash"] == unequal_results[1][f"{case}/{job}"]["hash"]


def test_an_adapter_with_no_rows_on_any_process_is_skipped_on_all(unequal_results):
    for rank in unequal_results:
        for job in ("policy", "critic"):
            result = rank[f"APPO_0/{job}"]
            assert result["moved"] == 0 and result["max_diff"] == 0 and result["skipped_updates"] >= 1, (job, result)


# ---------------------------------------------------------------------- checkpoints
def weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {f"{f.relative_to(checkpoint)}/{k}": v for f in sorted(checkpoint.rglob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.slow
def test_resume_with_two_processes_is_exact(random_model_dir, tmp_path):
    """2N iterations in one go == N, stop, resume N more (both with 2 processes): weights, env states, RNG states."""
    N = 2
    one_go, stopped = tmp_path / "one_go", tmp_path / "stopped"
    for out, argv in [
        (tmp_path / "a", flags(random_model_dir, 2 * N, one_go, "--lr_schedule", "constant")),  # N extended to 2N: no decay over N
        (tmp_path / "b", flags(random_model_dir, N, stopped, "--lr_schedule", "constant")),
        (tmp_path / "c", ["--load_path", str(stopped), "--num_env_steps", str(E * 2 * N)]),
    ]:
        done = train(out, argv)
        assert done.returncode == 0, workers_said(done)
    expected, resumed = weights(one_go / "checkpoints" / f"steps_{2 * N}"), weights(stopped / "checkpoints" / f"steps_{2 * N}")
    assert expected.keys() == resumed.keys() and len(expected) > 4
    for name in expected:
        torch.testing.assert_close(resumed[name], expected[name], rtol=0, atol=1e-6, msg=name)
    expected_state = json.loads((one_go / "checkpoints" / f"steps_{2 * N}" / "trainer_state.json").read_text())
    resumed_state = json.loads((stopped / "checkpoints" / f"steps_{2 * N}" / "trainer_state.json").read_text())
    assert expected_state["world_size"] == 2 and len(expected_state["envs"]) == E and len(expected_state["rank_rng"]) == 2
    for key in ("iteration", "env_steps", "counters", "episode_returns", "envs", "rank_rng"):
        assert resumed_state[key] == expected_state[key], key
    assert expected_state["rank_rng"][0]["torch"] != expected_state["rank_rng"][1]["torch"], "both processes sampled alike"

    # the same checkpoint with one process: a clear error, nothing trained
    assert main(["--load_path", str(stopped), "--num_env_steps", str(E * (2 * N + 1))]) == 1
    assert not (stopped / "checkpoints" / f"steps_{2 * N + 1}").exists()


@pytest.mark.slow
def test_resuming_with_another_process_count_says_so(random_model_dir, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(flags(random_model_dir, 1, run)) == 0  # one process
    done = train(tmp_path / "out", ["--load_path", str(run), "--num_env_steps", str(E * 2)])
    assert done.returncode != 0
    assert "saved by a run of 1 process(es) and this run has 2" in done.stderr, workers_said(done)


def test_envs_must_split_evenly(random_model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert main(flags(random_model_dir, 1, tmp_path / "run")) == 2
    err = capsys.readouterr().err
    assert "--n_rollout_threads 4 cannot be split over 3 processes" in err, err


# ---------------------------------------------------------------------- a process dies
@pytest.mark.slow
def test_killing_one_process_stops_the_other_and_the_run_resumes(random_model_dir, tmp_path):
    run, out = tmp_path / "run", tmp_path / "out"
    out.mkdir()
    child = subprocess.Popen(
        [*TORCHRUN, str(WORKER), "train", str(out), "--", *flags(random_model_dir, 200, run, "--save_interval", "1", "--dist_timeout_s", "30")],
        env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while find_checkpoint_or_none(run, 2) is None:
            assert child.poll() is None, child.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the run never saved its second checkpoint"
            time.sleep(0.2)
        os.kill(int((out / "pid1").read_text()), signal.SIGKILL)
        killed = time.monotonic()
        child.wait(timeout=120)
        stopped_after = time.monotonic() - killed
    finally:
        child.kill()
        child.wait()
    assert child.returncode != 0
    assert stopped_after < 60, f"the surviving process took {stopped_after:.0f} s to stop"

    checkpoint = find_checkpoint(run)  # complete checkpoints only; a save cut short is a hidden partial folder
    read_checkpoint_meta(checkpoint)  # every file matches the manifest
    done_iterations = int(checkpoint.name.split("_")[1])
    assert done_iterations >= 2
    done = train(tmp_path / "resumed", ["--load_path", str(run), "--num_env_steps", str(E * (done_iterations + 1))])
    assert done.returncode == 0, workers_said(done)
    assert (run / "checkpoints" / f"steps_{done_iterations + 1}").is_dir()
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")], "a partial checkpoint was left"
    first, second = ranks(tmp_path / "resumed")
    assert first["hash"] == second["hash"]


def find_checkpoint_or_none(run: Path, at_least: int):
    try:
        checkpoint = find_checkpoint(run)
    except FileNotFoundError:
        return None
    return checkpoint if int(checkpoint.name.split("_")[1]) >= at_least else None


# ---------------------------------------------------------------------- it learns with 2 processes
ITERATIONS, N_ENVS, EPISODE_LENGTH, WINDOW, MARGIN = 48, 16, 2, 8, 0.3
"""As ``tests/integration/test_learning.py`` (one process): the same total envs and iterations, split over 2 processes."""


@pytest.mark.slow
def test_two_processes_learn_relay_sum_with_identical_weights(tmp_path):
    run = tmp_path / "run"
    done = train(tmp_path / "out", [
        "--env_name", "relay_sum", "--max_new_tokens", "16", "--context_window", "256", "--lr", "1e-3", "--critic_lr", "1e-3",
        "--ppo_epoch", "2", "--n_rollout_threads", str(N_ENVS), "--episode_length", str(EPISODE_LENGTH),
        "--num_env_steps", str(N_ENVS * EPISODE_LENGTH * ITERATIONS), "--eval_episodes", "2", "--n_eval_threads", "1",
        "--output_dir", str(run),
        "--kl_coef", "0",  # the margin is the learning speed without the KL (48 iterations); its 2-process path: dist_worker's update test
    ], timeout=900)
    assert done.returncode == 0, workers_said(done)
    first, second = ranks(tmp_path / "out")
    assert first["hash"] == second["hash"], "the processes ended with different weights"
    events = EventAccumulator(str(run / "logs"), size_guidance={"scalars": 0})
    events.Reload()
    rewards = [point.value for point in events.Scalars("charts/step_reward")]
    assert len(rewards) == ITERATIONS
    gain = sum(rewards[-WINDOW:]) / WINDOW - sum(rewards[:WINDOW]) / WINDOW
    assert gain > MARGIN, [round(r, 3) for r in rewards]


# ---------------------------------------------------------------------- the GPU path's memory flag
def test_gradient_checkpointing_recomputes_layers_and_gives_the_same_update(random_model_dir, tmp_path, one_thread):
    """``--gradient_checkpointing``: the decoder layers are checkpointed in the update only (not in the rollout), and
    the update is the one without it."""
    from marft.config import AlgoConfig, EnvConfig, ModelConfig, RunnerConfig, TrainConfig
    from marft.launch import build_runner

    results, calls = {}, []
    for checkpointing in (False, True):
        config = TrainConfig(
            model=ModelConfig(model_name_or_path=random_model_dir, max_new_tokens=6, context_window=128, gradient_checkpointing=checkpointing),
            env=EnvConfig(env_name="dense_relay_sum", horizon=2),
            algo=AlgoConfig(algorithm_name="TPPO", ppo_epoch=1),
            runner=RunnerConfig(n_rollout_threads=2, episode_length=1, num_env_steps=2, output_dir=str(tmp_path / str(checkpointing))),
        )
        runner = build_runner(config)
        for layer in runner.team.bank.checkpointed_layers:
            recompute = layer._gradient_checkpointing_func
            layer._gradient_checkpointing_func = lambda *a, _f=recompute, **k: calls.append(1) or _f(*a, **k)
        buffer, _ = runner.collector.collect()
        assert len(calls) == 0, "checkpointing in the rollout"
        runner.trainer.compute_advantages(buffer)
        runner.trainer.update(buffer, 0)
        results[checkpointing] = {n: p.detach().clone() for n, p in runner.team.model.named_parameters() if "lora_" in n}
    assert len(calls) > 0, "no layer was checkpointed in the update"
    for name, value in results[False].items():
        torch.testing.assert_close(results[True][name], value, rtol=0, atol=1e-6, msg=name)
