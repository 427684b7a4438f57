"""Faults during training: non-finite updates are skipped and counted, repeated ones stop the run
(pointing to the last good checkpoint, never saving NaN weights), broken reward functions and
graders give reward 0, and out-of-memory errors say which flags reduce memory.

Runs use a tiny random model on ``dense_relay_sum`` (conftest; no grader process), 2 envs and 1 team step per iteration.
"""

import logging

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from marft.agents.team import AgentTeam
from marft.algorithms.appo_trainer import APPOTrainer
from marft.cli.train import main
from marft.config import AlgoConfig, EnvConfig, ModelConfig, RunnerConfig, TrainConfig
from marft.envs import make
from marft.envs.relay_sum.env import RelaySumEnv
from marft.envs.vector import TextVectorEnv
from marft.faults import TrainingStopped
from marft.launch import train

E = 2


pytestmark = pytest.mark.usefixtures("one_thread")


def config(model_dir, run_dir, iterations: int, env: str = "dense_relay_sum", **algo) -> TrainConfig:
    return TrainConfig(
        model=ModelConfig(model_name_or_path=model_dir, max_new_tokens=6, context_window=128),
        env=EnvConfig(env_name=env, horizon=2),
        algo=AlgoConfig(**algo),
        runner=RunnerConfig(
            n_rollout_threads=E, episode_length=1, num_env_steps=E * iterations, output_dir=str(run_dir),
            eval_episodes=1, n_eval_threads=1, save_interval=1,
        ),
    )


def last_scalar(run_dir, tag: str) -> float:
    events = EventAccumulator(str(run_dir / "logs"), size_guidance={"scalars": 0})
    events.Reload()
    return events.Scalars(tag)[-1].value


def all_finite(checkpoint) -> bool:
    from safetensors.torch import load_file

    return all(torch.isfinite(t).all() for f in checkpoint.rglob("*.safetensors") for t in load_file(f).values())


# ---------------------------------------------------------------------- non-finite updates
@pytest.mark.parametrize("where", ["logits", "logprobs", "advantages", "policy_loss", "value_loss"])
def test_one_nonfinite_minibatch_is_skipped_counted_and_logged(random_model_dir, tmp_path, monkeypatch, caplog, where):
    """NaN/inf injected once, in iteration 2: that minibatch is skipped, the run goes on and saves finite weights."""
    calls = {"n": 0}
    trainer_ref = []  # the run's trainer, for its current iteration

    def once(self) -> bool:
        if self.iteration == 1 and calls["n"] == 0:
            calls["n"] += 1
            return True
        return False

    if where == "logits":
        from marft.agents.generation import SamplingSettings

        original = SamplingSettings.scoring_logits

        def scoring_logits(self, logits):
            out = original(self, logits)
            if torch.is_grad_enabled() and trainer_ref and once(trainer_ref[0]):
                out = out.clone()
                out[..., 0] = float("inf")
            return out

        monkeypatch.setattr(SamplingSettings, "scoring_logits", scoring_logits)
    elif where == "logprobs":
        original = AgentTeam.response_logprobs

        def response_logprobs(self, *args, **kwargs):
            scores = original(self, *args, **kwargs)
            if torch.is_grad_enabled() and trainer_ref and once(trainer_ref[0]):
                scores.logprobs = scores.logprobs * float("nan")
            return scores

        monkeypatch.setattr(AgentTeam, "response_logprobs", response_logprobs)
    elif where == "advantages":
        original = APPOTrainer.normalized_advantages

        def normalized_advantages(self, samples):
            samples = original(self, samples)
            if once(self):
                samples = samples.replace(advantages=samples.advantages.clone())
                samples.advantages[0] = float("nan")
            return samples

        monkeypatch.setattr(APPOTrainer, "normalized_advantages", normalized_advantages)
    else:
        name = where
        original = getattr(APPOTrainer, name)

        def loss(self, *args):
            out = original(self, *args)
            if once(self):
                return (out[0] * float("nan"), *out[1:]) if isinstance(out, tuple) else out * float("inf")
            return out

        monkeypatch.setattr(APPOTrainer, name, loss)

    original_init = APPOTrainer.__init__

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        trainer_ref.append(self)

    monkeypatch.setattr(APPOTrainer, "__init__", init)
    with caplog.at_level(logging.WARNING):
        summary = train(config(random_model_dir, tmp_path, 3))
    assert calls["n"] == 1
    assert trainer_ref[0].counters["skipped_minibatches"] >= 1
    assert last_scalar(tmp_path, "counters/skipped_minibatches") == trainer_ref[0].counters["skipped_minibatches"]
    assert "iteration 2" in caplog.text and "skipped a minibatch with a non-finite" in caplog.text
    assert summary["iterations"] == 3 and all_finite(tmp_path / "checkpoints" / "steps_3")


def test_repeated_nonfinite_updates_stop_at_the_last_good_checkpoint(random_model_dir, tmp_path, monkeypatch, capsys):
    """From iteration 3 on every policy loss is NaN: iteration 3 skips 2 policy minibatches per agent (the
    policy weights stay as they were, the critic trains, steps_3 is saved), iteration 4 reaches 3 skips in
    a row and stops, naming steps_3 and writing no checkpoint after it."""
    original = APPOTrainer.policy_loss

    def policy_loss(self, adapter, mb):
        loss, entropy, stats = original(self, adapter, mb)
        return (loss * float("nan") if self.iteration >= 2 else loss), entropy, stats

    monkeypatch.setattr(APPOTrainer, "policy_loss", policy_loss)
    run = tmp_path / "run"
    argv = [
        "--model_name_or_path", random_model_dir, "--env_name", "dense_relay_sum", "--max_new_tokens", "6", "--context_window", "128",
        "--n_rollout_threads", str(E), "--episode_length", "1", "--num_env_steps", str(E * 6), "--eval_episodes", "1",
        "--n_eval_threads", "1", "--save_interval", "1", "--keep_checkpoints", "0", "--ppo_epoch", "2", "--max_consecutive_skips", "3", "--output_dir", str(run),
    ]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    good = run / "checkpoints" / "steps_3"
    assert err.startswith("error: Training stopped: iteration 4:") and "3 minibatches in a row" in err, err
    assert f"--load_path {good}" in err, err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["steps_1", "steps_2", "steps_3"]
    assert all(all_finite(p) for p in (run / "checkpoints").iterdir())
    assert last_scalar(run, "counters/skipped_minibatches") == 5


def test_nan_weights_are_never_saved(random_model_dir, tmp_path, monkeypatch):
    """If weights turn non-finite anyway, the save refuses, and the stop names the last good checkpoint."""
    original = APPOTrainer.update

    def update(self, buffer, iteration):
        metrics = original(self, buffer, iteration)
        if iteration == 1:
            with torch.no_grad():
                self.team.adapter_parameters(self.team.policy_adapters[-1])[0].fill_(float("nan"))
        return metrics

    monkeypatch.setattr(APPOTrainer, "update", update)
    with pytest.raises(TrainingStopped, match="refusing to save checkpoint steps_2: non-finite weights in .*actor") as stop:
        train(config(random_model_dir, tmp_path, 3))
    assert f"--load_path {tmp_path / 'checkpoints' / 'steps_1'}" in str(stop.value)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["steps_1"]


# ---------------------------------------------------------------------- reward functions and graders
def test_a_reward_function_that_raises_gives_reward_zero(random_model_dir, tmp_path, monkeypatch, caplog):
    original = RelaySumEnv.evaluate
    calls = {"n": 0}

    def flaky(self, state, actions):
        calls["n"] += 1
        if calls["n"] % 3 == 0:
            raise ZeroDivisionError("reward function bug")
        return original(self, state, actions)

    monkeypatch.setattr(RelaySumEnv, "evaluate", flaky)
    with caplog.at_level(logging.WARNING):
        summary = train(config(random_model_dir, tmp_path, 4, env="relay_sum"))
    assert summary["iterations"] == 4
    failures = calls["n"] // 3
    assert "reward failed (reward 0" in caplog.text and "ZeroDivisionError: reward function bug" in caplog.text
    # training envs count their failures (evaluation envs fail too, but are not counted)
    assert 1 <= last_scalar(tmp_path, "counters/reward_failures") <= failures


def test_env_step_with_a_raising_reward_function():
    env = make("relay_sum", split="train", horizon=2)
    env.evaluate = lambda state, actions: 1 / 0
    env.reset(seed=0)
    obs, rewards, terminated, truncated, info = env.step(["a", "b"])
    assert rewards.tolist() == [0.0, 0.0] and not terminated and info["correct"] is False
    assert info["reward_error"].startswith("ZeroDivisionError") and env.reward_failures == 1


class BrokenGrader:
    """Raises on one reply (as a crash or a timeout of a grader would) and grades the rest."""

    def grade(self, response, ground_truth):
        if "hang" in response:
            raise TimeoutError("grading took longer than 5 s")
        return response.endswith(f"\\boxed{{{ground_truth}}}")


def test_a_grader_that_fails_on_one_episode_gives_it_reward_zero(caplog):
    envs = TextVectorEnv([lambda: make("math", grader=BrokenGrader())] * 2)
    envs.reset(seed=0)
    answers = [env.episode.answer for env in envs.envs]
    with caplog.at_level(logging.WARNING):
        _, rewards, terminated, truncated, infos = envs.step([["", "\\boxed{hang}"], ["", f"\\boxed{{{answers[1]}}}"]])
    assert rewards.tolist() == [[0.0, 0.0], [1.0, 1.0]] and terminated.tolist() == [True, True] and not truncated.any()
    assert "TimeoutError" in infos["final_info"]["grading_error"][0] and "grading failed" in caplog.text
    assert envs.failures() == 1


# ---------------------------------------------------------------------- out of memory
def test_out_of_memory_names_batch_sizes_and_flags(random_model_dir, tmp_path, monkeypatch):
    def update(self, buffer, iteration):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(APPOTrainer, "update", update)
    cfg = config(random_model_dir, tmp_path, 2, num_mini_batch=2, gradient_cp_steps=1)
    with pytest.raises(torch.OutOfMemoryError) as error:
        train(cfg)
    message = str(error.value)
    for expected in ("iteration 1", "2 turns per agent", "4 for the critic", "minibatch 1 (--num_mini_batch 2)",
                     "--gradient_cp_steps 1", "--max_chunk_tokens", "--max_new_tokens 6", "Tried to allocate 2.00 GiB"):
        assert expected in message, (expected, message)
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())
