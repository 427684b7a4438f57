"""``scripts/memory_phases.py``: one JSON line with the peak resident memory of each phase of an iteration."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "memory_phases.py"


@pytest.mark.slow
def test_reports_each_phase_peak_and_the_live_tensors():
    flags = ["--model", "random", "--hidden_size", "64", "--num_layers", "2", "--n_rollout_threads", "4", "--repeats", "1"]
    done = subprocess.run([sys.executable, str(SCRIPT), *flags], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert {"generate", "critic_values", "update_critic", "update_policy"} <= set(result["phase_peak_mib"])
    assert result["peak_mib"] == max(result["phase_peak_mib"].values()) >= result["resident_mib"] * 0.5
    assert 0 < result["params_mib"] <= result["live_tensor_mib"] < result["peak_mib"]
    assert result["n_agents"] == 2 and result["bench"] == "memory_phases"
