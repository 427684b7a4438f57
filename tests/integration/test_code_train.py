"""A code-team run of scripts/train_math.sh --env_name code completes and checkpoints; scripts/train_code.sh
(dataset flags reach CodeEnv, parallel grading) resumes it with --load_path."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def train(args, script="train_math.sh", timeout=300):
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # this checkout's marft
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath}
    result = subprocess.run(["bash", str(ROOT / "scripts" / script), *args], env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.slow
def test_code_team_trains_checkpoints_and_resumes(random_model_dir, tmp_path):
    out = tmp_path / "run"
    common = ["--model_name_or_path", random_model_dir, "--env_name", "code", "--n_rollout_threads", "4", "--episode_length", "1",
              "--max_new_tokens", "8", "--context_window", "128", "--eval_episodes", "4", "--save_interval", "1"]
    first = train([*common, "--num_env_steps", "8", "--output_dir", str(out)])
    assert "held-out accuracy before training" in first.stdout and "held-out accuracy after training" in first.stdout
    assert json.loads((out / "summary.json").read_text())["iterations"] == 2
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name != "best") == ["steps_1", "steps_2"]
    envs = json.loads(next((out / "checkpoints" / "steps_2").rglob("trainer_state.json")).read_text())["envs"]
    assert len(envs) == 4 and all(env["episode"] is None or env["episode"]["type"] == "CodeState" for env in envs)
    assert all("missing_code_blocks" in env["counters"] for env in envs)  # the code env's own state is checkpointed

    train([*common, "--num_env_steps", "12", "--load_path", str(out / "checkpoints" / "steps_2"), "--dataset_path", "generated"],
          script="train_code.sh")
    assert json.loads((out / "summary.json").read_text())["iterations"] == 3
    assert (out / "checkpoints" / "steps_3").is_dir()
