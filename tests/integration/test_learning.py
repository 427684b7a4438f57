"""It learns: a short MARFT-A run on the cooperative ``relay_sum`` task raises the team's reward.

This is the shortened ``python scripts/benchmark.py learning`` run: the embedded tiny model (built once
and cached, see ``marft.models.tiny``), a 2-agent Reasoner → Actor team, a fixed seed, through
``marft.launch.train`` (runner, buffer, agent-chain GAE, APPO trainer). Only the Reasoner sees the hidden
key, so the team's reward rises only if the policy gradient reaches both agents through the shared
conversation. The team reward of each iteration is read back from the TensorBoard logs.

The controls run the same training with the policy gradient's sign flipped, and with the advantages
zeroed; the check must fail for both, which shows that it measures learning, not drift or luck.
"""

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from marft.algorithms.appo_trainer import APPOTrainer
from marft.config import AlgoConfig, EnvConfig, ModelConfig, RunnerConfig, TrainConfig
from marft.launch import train

ITERATIONS = 128
N_ENVS = 16
EPISODE_LENGTH = 2
WINDOW = 8
MARGIN = 0.3
"""The mean reward of the last ``WINDOW`` iterations must beat that of the first by this much; the controls (the
gradient's sign flipped, zero advantages) must stay below half of it."""


def step_rewards(tmp_path) -> list[float]:
    """Train ``ITERATIONS`` iterations of ``N_ENVS`` x ``EPISODE_LENGTH`` one-step episodes; the mean team reward of each rollout."""
    config = TrainConfig(
        model=ModelConfig(max_new_tokens=16, context_window=256),
        env=EnvConfig(env_name="relay_sum"),
        algo=AlgoConfig(algorithm_name="APPO", lr=1e-3, critic_lr=1e-3, ppo_epoch=2),
        runner=RunnerConfig(
            n_rollout_threads=N_ENVS, episode_length=EPISODE_LENGTH, num_env_steps=N_ENVS * EPISODE_LENGTH * ITERATIONS,
            seed=0, output_dir=str(tmp_path), eval_episodes=1, n_eval_threads=1,
        ),
    )
    train(config)
    events = EventAccumulator(str(tmp_path / "logs"), size_guidance={"scalars": 0})
    events.Reload()
    rewards = [point.value for point in events.Scalars("charts/step_reward")]
    assert len(rewards) == ITERATIONS
    return rewards


def improvement(rewards: list[float]) -> float:
    """Mean reward of the last ``WINDOW`` iterations minus that of the first ``WINDOW``."""
    return sum(rewards[-WINDOW:]) / WINDOW - sum(rewards[:WINDOW]) / WINDOW


@pytest.mark.slow
def test_appo_raises_the_team_reward(tmp_path):
    rewards = step_rewards(tmp_path)
    assert improvement(rewards) > MARGIN, [round(r, 3) for r in rewards]


def _mutate_advantages(monkeypatch, how):
    original = APPOTrainer.normalized_advantages

    def mutated(self, samples):
        samples = original(self, samples)
        return samples.replace(advantages=how(samples.advantages))

    monkeypatch.setattr(APPOTrainer, "normalized_advantages", mutated)


@pytest.mark.parametrize(
    "mutation",
    [pytest.param(lambda a: -a, id="sign_flipped"), pytest.param(lambda a: a * 0.0, id="advantages_zeroed")],
)
@pytest.mark.slow
def test_the_check_fails_without_a_correct_policy_gradient(tmp_path, monkeypatch, mutation):
    """The controls: the same run with the policy gradient negated, or with zero advantages, must fail the check."""
    _mutate_advantages(monkeypatch, mutation)
    rewards = step_rewards(tmp_path)
    assert improvement(rewards) < MARGIN / 2, [round(r, 3) for r in rewards]
