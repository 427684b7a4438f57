"""Issue 30, the credit side: each pinned by a test that failed before its fix.

1 credit over a variable number of turns (orchestrated steps: the routing turn's return, GRPO's episode
return) · 5 the uninformative-batch skip is in test_rl_audit · 7 parallel graph siblings bootstrap from the state
after their layer (against a brute-force walk) · 8 TPPO telescoping with --token_gamma < 1, --group_size 1 refused,
the agent schedule on a resume with another rollout size. And the sequential workflow, whose math did not
change, gives bit-identical advantages to the code before (tests/legacy_advantages.py).
"""

from __future__ import annotations

import pytest
import torch
from legacy_advantages import (
    old_agent_chain_gae,
    old_chain_rewards,
    old_group_per_agent,
    old_token_chain_gae,
    old_turn_credits,
    old_turn_rewards,
)

from marft.algorithms import trainer_class
from marft.algorithms.advantages import agent_chain_gae, group_relative_advantages, token_chain_gae
from marft.config import AlgoConfig, TrainConfig
from marft.runner.shared.buffer import RolloutBuffer

MODES = ["env", "equal", "step_discount", "per_step"]


def bare_trainer(algorithm: str, **algo):
    """A trainer with only its config (the advantage hooks need nothing else)."""
    cls = trainer_class(algorithm)
    trainer = cls.__new__(cls)
    trainer.config = AlgoConfig(algorithm_name=algorithm, **algo)
    trainer.counters = {"zero_variance_groups": 0}
    trainer.round_length = 1
    return trainer


def turn_buffer(steps: list[list[list[int]]], n_agents: int, rewards, L: int = 4, layers=None, terminated=True) -> RolloutBuffer:
    """A buffer from ``steps[t][e]``: the agents of env e's turns in step t, in slot order (``layers[t][e]``: their
    layer ids, default one layer per turn); ``rewards (T, E, N)``; every reply ``L`` tokens; values 0."""
    T, E = len(steps), len(steps[0])
    S = max(len(turns) for step in steps for turns in step)
    buffer = RolloutBuffer(T, E, n_agents, 2, L, pad_id=0, slots_per_step=S)
    for t in range(T):
        for e in range(E):
            for s, agent in enumerate(steps[t][e]):
                buffer.agent[t, e, s] = agent
                buffer.layer[t, e, s] = s if layers is None else layers[t][e][s]
                buffer.response_mask[t, e, s] = 1
        buffer.insert_step(t, torch.as_tensor(rewards, dtype=torch.float)[t], torch.full((E,), terminated), torch.zeros(E, dtype=torch.bool))
    return buffer


# ---------------------------------------------------------------------- the sequential workflow: unchanged
def random_sequential_buffer(T=4, E=4, N=3, L=5, seed=0) -> RolloutBuffer:
    g = torch.Generator().manual_seed(seed)
    buffer = RolloutBuffer(T, E, N, 2, L, pad_id=0)
    buffer.agent[:] = torch.arange(N)  # what insert_turn stores with its defaults: slot n is agent n, its own layer
    buffer.layer[:] = torch.arange(N)
    lengths = torch.randint(1, L + 1, (T, E, N), generator=g)
    buffer.response_mask = (torch.arange(L) < lengths.unsqueeze(-1)).long()
    buffer.values = torch.randn(T + 1, E, N, generator=g)
    buffer.token_values = torch.randn(T, E, N, L, generator=g) * buffer.response_mask
    for t in range(T):
        rewards = torch.randint(0, 3, (E, N), generator=g).float() - 0.5
        terminated, truncated = torch.rand(E, generator=g) < 0.3, torch.rand(E, generator=g) < 0.2
        buffer.insert_step(t, rewards, terminated, truncated & ~terminated)
    buffer.final_values = torch.randn(T, E, generator=g) * buffer.truncated
    return buffer


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("algorithm", ["APPO", "TPPO", "GRPO"])
def test_the_sequential_workflow_gives_bit_identical_advantages_to_the_code_before(algorithm, mode):
    """One turn per agent per step: the new credit, layer and telescoping code reduces to the old one exactly
    (torch.equal, not a tolerance), so `scripts/benchmark.py learning` (APPO, relay_sum, sequential) is unchanged."""
    buffer = random_sequential_buffer()
    T, E, N = buffer.agent.shape
    cfg = dict(gamma=0.99, gae_lambda=0.95, credit_assignment=mode, credit_discount=0.9, group_size=2, token_gamma=1.0, token_gae_lambda=0.9)
    trainer = bare_trainer(algorithm, **cfg)
    trainer.round_length = 2
    old_rewards = old_turn_rewards(buffer.agent, buffer.agent_rewards, N)
    assert torch.equal(buffer.rewards, old_rewards)
    credits = None if mode == "env" else old_turn_credits(old_rewards, mode, 0.9, team_rewards=buffer.agent_rewards, played=buffer.played)
    chain = old_rewards if mode == "env" else old_chain_rewards(credits, 0.99)
    trainer.compute_advantages(buffer)
    if algorithm == "APPO":
        advantages, returns = old_agent_chain_gae(chain, buffer.values, buffer.terminated, 0.99, 0.95, truncated=buffer.truncated,
                                                  final_values=buffer.final_values, played=buffer.played)
        assert torch.equal(buffer.advantages, advantages) and torch.equal(buffer.returns, returns)
    elif algorithm == "TPPO":
        advantages, returns = old_token_chain_gae(chain, buffer.token_values, buffer.response_mask, buffer.values[-1, :, 0], buffer.terminated,
                                                  0.99, 0.95, 1.0, 0.9, truncated=buffer.truncated, final_values=buffer.final_values)
        assert torch.equal(buffer.token_advantages, advantages) and torch.equal(buffer.token_returns, returns)
    else:
        if mode == "env":
            advantages, _, _ = group_relative_advantages(buffer.agent_rewards, buffer.active, 2, 2, True)
            expected = advantages[..., :1] * buffer.played
        else:
            advantages, _, _ = group_relative_advantages(old_group_per_agent(credits, buffer.agent, N), buffer.active, 2, 2, True, per_agent=True)
            expected = advantages  # slot n is agent n
        assert torch.equal(buffer.advantages, expected)
    assert buffer.advantages.abs().sum() > 0 or buffer.token_advantages.abs().sum() > 0


# ---------------------------------------------------------------------- 1. a variable number of turns
# Agents: 0 and 1 are specialists (keepers), 2 the orchestrator; every agent gets R = 1 for a solved step.
SHORT = [2, 0, 2]  # "right keeper, done"
LONG = [2, 1, 2, 0, 2]  # "wrong keeper, right keeper, done"
TWICE = [2, 0, 2, 0, 2]  # the same keeper called twice


@pytest.mark.parametrize("algorithm", ["APPO", "TPPO"])
@pytest.mark.parametrize("mode", ["env", "equal", "per_step"])
def test_the_routing_turn_returns_the_same_however_many_turns_the_solved_step_took(algorithm, mode):
    """gamma = lambda = 1, V = 0, one-step episodes, all solved: the orchestrator's routing turn (slot 0) returns
    the same in a 3-turn and a 5-turn step. Before: env mode paid R per distinct speaker (2 vs 3), per_step gave the
    routing turn 0 (only an agent's last turn was credited)."""
    buffer = turn_buffer([[SHORT, LONG, TWICE]], 3, torch.ones(1, 3, 3))
    bare_trainer(algorithm, gamma=1.0, gae_lambda=1.0, credit_assignment=mode).compute_advantages(buffer)
    routing = buffer.returns[0, :, 0] if algorithm == "APPO" else buffer.token_returns[0, :, 0, 0]
    expected = {"env": 3.0, "equal": 1.0, "per_step": 1.0}[mode]  # env: every agent's reward once, N x R
    assert routing.tolist() == [expected] * 3
    every_turn = buffer.returns[buffer.played] if algorithm == "APPO" else buffer.token_returns[..., 0][buffer.played]
    if mode != "env":
        assert (every_turn == 1.0).all()  # each turn's return within its step is its credit
    assert buffer.rewards.sum((0, 2)).tolist() == [3.0, 3.0, 3.0]  # env placement: each agent's reward once per step


def test_step_discount_credits_a_turn_by_the_layers_after_it():
    """step_discount is the one mode that depends, by design, on the turns after a turn: R x d^j for j later layers."""
    buffer = turn_buffer([[SHORT, LONG]], 3, torch.ones(1, 2, 3))
    from marft.algorithms.advantages import buffer_credits

    credits = buffer_credits(buffer, "step_discount", 0.5)
    assert credits[0, 0].tolist() == [0.25, 0.5, 1.0, 0.0, 0.0] and credits[0, 1].tolist() == [0.0625, 0.125, 0.25, 0.5, 1.0]
    graph = turn_buffer([[[0, 1, 2]]], 3, torch.ones(1, 1, 3), layers=[[[0, 1, 1]]])  # 0, then 1 and 2 in parallel
    assert buffer_credits(graph, "step_discount", 0.5)[0, 0].tolist() == [0.5, 1.0, 1.0]  # siblings alike


@pytest.mark.parametrize("mode", ["env", "equal", "per_step"])
def test_grpo_gives_two_solved_episodes_with_different_calls_equal_advantages(mode):
    """One group of two solved episodes, 3 and 5 turns: every advantage 0 (before: the orchestrator's credits were
    summed over its 2 or 3 turns, +-0.707 with equal; per_step gave the keeper that only spoke in the long one
    credit 1 against 0). A solved and a failed episode still differ."""
    trainer = bare_trainer("GRPO", credit_assignment=mode, group_size=2)
    solved = turn_buffer([[SHORT, LONG]], 3, torch.ones(1, 2, 3))
    trainer.compute_advantages(solved)
    assert (solved.advantages == 0).all() and trainer.counters["zero_variance_groups"] == 1
    mixed = turn_buffer([[SHORT, LONG]], 3, torch.tensor([[[1.0] * 3, [0.0] * 3]]))
    trainer.compute_advantages(mixed)
    orchestrator = mixed.advantages[0][mixed.agent[0] == 2]
    assert (orchestrator[:2] > 0.7).all() and (orchestrator[2:] < -0.7).all()


# ---------------------------------------------------------------------- 7. parallel graph layers
def layered_reference(rewards, values, terminated, truncated, final_values, played, layers, gamma, lam):
    """Plain reference: each env's turns grouped into layers (consecutive slots of one id in a step), walked
    backwards; a turn's successor state is the next layer (its value and advantage: the means over its turns), the
    next step's first layer, or the episode's end (terminated: 0; truncated: the final value; the rollout's end:
    values[T, e, 0])."""
    T, E, S = rewards.shape
    adv = torch.zeros(T, E, S, dtype=torch.float64)
    for e in range(E):
        seq = []  # [(t, [slots])] in play order
        for t in range(T):
            for s in range(S):
                if played[t, e, s]:
                    if seq and seq[-1][0] == t and layers[t, e, seq[-1][1][-1]] == layers[t, e, s]:
                        seq[-1][1].append(s)
                    else:
                        seq.append((t, [s]))
        after_v, after_a = float(values[T, e, 0]), 0.0
        for i in range(len(seq) - 1, -1, -1):
            t, slots = seq[i]
            if i == len(seq) - 1 or seq[i + 1][0] != t:  # the step's last layer
                if terminated[t, e]:
                    after_v, after_a = 0.0, 0.0
                elif truncated[t, e]:
                    after_v, after_a = float(final_values[t, e]), 0.0
            for s in slots:
                delta = float(rewards[t, e, s]) + gamma * after_v - float(values[t, e, s])
                adv[t, e, s] = delta + gamma * lam * after_a
            after_v = sum(float(values[t, e, s]) for s in slots) / len(slots)
            after_a = sum(float(adv[t, e, s]) for s in slots) / len(slots)
    return adv.float()


def random_layers(T, E, S, g):
    """Turns filled from slot 0 (1..S per step) cut at random into consecutive layers."""
    counts = torch.randint(1, S + 1, (T, E), generator=g)
    played = torch.arange(S) < counts.unsqueeze(-1)
    cuts = torch.rand(T, E, S, generator=g) < 0.5
    cuts[..., 0] = True
    return played, cuts.long().cumsum(-1) * 10  # any ids: only equal neighbours matter


def test_parallel_siblings_bootstrap_from_the_state_after_their_layer():
    g = torch.Generator().manual_seed(0)
    T, E, S = 4, 6, 5
    played, layers = random_layers(T, E, S, g)
    assert ((layers[..., 1:] == layers[..., :-1]) & played[..., 1:]).any()  # some parallel layers
    rewards, values = torch.randn(T, E, S, generator=g) * played, torch.randn(T + 1, E, S, generator=g)
    terminated, truncated = torch.rand(T, E, generator=g) < 0.25, torch.rand(T, E, generator=g) < 0.2
    final_values = torch.randn(T, E, generator=g)
    adv, ret = agent_chain_gae(rewards, values, terminated, 0.9, 0.8, truncated=truncated, final_values=final_values, played=played, layers=layers)
    expected = layered_reference(rewards, values, terminated, truncated & ~terminated, final_values, played, layers, 0.9, 0.8)
    torch.testing.assert_close(adv, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret, adv + values[:T])
    chain, _ = agent_chain_gae(rewards, values, terminated, 0.9, 0.8, truncated=truncated, final_values=final_values, played=played)
    assert not torch.allclose(chain, expected, atol=1e-3)  # slotted one after another (the code before), siblings chain


def test_parallel_siblings_at_the_token_level_bootstrap_from_the_state_after_their_layer():
    """Token chain GAE with layers against a per-token walk (every reply non-empty)."""
    g = torch.Generator().manual_seed(1)
    T, E, S, L = 3, 5, 4, 4
    played, layers = random_layers(T, E, S, g)
    lengths = torch.randint(1, L + 1, (T, E, S), generator=g) * played
    mask = (torch.arange(L) < lengths.unsqueeze(-1)).long()
    rewards, values = torch.randn(T, E, S, generator=g) * played, torch.randn(T, E, S, L, generator=g) * mask
    bootstrap, terminated = torch.randn(E, generator=g), torch.rand(T, E, generator=g) < 0.3
    gamma, lam, tg, tl = 0.9, 0.8, 0.7, 0.95
    adv, _ = token_chain_gae(rewards, values, mask, bootstrap, terminated, gamma, lam, tg, tl, layers=layers)
    expected = torch.zeros(T, E, S, L)
    for e in range(E):
        seq = []
        for t in range(T):
            for s in range(S):
                if played[t, e, s]:
                    if seq and seq[-1][0] == t and layers[t, e, seq[-1][1][-1]] == layers[t, e, s]:
                        seq[-1][1].append(s)
                    else:
                        seq.append((t, [s]))
        after_v, after_a = float(bootstrap[e]), 0.0
        for i in range(len(seq) - 1, -1, -1):
            t, slots = seq[i]
            if (i == len(seq) - 1 or seq[i + 1][0] != t) and terminated[t, e]:
                after_v, after_a = 0.0, 0.0
            for s in slots:
                n = int(lengths[t, e, s])
                running = 0.0
                for k in range(n - 1, -1, -1):
                    if k == n - 1:
                        delta = float(rewards[t, e, s]) + gamma * after_v - float(values[t, e, s, k])
                        running = delta + gamma * lam * after_a
                    else:
                        delta = tg * float(values[t, e, s, k + 1]) - float(values[t, e, s, k])
                        running = delta + tg * tl * running
                    expected[t, e, s, k] = running
            after_v = sum(float(values[t, e, s, 0]) for s in slots) / len(slots)
            after_a = sum(float(expected[t, e, s, 0]) for s in slots) / len(slots)
    torch.testing.assert_close(adv, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["equal", "step_discount", "per_step"])
def test_with_parallel_layers_each_turns_return_within_its_step_is_still_its_credit(mode):
    """gamma 0.9, lambda 1, V = 0, one-step episodes, random layers and per-agent rewards: return = credit."""
    from marft.algorithms.advantages import chain_rewards, turn_credits

    g = torch.Generator().manual_seed(2)
    T, E, S, N = 3, 6, 5, 5
    played, layers = random_layers(T, E, S, g)
    agents = torch.where(played, torch.randint(0, N, (T, E, S), generator=g), torch.full((T, E, S), -1))
    team_rewards = torch.randn(T, E, N, generator=g)
    credits = turn_credits(torch.zeros(T, E, S), mode, 0.5, team_rewards=team_rewards, played=played, agents=agents, layers=layers)
    rewards = chain_rewards(credits, 0.9, played=played, layers=layers)
    _, returns = agent_chain_gae(rewards, torch.zeros(T + 1, E, S), torch.ones(T, E, dtype=torch.bool), 0.9, 1.0, played=played, layers=layers)
    torch.testing.assert_close(returns[played], credits[played])


def test_a_graph_rollout_puts_a_parallel_layer_in_one_layer(random_model_dir, tmp_path):
    """The runner stores the moment each turn was generated at: the two parallel solvers share a layer."""
    from test_workflows import run_config

    from marft.launch import build_runner

    runner = build_runner(run_config(random_model_dir, tmp_path, profile="solvers_verifier_graph", env="math"))
    buffer, _ = runner.collector.collect(0)
    assert buffer.layer[:, :, :3].tolist() == [[[0, 0, 1]] * 3] * 3


# ---------------------------------------------------------------------- 8. TPPO telescoping with token_gamma < 1
@pytest.mark.parametrize("mode", ["equal", "step_discount", "per_step"])
def test_tppo_credits_telescope_with_token_gamma_below_one(mode):
    """V = 0, lambda = 1, one-step episodes, replies of different lengths: the brute-force discounted return (each
    reply's reward on its last token, token_gamma within a reply, gamma between replies) equals the token GAE's,
    and at each reply's last token it is the reply's credit. Before, the telescoping ignored token_gamma."""
    from marft.algorithms.advantages import buffer_credits

    g = torch.Generator().manual_seed(3)
    T, E, N, L = 2, 4, 3, 6
    buffer = turn_buffer([[[0, 1, 2]] * E] * T, N, torch.randn(T, E, N, generator=g), L=L)
    lengths = torch.randint(1, L + 1, (T, E, N), generator=g)
    buffer.response_mask = (torch.arange(L) < lengths.unsqueeze(-1)).long()
    trainer = bare_trainer("TPPO", gamma=0.9, gae_lambda=1.0, token_gamma=0.8, token_gae_lambda=1.0, credit_assignment=mode, credit_discount=0.5)
    trainer.compute_advantages(buffer)
    rewards = trainer.chain_rewards(buffer)
    for t in range(T):
        for e in range(E):
            future = 0.0  # the discounted return of the next token, backwards along the step's tokens
            for n in range(N - 1, -1, -1):
                for k in range(int(lengths[t, e, n]) - 1, -1, -1):
                    last = k == lengths[t, e, n] - 1
                    future = (float(rewards[t, e, n]) + 0.9 * future) if last else 0.8 * future
                    assert float(buffer.token_returns[t, e, n, k]) == pytest.approx(future, abs=1e-5)
                    if last:
                        assert future == pytest.approx(float(buffer_credits(buffer, mode, 0.5)[t, e, n]), abs=1e-5)


# ---------------------------------------------------------------------- 8. config and schedule
def test_grpo_refuses_group_size_one():
    with pytest.raises(ValueError, match="--group_size 1"):
        AlgoConfig(algorithm_name="GRPO", group_size=1)
    AlgoConfig(algorithm_name="APPO", group_size=1)  # no groups without GRPO: ignored
    TrainConfig(algo=AlgoConfig(algorithm_name="GRPO", group_size=2)).check()
