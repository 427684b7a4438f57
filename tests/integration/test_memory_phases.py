"""``scripts/memory_phases.py``: one JSON line with the peak resident memory of each phase of an iteration."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "memory_phases.py"


@pytest.mark.slow
def test_reports_each_phase_peak_the_live_tensors_and_another_team_size():
    flags = ["--model", "random", "--hidden_size", "64", "--num_layers", "2", "--n_rollout_threads", "4", "--repeats", "1", "--versus_agents", "3"]
    done = subprocess.run([sys.executable, str(SCRIPT), *flags], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert {"generate", "critic_values", "update_critic", "update_policy"} <= set(result["phase_peak_mib"])
    assert result["peak_mib"] == max(result["phase_peak_mib"].values()) >= result["resident_mib"] * 0.5
    assert 0 < result["params_mib"] <= result["live_tensor_mib"] < result["peak_mib"]
    assert result["n_agents"] == 2 and result["bench"] == "memory_phases"
    other = result["versus"]  # the same flags with --n_agents 3, in a process of its own
    phases = {"generate", "critic_values", "update_critic", "update_policy"}  # a phase shorter than the sampling interval may be missing
    assert other["n_agents"] == 3 and other["peak_mib"] > 0 and phases <= set(other["phase_peak_mib"])
    assert (other["model"], other["n_envs"]) == (result["model"], result["n_envs"]) == ("random-h64-l2", 4)  # the parent's other flags
    assert other["params_mib"] > result["params_mib"]  # a third agent's adapter
    assert result["extra_model_copies"] == round((result["peak_mib"] - other["peak_mib"]) / other["params_mib"], 3)
