"""Keeping what was learned (issue 74): the best tracker on fake metric streams, and in runs whose training accuracy is
scripted: ``checkpoints/best`` (atomic, manifested, never pruned, exact across a preemption), the collapse warned
about, stopped at or rolled back from, and ``marft eval | export | play`` taking the best.

Runs: a tiny random model on ``dense_relay_sum`` (as ``test_preemption.py``), with ``charts/accuracy`` replaced by a
scripted stream, so a rise and a collapse happen where the test says."""

import json
import logging
import math
import signal

import pytest
import torch
from peft import get_peft_model_state_dict
from safetensors.torch import load_file
from test_checkpoint import weights
from test_preemption import flags, signal_at

import marft.runner.shared.collector as collector_module
from marft.cli.train import main
from marft.faults import ExitCode
from marft.runner.shared.best import BestTracker
from marft.runner.shared.checkpoint import find_checkpoint, read_trainer_state, trained_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

RISE_AND_FALL = [0.1, 0.5, 0.9, 1.0, 1.0, 0.9, 0.2, 0.1, 0.1, 0.0, 0.2, 0.3]
"""A run that reaches the optimum at iterations 4-5 and collapses from iteration 7 on."""
STREAM_LENGTH = len(RISE_AND_FALL)
RECOVERED = [0.1, 0.5, 0.9, 1.0, 1.0, 0.9, 0.2, 0.9, 1.0, 0.9, 1.0, 1.0]
"""As RISE_AND_FALL to iteration 7, and good again after the rollback there."""


# ---------------------------------------------------------------------- the tracker alone
def judge(stream, **kwargs):
    tracker = BestTracker(**kwargs)
    return tracker, [tracker.observe(i + 1, a) for i, a in enumerate(stream)]


def test_the_best_is_the_highest_full_window_and_a_collapse_is_reported_once():
    tracker, marks = judge(RISE_AND_FALL, window=2, drop=0.3, min_gain=0.0, min_fill=2)
    assert [i + 1 for i, m in enumerate(marks) if m.new_best] == [2, 3, 4, 5]  # window means 0.3, 0.7, 0.95, 1.0
    assert tracker.best.iteration == 5 and tracker.best.moving_accuracy == 1.0
    assert [i + 1 for i, m in enumerate(marks) if m.collapsed] == [7]  # (0.9 + 0.2) / 2 = 0.55 <= 1.0 - 0.3: once
    assert tracker.collapses == 1 and tracker.in_collapse  # still down at the end: not reported again
    assert [round(m.moving_accuracy, 3) for m in marks[:3]] == [0.1, 0.3, 0.7]


def test_a_collapse_waits_for_a_full_window_after_the_best():
    """A single bad iteration right after the best is noise, not a collapse: the window must be full of iterations
    after the best."""
    tracker, marks = judge([1.0, 1.0, 1.0, 0.0, 1.0, 1.0], window=3, drop=0.4, min_gain=0.0, min_fill=3)
    assert not any(m.collapsed for m in marks)
    tracker, marks = judge([1.0, 1.0, 1.0, 0.0, 0.0, 0.0], window=3, drop=0.4, min_gain=0.0, min_fill=3)
    assert [i + 1 for i, m in enumerate(marks) if m.collapsed] == [6]


def test_recovering_and_falling_again_is_a_second_collapse_and_a_rollback_judges_afresh():
    stream = [1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    tracker, marks = judge(stream, window=2, drop=0.5, min_gain=0.0, min_fill=2)
    assert [i + 1 for i, m in enumerate(marks) if m.collapsed] == [4, 8]
    tracker = BestTracker(window=2, drop=0.5, min_gain=0.0, min_fill=2)
    for i, a in enumerate([1.0, 1.0, 0.0, 0.0]):
        tracker.observe(i + 1, a)
    tracker.rolled_back()
    assert math.isnan(tracker.moving_accuracy) and tracker.rollbacks == 1 and not tracker.in_collapse
    assert not tracker.observe(5, 0.0).collapsed  # one value after the rollback: the window is not full
    assert tracker.observe(6, 0.0).collapsed


def test_min_gain_and_nan_iterations():
    tracker, marks = judge([0.5, 0.505, 0.52, float("nan"), 0.525], window=1, drop=0.3, min_gain=0.01, min_fill=1)
    assert [m.new_best for m in marks] == [True, False, True, False, False]
    assert tracker.best.moving_accuracy == 0.52 and list(tracker.recent) == [0.525]


def test_the_state_round_trip_judges_as_an_uninterrupted_tracker():
    kwargs = dict(window=3, drop=0.3, min_gain=0.01, min_fill=3)
    _, whole = judge(RISE_AND_FALL, **kwargs)
    first = BestTracker(**kwargs)
    for i, a in enumerate(RISE_AND_FALL[:6]):
        first.observe(i + 1, a)
    first.observe_heldout(6, 0.75)
    second = BestTracker(**kwargs)
    second.load_state_dict(json.loads(json.dumps(first.state_dict())))  # through JSON, as in trainer_state.json
    assert second.last_heldout == (6, 0.75)
    assert [second.observe(i + 7, a) for i, a in enumerate(RISE_AND_FALL[6:])] == whole[6:]


# ---------------------------------------------------------------------- in a run, with a scripted accuracy
def scripted_accuracy(monkeypatch, stream):
    """Every training rollout reports the next value of ``stream`` as ``charts/accuracy``."""
    original = collector_module.RolloutCollector.collect
    position = {"i": 0}

    def collect(self, iteration):
        buffer, stats = original(self, iteration)
        stats["charts/accuracy"] = stream[position["i"] % len(stream)]
        position["i"] += 1
        return buffer, stats

    monkeypatch.setattr(collector_module.RolloutCollector, "collect", collect)


def run_flags(model_dir, run, *extra, iterations=STREAM_LENGTH):
    return flags(model_dir, run, "--collapse_window", "2", "--collapse_drop", "0.3", "--save_every_minutes", "0", "--kl_reference", "initial",
                 "--kl_coef", "0.1", *extra, iterations=iterations)


def test_rollback_restores_the_best_policy_refreshes_the_reference_and_lowers_the_rates(random_model_dir, tmp_path, monkeypatch, caplog):
    import marft.runner.shared.runner as runner_module

    scripted_accuracy(monkeypatch, RECOVERED)
    seen = {}
    original = runner_module.Runner.roll_back

    def roll_back(self, iteration, message):
        original(self, iteration, message)
        team = self.team
        state = lambda adapter: {k: v.detach().clone() for k, v in get_peft_model_state_dict(team.model, adapter_name=adapter).items()}  # noqa: E731
        seen["policy"] = {adapter: state(adapter) for adapter in team.policy_adapters}
        seen["reference"] = {adapter: state(reference) for adapter, reference in team.reference_adapters.items()}
        seen["iteration"] = iteration + 1
        seen["lr_factor"] = self.trainer.lr_factor
        seen["team"] = team

    monkeypatch.setattr(runner_module.Runner, "roll_back", roll_back)
    run = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="marft.runner.shared"):
        assert main(run_flags(random_model_dir, run, "--keep_checkpoints", "1")) == 0
    best = run / "checkpoints" / "best"
    state = read_trainer_state(best)
    assert state["iteration"] == 5 and state["best_tracker"]["best"]["moving_accuracy"] == 1.0
    assert (best / "manifest.json").is_file()
    assert seen["iteration"] == 7 and seen["lr_factor"] == 0.5
    assert len(seen["policy"]) == 2 and seen["reference"].keys() == seen["policy"].keys()
    for adapter, policy in seen["policy"].items():  # the adapters are the best's again, and each its own KL reference
        saved = load_file(best / adapter / "adapter_model.safetensors")
        assert saved.keys() == policy.keys() and len(saved) > 2
        for name, tensor in policy.items():
            torch.testing.assert_close(tensor, saved[name], rtol=0, atol=0)
            torch.testing.assert_close(seen["reference"][adapter][name], tensor, rtol=0, atol=0)
    final_dir = run / "checkpoints" / f"steps_{STREAM_LENGTH}"
    for adapter in seen["policy"]:  # the best was evaluated at the end, and the team left the run with its final policy
        saved = load_file(final_dir / adapter / "adapter_model.safetensors")
        for name, tensor in get_peft_model_state_dict(seen["team"].model, adapter_name=adapter).items():
            torch.testing.assert_close(tensor, saved[name], rtol=0, atol=0)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["best_iteration"] == 5 and summary["rollbacks"] == 1 and summary["collapses"] == 1
    assert summary["best_checkpoint"] == str(best) and summary["best_heldout_accuracy"] is not None
    assert summary["stopped_by_collapse"] is False and summary["iterations"] == len(RISE_AND_FALL)
    seconds = summary["seconds"]  # the best's saves and the rollback were timed, within the iterations' time
    assert 0 < seconds["keep_best"] < seconds["iterations"]
    final = torch.load(run / "checkpoints" / f"steps_{len(RISE_AND_FALL)}" / "optimizers.pt", weights_only=True)
    assert final["lr_factor"] == 0.5 and final["counters"]["rollbacks"] == 1
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["best", f"steps_{len(RISE_AND_FALL)}"]  # never pruned
    assert sum("collapse after iteration 7" in r.message and "rolled back" in r.message for r in caplog.records) == 1


def test_anchor_best_at_makes_each_good_enough_best_the_kl_reference(random_model_dir, tmp_path, monkeypatch):
    """``--anchor_best_at 0.9``: the bests at iterations 4 and 5 (moving 0.95, 1.0; not those at 0.3 and 0.7) become
    the KL references, saved with them; the references stay so through the collapse after (no new best)."""
    scripted_accuracy(monkeypatch, RISE_AND_FALL)
    run = tmp_path / "run"
    assert main(run_flags(random_model_dir, run, "--on_collapse", "warn", "--anchor_best_at", "0.9")) == 0
    best, final = run / "checkpoints" / "best", run / "checkpoints" / f"steps_{STREAM_LENGTH}"
    assert torch.load(final / "optimizers.pt", weights_only=True)["counters"]["reference_refreshes"] == 2
    adapters = [d.name.removeprefix("ref_") for d in best.iterdir() if d.name.startswith("ref_")]
    assert sorted(adapters) == ["actor", "reasoner"]  # the policies' references (the critic has none)
    for adapter in adapters:
        policy = load_file(best / adapter / "adapter_model.safetensors")
        for checkpoint in (best, final):
            reference = load_file(checkpoint / f"ref_{adapter}" / "adapter_model.safetensors")
            assert len(reference) == len(policy) > 2
            for (_, ref_tensor), (_, tensor) in zip(sorted(reference.items()), sorted(policy.items())):
                torch.testing.assert_close(ref_tensor, tensor, rtol=0, atol=0)
    plain = tmp_path / "plain"  # without the flag the reference is the start's: not the best policy
    assert main(run_flags(random_model_dir, plain, "--on_collapse", "warn")) == 0
    counters = torch.load(plain / "checkpoints" / f"steps_{STREAM_LENGTH}" / "optimizers.pt", weights_only=True)["counters"]
    assert "reference_refreshes" not in counters


def test_warn_goes_on_and_stop_ends_the_run_with_a_checkpoint(random_model_dir, tmp_path, monkeypatch, caplog):
    scripted_accuracy(monkeypatch, RISE_AND_FALL)
    with caplog.at_level(logging.WARNING, logger="marft.runner.shared"):
        assert main(run_flags(random_model_dir, tmp_path / "warn", "--on_collapse", "warn")) == 0
    warned = [r.message for r in caplog.records if "collapse after" in r.message]
    assert len(warned) == 1 and str(tmp_path / "warn" / "checkpoints" / "best") in warned[0] and "training goes on" in warned[0]
    summary = json.loads((tmp_path / "warn" / "summary.json").read_text())
    assert summary["collapses"] == 1 and summary["rollbacks"] == 0 and summary["iterations"] == len(RISE_AND_FALL)

    monkeypatch.undo()
    scripted_accuracy(monkeypatch, RISE_AND_FALL)
    assert main(run_flags(random_model_dir, tmp_path / "stop", "--on_collapse", "stop")) == 0
    summary = json.loads((tmp_path / "stop" / "summary.json").read_text())
    assert summary["stopped_by_collapse"] is True and summary["iterations"] == 7 and summary["best_iteration"] == 5
    assert find_checkpoint(tmp_path / "stop") == tmp_path / "stop" / "checkpoints" / "steps_7"


def test_a_preempted_run_keeps_the_same_best_as_an_uninterrupted_one(random_model_dir, tmp_path, monkeypatch):
    """Stopped in the middle (SIGTERM in the 6th update, after the best of iteration 5 was written) and resumed: the
    best checkpoint, the rollback and the summary's figures are those of the run in one go."""
    scripted_accuracy(monkeypatch, RISE_AND_FALL)
    assert main(run_flags(random_model_dir, tmp_path / "one_go")) == 0
    one_go = json.loads((tmp_path / "one_go" / "summary.json").read_text())

    monkeypatch.undo()
    scripted_accuracy(monkeypatch, RISE_AND_FALL)
    signal_at(monkeypatch, "update", 6, signal.SIGTERM)
    run = tmp_path / "stopped"
    assert main(run_flags(random_model_dir, run)) == ExitCode.PREEMPTED
    assert find_checkpoint(run).name == "steps_6" and read_trainer_state(run / "checkpoints" / "best")["iteration"] == 5
    monkeypatch.undo()
    scripted_accuracy(monkeypatch, RISE_AND_FALL[6:])  # the stream goes on where the stopped run left it
    assert main(["--load_path", str(run)]) == 0
    resumed = json.loads((run / "summary.json").read_text())
    for key in ("best_iteration", "best_moving_train_accuracy", "best_heldout_accuracy", "collapses", "rollbacks", "final_moving_train_accuracy"):
        assert resumed[key] == one_go[key], key
    want, have = weights(tmp_path / "one_go" / "checkpoints" / "best"), weights(run / "checkpoints" / "best")
    for name in want:
        torch.testing.assert_close(have[name], want[name], rtol=0, atol=0, msg=name)
    want, have = weights(tmp_path / "one_go" / "checkpoints" / f"steps_{len(RISE_AND_FALL)}"), weights(run / "checkpoints" / f"steps_{len(RISE_AND_FALL)}")
    for name in want:
        torch.testing.assert_close(have[name], want[name], rtol=0, atol=0, msg=name)


def test_eval_export_and_play_take_the_best_and_say_which(random_model_dir, tmp_path, monkeypatch, capsys):
    from marft.cli.eval import main as eval_main
    from marft.cli.export import main as export_main
    from marft.cli.play import main as play_main

    scripted_accuracy(monkeypatch, RISE_AND_FALL)
    run = tmp_path / "run"
    assert main(run_flags(random_model_dir, run, "--on_collapse", "warn")) == 0
    best, line = trained_checkpoint(run)
    assert best == run / "checkpoints" / "best" and "the run's best: iteration 5" in line
    latest, line = trained_checkpoint(run, "latest")
    assert latest == run / "checkpoints" / f"steps_{len(RISE_AND_FALL)}" and "the latest" in line
    assert trained_checkpoint(latest)[0] == latest
    with pytest.raises(ValueError, match="best or latest"):
        trained_checkpoint(run, "newest")
    capsys.readouterr()
    assert eval_main(["--load_path", str(run), "--episodes", "1", "--output_dir", str(tmp_path / "eval")]) == 0
    assert "checkpoint " + str(best) in capsys.readouterr().err
    assert json.loads((tmp_path / "eval" / "summary.json").read_text())["checkpoint"] == str(best)
    assert eval_main(["--load_path", str(run), "--checkpoint", "latest", "--episodes", "1", "--output_dir", str(tmp_path / "eval_latest")]) == 0
    assert "checkpoint " + str(latest) in capsys.readouterr().err
    assert export_main(["--load_path", str(run), "--output_dir", str(tmp_path / "export")]) == 0
    assert "checkpoint " + str(best) in capsys.readouterr().err
    assert json.loads((tmp_path / "export" / "team.json").read_text())["trained"]["checkpoint"] == str(best)
    assert play_main(["--load_path", str(run), "--checkpoint", "best", "what is 1 + 1?"]) == 0
    assert "checkpoint " + str(best) in capsys.readouterr().err
