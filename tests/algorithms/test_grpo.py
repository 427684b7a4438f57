"""Critic-free group-relative training (GRPO) and the reference KL: advantages against a hand table, group
construction, no critic anywhere in a GRPO run, rounds of whole episodes, the KL's zero and growth."""

from __future__ import annotations

import pytest
import torch

from marft.algorithms.advantages import group_relative_advantages
from marft.config import AlgoConfig, EnvConfig, ModelConfig, RunnerConfig, TrainConfig

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------- advantages
def test_group_relative_advantages_match_a_hand_table():
    """2 rounds of 1 step, 4 envs in groups of 2, 2 agents; returns are the mean reward over agents."""
    rewards = torch.tensor([
        [[1.0, 1.0], [0.0, 0.0], [0.5, 0.5], [0.5, 0.5]],  # round 0: group A returns 1, 0; group B 0.5, 0.5 (flat)
        [[0.0, 1.0], [1.0, 1.0], [0.0, 0.0], [1.0, 1.0]],  # round 1: group A 0.5, 1; group B 0, 1
    ])  # (T=2, E=4, N=2)
    active = torch.ones(2, 4, dtype=torch.bool)
    adv, returns, flat = group_relative_advantages(rewards, active, round_length=1, group_size=2, scale=True, eps=0.0)
    s = 2 ** -0.5  # unbiased std of two values that differ by d is d / sqrt(2)
    expected = torch.tensor([[0.5 / (s * 1.0), -0.5 / (s * 1.0), 0.0, 0.0],
                             [-0.25 / (s * 0.5), 0.25 / (s * 0.5), -0.5 / (s * 1.0), 0.5 / (s * 1.0)]])
    torch.testing.assert_close(adv, expected.unsqueeze(-1).expand(2, 4, 2))
    assert flat == 1  # group B of round 0
    torch.testing.assert_close(returns[..., 0], torch.tensor([[1.0, 0.0, 0.5, 0.5], [0.5, 1.0, 0.0, 1.0]]))
    centred, _, _ = group_relative_advantages(rewards, active, 1, 2, scale=False)
    torch.testing.assert_close(centred[..., 0], torch.tensor([[0.5, -0.5, 0.0, 0.0], [-0.25, 0.25, -0.5, 0.5]]))


def test_a_round_sums_the_played_steps_of_each_episode():
    """Rounds of 2 steps: env 1's episode ended after its first step (its second cell is not played)."""
    rewards = torch.tensor([[[0.0], [1.0]], [[1.0], [7.0]]])  # (T=2, E=2, N=1); env 1's 7.0 is after its end
    active = torch.tensor([[True, True], [True, False]])
    adv, returns, _ = group_relative_advantages(rewards, active, round_length=2, group_size=2, scale=False)
    torch.testing.assert_close(returns[..., 0], torch.tensor([[1.0, 1.0], [1.0, 0.0]]))  # both returns are 1
    torch.testing.assert_close(adv, torch.zeros_like(adv))


# ---------------------------------------------------------------------- runs
def grpo_config(model_dir, tmp_path, **algo) -> TrainConfig:
    return TrainConfig(
        model=ModelConfig(model_name_or_path=model_dir, max_new_tokens=6, context_window=128),
        env=EnvConfig(env_name="dense_relay_sum"),
        algo=AlgoConfig(algorithm_name="GRPO", group_size=2, **algo),
        runner=RunnerConfig(n_rollout_threads=6, episode_length=2, num_env_steps=24, eval_episodes=2, n_eval_threads=2,
                            output_dir=str(tmp_path / "run")),
    )


@pytest.fixture
def grpo_runner(random_model_dir, tmp_path):
    from marft.launch import build_runner

    return build_runner(grpo_config(random_model_dir, tmp_path))


def test_groups_share_one_task_and_groups_differ(grpo_runner):
    runner = grpo_runner
    for iteration in range(2):
        runner.collector.start_group_round(iteration, 1)
        tasks = [(env.unwrapped.episode.problem, env.unwrapped.episode.key) for env in runner.envs.envs]
        groups = [tasks[g : g + 2] for g in range(0, 6, 2)]
        assert all(a == b for a, b in groups)  # one task per group
        assert len({g[0] for g in groups}) == 3  # three different tasks
    runner.collector.start_group_round(0, 0)
    first = runner.collector.obs
    runner.collector.start_group_round(0, 0)
    assert runner.collector.obs == first  # the tasks depend on (seed, rank, iteration, round) only: a resume draws the same


def test_a_grpo_run_has_no_critic_anywhere(grpo_runner):
    from marft.agents.critic import CRITIC_ADAPTER

    runner = grpo_runner
    team, trainer = runner.team, runner.trainer
    assert not team.has_critic and team.critic is None and team.critic_adapters == []
    assert CRITIC_ADAPTER not in team.model.peft_config
    assert not any(CRITIC_ADAPTER in name.split(".") for name, _ in team.model.named_parameters())
    assert not trainer.critic_optimizers and not {"critic_optimizer", "critic_optimizers"} & set(trainer.state_dict())
    buffer, _ = runner.collector.collect(0)  # with no critic object, a critic forward anywhere in the rollout would fail here
    assert torch.equal(buffer.values, torch.zeros_like(buffer.values))
    before = {n: p.detach().clone() for n, p in team.model.named_parameters() if "lora_" in n}
    trainer.compute_advantages(buffer)
    metrics = trainer.update(buffer, 0)
    assert not any(k.startswith("critic/") for k in metrics)
    moved = {n.split("lora_")[1].split(".")[1] for n, p in team.model.named_parameters() if "lora_" in n and not torch.equal(p, before[n])}
    assert moved == set(team.policy_adapters)
    path = runner.save(1)
    assert not (path / "value_head.safetensors").exists() and not (path / CRITIC_ADAPTER).exists()
    assert sorted(p.name for p in path.iterdir() if p.is_dir()) == sorted(team.policy_adapters)


def test_episodes_that_end_early_sit_out_their_round(random_model_dir, tmp_path):
    """Rounds of horizon 2: relay_sum ends an episode when solved; on the random model nothing is solved, so
    force an end on env 0 after the first step and check that env 0 sits out step 2 (not generated, not stepped)."""
    from marft.launch import build_runner

    config = grpo_config(random_model_dir, tmp_path)
    config.env.horizon = 2
    runner = build_runner(config)
    env0 = runner.envs.envs[0].unwrapped
    original = env0.evaluate

    def solved_at_once(state, actions):
        outcome = original(state, actions)
        return type(outcome)(rewards=(5.0,) * env0.n_agents, solved=True, feedback="", info={"correct": True})

    env0.evaluate = solved_at_once
    buffer, _ = runner.collector.collect(0)
    assert buffer.active[:, 0].tolist() == [True, False] and buffer.active[:, 1:].all()
    assert buffer.response_mask[1, 0].sum() == 0  # nothing generated for env 0 at step 2
    runner.trainer.compute_advantages(buffer)
    assert (buffer.advantages[1, 0] == 0).all() and (buffer.advantages[0, 0] > 0).all()  # env 0 won its group (5 > two steps of at most 1)


def test_grpo_refuses_envs_without_tasks_and_bad_group_sizes(random_model_dir, tmp_path, clean_registry):
    from marft.launch import validate

    config = grpo_config(random_model_dir, tmp_path)
    config.algo.group_size = 4
    with pytest.raises(ValueError, match="--group_size 4 must divide --n_rollout_threads 6"):
        config.check()
    config = grpo_config(random_model_dir, tmp_path)
    config.env.horizon = 3
    with pytest.raises(ValueError, match="multiple of --horizon 3"):
        config.check()
    config = grpo_config(random_model_dir, tmp_path)
    config.env.env_name = "math"
    validate(config)  # the math env has a task list
    import marft.envs
    from marft.envs.relay_sum.env import RelaySumEnv

    class Endless(RelaySumEnv):
        num_tasks = None

    marft.envs.register("endless_relay_for_grpo_test", Endless)
    config.env.env_name = "endless_relay_for_grpo_test"
    with pytest.raises(ValueError, match="sets no num_tasks"):
        validate(config)


# ---------------------------------------------------------------------- reference KL
def test_the_reference_kl_is_zero_at_start_and_grows_as_adapters_move(random_model_dir, tmp_path):
    from marft.launch import build_runner

    config = grpo_config(random_model_dir, tmp_path, kl_coef=0.5)
    runner = build_runner(config)
    team, trainer = runner.team, runner.trainer
    buffer, _ = runner.collector.collect(0)
    trainer.compute_advantages(buffer)
    samples = buffer.agent_samples(0)
    ref = trainer.reference_logprobs(samples)
    torch.testing.assert_close(ref, samples.logprobs, atol=1e-5, rtol=0)  # LoRA starts as zero: policy == reference
    with torch.no_grad():
        for name, p in team.model.named_parameters():
            if "lora_B" in name and ".reasoner." in name:
                p.normal_(std=0.5)
    team.set_active(None)

    mb = samples.replace(ref_logprobs=ref).trimmed(team.device)
    token_logp, _ = trainer.score_replies(team.agent_adapters[0], mb)
    stats = {}
    trainer.add_reference_kl(token_logp, mb, stats)
    tokens = float(mb.response_mask.sum())
    assert stats["kl_to_reference"] > 1e-3 and float(stats["kl_sum"]) == pytest.approx(float(stats["kl_to_reference"]) * tokens)
    metrics = trainer.update(buffer, 0)
    assert any(k.endswith("/kl_to_reference") for k in metrics)
