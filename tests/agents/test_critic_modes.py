"""``--critic_mode per_agent``: one critic adapter and value head per agent, on the one base model, each trained
on its own agent's turns only; shared mode stays as it was."""

from __future__ import annotations

import pytest
import torch
from test_team import fill_buffer, make_team

from marft.algorithms import trainer_class
from marft.config import AlgoConfig

pytestmark = pytest.mark.usefixtures("one_thread")


def moved_groups(team, before) -> set[str]:
    """Adapters (by name) and value heads (``head:<critic>``) whose weights changed since ``before``."""
    moved = set()
    for name, p in team.model.named_parameters():
        if "lora_" in name and not torch.equal(p, before[name]):
            moved.add(name.split("lora_")[1].split(".")[1])
    for critic, head in team.critic.value_heads.items():
        if not torch.equal(head.weight, before[f"head:{critic}"]):
            moved.add(f"head:{critic}")
    return moved


def weights_of(team) -> dict[str, torch.Tensor]:
    out = {n: p.detach().clone() for n, p in team.model.named_parameters()}
    out.update({f"head:{c}": h.weight.detach().clone() for c, h in team.critic.value_heads.items()})
    return out


def test_per_agent_critics_are_adapters_on_the_one_base_model(random_model_dir):
    shared, per_agent = make_team(random_model_dir), make_team(random_model_dir, critic_mode="per_agent")
    assert shared.critic_adapters == ["critic"] and shared.critic.agent_critics == ["critic", "critic"]
    assert per_agent.critic_adapters == ["critic_reasoner", "critic_actor"]
    assert set(per_agent.model.peft_config) == {"reasoner", "actor", "critic_reasoner", "critic_actor"}
    base = lambda team: sum(p.numel() for n, p in team.model.named_parameters() if "lora_" not in n)  # noqa: E731
    assert base(shared) == base(per_agent)  # one base model either way; memory grows by adapters only
    adapter = sum(p.numel() for p in shared.adapter_parameters("critic"))
    assert sum(p.numel() for p in per_agent.critic.trainable_parameters()) == 2 * (adapter + sum(p.numel() for p in shared.critic.value_head.parameters()))


@pytest.mark.parametrize("algorithm", ["APPO", "TPPO"])
def test_each_per_agent_critic_moves_only_on_its_own_agents_turns(random_model_dir, algorithm):
    torch.manual_seed(0)
    team = make_team(random_model_dir, critic_mode="per_agent")
    trainer = trainer_class(algorithm)(team, AlgoConfig(algorithm_name=algorithm, ppo_epoch=1, critic_lr=1e-2), steps_per_iteration=8)
    buffer = fill_buffer(team, trainer=trainer)
    assert buffer.values[:-1].abs().sum() > 0  # the rollout values every turn with its agent's critic
    before = weights_of(team)
    trainer.update_critic(buffer.critic_samples(trainer.token_level, team.critic.agents_of("critic_reasoner")), "critic_reasoner")
    assert moved_groups(team, before) == {"critic_reasoner", "head:critic_reasoner"}

    # the Reasoner's critic learns from the Reasoner's turns alone: changing the Actor's returns changes nothing
    def reasoner_critic_after_one_step(returns_scale: float) -> dict[str, torch.Tensor]:
        torch.manual_seed(1)
        probe = make_team(random_model_dir, critic_mode="per_agent")
        probe.load_state_dict(team.state_dict())
        probe_trainer = trainer_class(algorithm)(probe, AlgoConfig(algorithm_name=algorithm, ppo_epoch=1, critic_lr=1e-2), steps_per_iteration=8)
        field = "token_returns" if trainer.token_level else "returns"
        changed = getattr(buffer, field).clone()
        changed[:, :, 1] *= returns_scale
        setattr(buffer, field, changed)
        probe_trainer.update(buffer, 0)
        return {n: p.detach().clone() for n, p in probe.model.named_parameters() if ".critic_reasoner." in n}

    original = {"token_returns": buffer.token_returns.clone(), "returns": buffer.returns.clone()}
    first = reasoner_critic_after_one_step(1.0)
    buffer.token_returns, buffer.returns = original["token_returns"].clone(), original["returns"].clone()
    second = reasoner_critic_after_one_step(-3.0)
    for name in first:
        torch.testing.assert_close(first[name], second[name], rtol=0, atol=0, msg=name)


def test_per_agent_critic_metrics_are_tagged_per_critic(random_model_dir):
    torch.manual_seed(0)
    team = make_team(random_model_dir, critic_mode="per_agent")
    trainer = trainer_class("APPO")(team, AlgoConfig(ppo_epoch=1), steps_per_iteration=8)
    buffer = fill_buffer(team, trainer=trainer)
    metrics = trainer.update(buffer, 0)
    assert {"critic_reasoner/value_loss", "critic_actor/value_loss"} <= metrics.keys() and "critic/value_loss" not in metrics
    state = trainer.state_dict()
    assert set(state["critic_optimizers"]) == {"critic_reasoner", "critic_actor"}
    trainer.load_state_dict(state)


# ---------------------------------------------------------------------- credit assignment
def test_each_credit_mode_gives_the_hand_computed_per_turn_credits():
    from marft.algorithms.advantages import CREDIT_MODES, turn_credits

    rewards = torch.tensor([[[1.0, 1.0, 1.0], [0.0, 3.0, 0.0]]])  # (T=1, E=2, N=3): a team reward, then per-agent rewards
    assert set(CREDIT_MODES) == {"env", "equal", "step_discount", "per_step", "own_turns"}
    with pytest.raises(ValueError, match="own_turns gives no per-turn credit"):  # its own GAE: tests/algorithms/test_own_turn_gae.py
        turn_credits(rewards, "own_turns")
    torch.testing.assert_close(turn_credits(rewards, "env"), rewards)
    torch.testing.assert_close(turn_credits(rewards, "per_step"), rewards)
    torch.testing.assert_close(turn_credits(rewards, "equal"), torch.tensor([[[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]]))
    torch.testing.assert_close(turn_credits(rewards, "step_discount", 0.5), torch.tensor([[[0.25, 0.5, 1.0], [0.25, 0.5, 1.0]]]))


@pytest.mark.parametrize("mode", ["equal", "step_discount", "per_step"])
def test_with_a_critic_each_turns_return_within_its_step_is_its_credit(mode):
    """gamma = lambda = 1, zero values, one-step episodes: the GAE return of turn n is its credit, not the
    sum of the credits after it (mode env: the first of K turns with reward R gets K x R)."""
    from marft.algorithms.advantages import agent_chain_gae, chain_rewards, turn_credits

    rewards = torch.tensor([[[1.0, 1.0, 1.0], [0.0, 3.0, 0.0]]])
    values, done = torch.zeros(2, 2, 3), torch.ones(1, 2, dtype=torch.bool)
    credits = turn_credits(rewards, mode, 0.5)
    _, returns = agent_chain_gae(chain_rewards(credits, 1.0), values, done, 1.0, 1.0)
    torch.testing.assert_close(returns, credits)
    _, env_returns = agent_chain_gae(rewards, values, done, 1.0, 1.0)
    assert env_returns[0, 0].tolist() == [3.0, 2.0, 1.0]  # the env mode: rewards flow back along the chain


def test_grpo_with_per_step_credit_compares_each_agent_by_its_own_reward():
    from marft.algorithms.advantages import group_relative_advantages

    credits = torch.tensor([[[1.0, 0.0], [0.0, 0.0]]])  # (T=1, E=2 in one group, N=2): only agent 0 differs
    adv, _, flat = group_relative_advantages(credits, torch.ones(1, 2, dtype=torch.bool), 1, 2, scale=False, per_agent=True)
    torch.testing.assert_close(adv, torch.tensor([[[0.5, 0.0], [-0.5, 0.0]]]))
    assert flat == 0  # agent 0's returns vary, so the group teaches something


@pytest.mark.parametrize("mode", ["equal", "step_discount", "per_step"])
@pytest.mark.parametrize("algorithm", ["APPO", "GRPO"])
def test_every_credit_mode_trains(random_model_dir, tmp_path, algorithm, mode):
    from marft.cli.train import main

    argv = ["--model_name_or_path", random_model_dir, "--env_name", "dense_relay_sum", "--max_new_tokens", "6",
            "--context_window", "128", "--n_rollout_threads", "4", "--episode_length", "1", "--num_env_steps", "8",
            "--eval_episodes", "2", "--n_eval_threads", "2", "--algorithm_name", algorithm, "--group_size", "2",
            "--credit_assignment", mode, "--output_dir", str(tmp_path / "run")]
    assert main(argv) == 0
    assert (tmp_path / "run" / "checkpoints" / "steps_2").is_dir()
