"""``--lr_schedule``: the learning rates every optimizer steps with, per iteration, and an exact resume mid-decay.

Runs go through ``marft.cli.train.main`` on the tiny random model with the checkpoint tests' flags (2 envs, one team
step per iteration), saving checkpoints whose ``optimizers.pt`` holds the rate of the last iteration's step."""

import shutil

import pytest
import torch
from test_checkpoint import E, flags, scalars, weights

from marft.cli.train import main
from marft.config import AlgoConfig

pytestmark = pytest.mark.usefixtures("one_thread")

ITERATIONS = 4


def saved_rates(checkpoint) -> dict[str, list[float]]:
    """The distinct learning rates in a checkpoint's optimizer states: ``policy`` and ``critic``."""
    state = torch.load(checkpoint / "optimizers.pt", weights_only=True)
    critics = state.get("critic_optimizers") or {"critic": state["critic_optimizer"]}
    return {
        "policy": sorted({round(g["lr"], 12) for opt in state["policy_optimizers"].values() for g in opt["param_groups"]}),
        "critic": sorted({round(g["lr"], 12) for opt in critics.values() for g in opt["param_groups"]}),
    }


def test_an_unknown_schedule_is_a_clear_error():
    with pytest.raises(ValueError, match="lr_schedule.*constant.*linear"):
        AlgoConfig(lr_schedule="cosine")


def expected_scale(schedule: str, warmup: int, i: int) -> float:
    """The factor on the configured rates at iteration ``i`` (0-based) of ``ITERATIONS``, written out."""
    decay = 1 - i / ITERATIONS if schedule == "linear" else 1.0
    return decay * (min(1.0, (i + 1) / warmup) if warmup else 1.0)


@pytest.mark.parametrize("schedule, warmup", [("constant", 0), ("linear", 0), ("linear", 3), ("constant", 2)])
def test_every_optimizer_steps_at_the_scheduled_rate(random_model_dir, tmp_path, schedule, warmup):
    """Iteration i (0-based) of n steps the agents' and the critic's optimizers at their rate x (1 - i / n) under
    linear, x 1 under constant, times (i + 1) / w during --lr_warmup_iterations w; the decayed run ends elsewhere than
    the constant one (the schedule is applied)."""
    run = tmp_path / f"{schedule}_{warmup}"
    assert main(flags(random_model_dir, ITERATIONS, run, "--lr_schedule", schedule, "--lr", "2e-3", "--critic_lr", "4e-3",
                      "--lr_warmup_iterations", str(warmup), "--save_interval", "1", "--keep_checkpoints", str(ITERATIONS))) == 0
    for done in range(1, ITERATIONS + 1):
        scale = expected_scale(schedule, warmup, done - 1)
        rates = saved_rates(run / "checkpoints" / f"steps_{done}")
        assert rates["policy"] == pytest.approx([2e-3 * scale]) and rates["critic"] == pytest.approx([4e-3 * scale]), done
    logged = sorted(scalars(run)["charts/learning_rate"].items())
    assert [rate for _, rate in logged] == pytest.approx([2e-3 * expected_scale(schedule, warmup, i) for i in range(ITERATIONS)])


def test_a_negative_warmup_is_a_clear_error():
    with pytest.raises(ValueError, match="--lr_warmup_iterations must be >= 0, got -1"):
        AlgoConfig(lr_warmup_iterations=-1)


def test_the_schedule_changes_what_is_learned(random_model_dir, tmp_path):
    ends = {}
    for schedule in ("constant", "linear"):
        run = tmp_path / schedule
        assert main(flags(random_model_dir, ITERATIONS, run, "--lr_schedule", schedule)) == 0
        ends[schedule] = weights(run / "checkpoints" / f"steps_{ITERATIONS}")
    assert any(not torch.equal(ends["constant"][k], ends["linear"][k]) for k in ends["constant"])


def test_a_run_resumed_mid_decay_ends_where_the_uninterrupted_run_ends(random_model_dir, tmp_path):
    """A checkpoint halfway through a linear decay, resumed with the same --num_env_steps (a preempted run): the same
    weights as the run that never stopped (the rate of an iteration depends on that iteration alone)."""
    one_go = tmp_path / "one_go"
    half = ITERATIONS // 2
    assert main(flags(random_model_dir, ITERATIONS, one_go, "--lr_schedule", "linear", "--save_interval", str(half))) == 0
    stopped = tmp_path / "stopped"
    shutil.copytree(one_go, stopped)
    shutil.rmtree(stopped / "checkpoints" / f"steps_{ITERATIONS}")
    assert main(["--load_path", str(stopped / "checkpoints" / f"steps_{half}"), "--num_env_steps", str(E * ITERATIONS)]) == 0
    expected, resumed = weights(one_go / "checkpoints" / f"steps_{ITERATIONS}"), weights(stopped / "checkpoints" / f"steps_{ITERATIONS}")
    assert expected.keys() == resumed.keys() and len(expected) > 4
    for name in expected:
        torch.testing.assert_close(resumed[name], expected[name], rtol=0, atol=1e-6, msg=name)
    assert saved_rates(stopped / "checkpoints" / f"steps_{ITERATIONS}")["policy"] == pytest.approx([1e-3 / ITERATIONS])
