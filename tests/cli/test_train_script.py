"""The entry point: bad input stops early with one clear line; a subprocess smoke run of train_math.sh."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import marft.models.loading
from marft.cli.train import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if anything tries to load a model."""

    def forbidden(*args, **kwargs):
        raise AssertionError("a model was loaded before the inputs were validated")

    monkeypatch.setattr(marft.models.loading, "load_base_model", forbidden)


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def run_main(argv, capsys):
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    return code, err


@pytest.mark.parametrize(
    "case",
    ["missing_model", "agent_count", "missing_dataset", "empty_dataset", "no_usable_rows", "profile_without_role", "missing_load_path"],
)
def test_bad_input_stops_with_one_clear_line(case, tmp_path, capsys, no_model_load):
    argv = ["--output_dir", str(tmp_path / "run")]
    expected = {
        "missing_model": (["--model_name_or_path", str(tmp_path / "nope")], "does not exist"),
        "agent_count": (["--n_agents", "3"], "--n_agents"),
        "missing_dataset": (["--dataset_path", str(tmp_path / "missing.jsonl")], "missing.jsonl"),
        "empty_dataset": (["--dataset_path", write(tmp_path / "empty.jsonl", "")], "empty.jsonl"),
        "no_usable_rows": (["--dataset_path", write(tmp_path / "bad.jsonl", '{"problem": "1+1"}\n{"question": "x"}\n')], "bad.jsonl"),
        "profile_without_role": (["--profile_path", write(tmp_path / "p.json", json.dumps([{"prompt": "hi", "with_answer": True}, {"role": "B", "prompt": "", "with_answer": True}]))], "role"),
        "missing_load_path": (["--load_path", str(tmp_path / "steps_9")], "steps_9"),
    }[case]
    code, err = run_main(argv + expected[0], capsys)
    assert code == 2
    assert len(err) == 1 and err[0].startswith("error:") and expected[1] in err[0], err


def test_rows_without_answer_are_skipped_and_counted(tmp_path, caplog):
    from marft.envs.math import load_problems

    path = write(tmp_path / "mixed.jsonl", '{"problem": "1+1", "answer": "2"}\n{"problem": "2+2"}\n{"problem": "3+3", "solution": "so \\\\boxed{6}"}\n')
    rows = load_problems(path)
    assert [r["answer"] for r in rows] == ["2", "6"]
    assert "line 2" in caplog.text


@pytest.mark.slow
def test_train_math_sh_smoke_run(random_model_dir, tmp_path):
    """The shell entry point end to end with tiny settings, both algorithms share it; called from another folder, its
    relative paths are that folder's (the run lands there, not in the checkout)."""
    out = tmp_path / "run"
    env = {**os.environ, "PYTHON": sys.executable}
    cmd = [
        "bash", str(ROOT / "scripts" / "train_math.sh"),
        "--model_name_or_path", random_model_dir, "--n_rollout_threads", "2", "--episode_length", "1",
        "--num_env_steps", "4", "--max_new_tokens", "4", "--context_window", "96", "--eval_episodes", "4",
        "--output_dir", "run", "--save_interval", "1",
    ]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "held-out accuracy before training" in result.stdout and "held-out accuracy after training" in result.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["iterations"] == 2
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["steps_1", "steps_2"]
    steps = out / "checkpoints" / "steps_2"
    assert {"reasoner", "actor", "critic"} <= {p.name for p in steps.iterdir() if p.is_dir()}
    assert list((out / "logs").glob("events.out.tfevents.*"))
    config = json.loads((out / "config.json").read_text())
    assert config["runner"]["n_rollout_threads"] == 2


def test_help_lists_original_flag_names():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "train_math.py"), "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0
    for flag in ["--algorithm_name", "--model_name_or_path", "--dataset_path", "--profile_path", "--n_agents", "--n_rollout_threads",
                 "--episode_length", "--num_env_steps", "--ppo_epoch", "--num_mini_batch", "--lr", "--critic_lr", "--max_new_tokens",
                 "--context_window", "--gradient_cp_steps", "--agent_iteration_interval", "--save_interval", "--seed", "--horizon", "--load_path"]:
        assert flag in result.stdout, flag


def test_a_run_that_builds_its_model_first_starts_like_a_cached_run(random_model_dir, tmp_path, monkeypatch):
    """Building the embedded model draws random numbers; the seed is set after loading, so the first run
    (build, then load) and every later run (cached) train the same adapters."""
    import random

    import numpy as np
    import torch
    from safetensors.torch import load_file

    load = marft.models.loading.load_base_model

    def load_after_drawing(config):
        random.random(), np.random.rand(), torch.rand(100)  # what a model build would consume
        return load(config)

    argv = ["--model_name_or_path", random_model_dir, "--env_name", "relay_sum", "--max_new_tokens", "6",
            "--context_window", "128", "--n_rollout_threads", "2", "--episode_length", "1", "--num_env_steps", "2",
            "--eval_episodes", "1", "--n_eval_threads", "1"]
    assert main([*argv, "--output_dir", str(tmp_path / "cached")]) == 0
    monkeypatch.setattr(marft.models.loading, "load_base_model", load_after_drawing)
    assert main([*argv, "--output_dir", str(tmp_path / "built")]) == 0
    for file in sorted((tmp_path / "cached" / "checkpoints" / "steps_1").rglob("*.safetensors")):
        built = load_file(tmp_path / "built" / file.relative_to(tmp_path / "cached"))
        for name, tensor in load_file(file).items():
            assert torch.equal(tensor, built[name]), (file.name, name)
