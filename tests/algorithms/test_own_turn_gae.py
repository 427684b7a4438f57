"""``--credit_assignment own_turns`` (MARFT-A and MARFT-T self-play): GAE along each agent's own chain of turns, against a
plain per-env, per-agent loop, a hand-worked game, and the inputs it must refuse; the token-level chain against the
action-level one."""

import pytest
import torch

from marft.algorithms.advantages import own_turn_gae, own_turn_token_gae
from marft.config import parse_config


def plain_own_turn_gae(agent_rewards, values, agents, terminated, gamma, lam):
    """The definition, one env and one agent at a time: the agent's turns in order; a turn's reward sums the agent's
    rewards from its step up to (not including) the step of its next turn in the episode, or to the episode's end;
    its successor is that next turn (none after the episode's last)."""
    T, E, S = agents.shape
    N = agent_rewards.shape[-1]
    advantages = torch.zeros(T, E, S, dtype=torch.float64)
    for e in range(E):
        episode = 0
        episodes = []  # per step, its episode number
        for t in range(T):
            episodes.append(episode)
            episode += int(terminated[t, e])
        for n in range(N):
            turns = [(t, s) for t in range(T) for s in range(S) if agents[t, e, s] == n]
            for k in range(len(turns) - 1, -1, -1):
                t, s = turns[k]
                following = [(u, v) for u, v in turns[k + 1:] if episodes[u] == episodes[t]]
                nxt = following[0] if following else None
                same_step_later = nxt is not None and nxt[0] == t
                if same_step_later:
                    reward = 0.0  # the step's rewards go to the agent's last turn of the step
                else:
                    end = nxt[0] if nxt is not None else T
                    steps = [u for u in range(t, end) if episodes[u] == episodes[t]]
                    reward = float(sum(agent_rewards[u, e, n] for u in steps))
                next_value = float(values[nxt[0], e, nxt[1]]) if nxt else 0.0
                next_adv = float(advantages[nxt[0], e, nxt[1]]) if nxt else 0.0
                delta = reward + gamma * next_value - float(values[t, e, s])
                advantages[t, e, s] = delta + gamma * lam * next_adv
    return advantages


def random_rollout(seed, T=12, E=5, S=2, N=2):
    """Episodes of random lengths per env (each ends within T), one or two turns per step by random agents, some
    steps where an env sits out (no turn, no reward), rewards on any agent at any step."""
    g = torch.Generator().manual_seed(seed)
    agents = torch.full((T, E, S), -1, dtype=torch.long)
    terminated = torch.zeros(T, E, dtype=torch.bool)
    agent_rewards = torch.zeros(T, E, N, dtype=torch.float64)
    for e in range(E):
        t = 0
        while t < T:
            length = int(torch.randint(1, 5, (1,), generator=g))
            end = min(t + length, T) - 1
            for u in range(t, end + 1):
                turns = int(torch.randint(1, S + 1, (1,), generator=g))
                agents[u, e, :turns] = torch.randint(0, N, (turns,), generator=g)
                agent_rewards[u, e] = torch.randn(N, generator=g, dtype=torch.float64)
            terminated[end, e] = True
            t = end + 1 + int(torch.randint(0, 2, (1,), generator=g))  # sometimes an idle step (sitting out a round)
    values = torch.randn(T + 1, E, S, generator=g, dtype=torch.float64)
    return agent_rewards, values, agents, terminated


@pytest.mark.parametrize("seed", range(6))
def test_matches_the_plain_per_agent_loop(seed):
    agent_rewards, values, agents, terminated = random_rollout(seed)
    played = agents >= 0
    advantages, returns = own_turn_gae(agent_rewards, values, agents, played, terminated, gamma=0.97, gae_lambda=0.9)
    expected = plain_own_turn_gae(agent_rewards, values, agents, terminated, 0.97, 0.9)
    torch.testing.assert_close(advantages, expected)
    torch.testing.assert_close(returns, torch.where(played, expected + values[:-1], torch.zeros_like(expected)))


def test_a_game_credits_each_seat_with_its_own_outcome_through_its_own_values():
    """A moves (t0), B moves (t1), A moves and wins (t2): A +1, B -1, both paid at t2. B's only turn gets B's -1
    (paid on A's move), A's last turn +1, and A's first turn bootstraps from A's own next value, not from B's."""
    agents = torch.tensor([0, 1, 0]).view(3, 1, 1)
    agent_rewards = torch.tensor([[0.0, 0.0], [0.0, 0.0], [1.0, -1.0]]).view(3, 1, 2)
    values = torch.tensor([0.2, -0.3, 0.6, 9.0]).view(4, 1, 1)  # values[3]: unused (the game ended)
    terminated = torch.tensor([False, False, True]).view(3, 1)
    adv, ret = own_turn_gae(agent_rewards, values, agents, agents >= 0, terminated, gamma=1.0, gae_lambda=1.0)
    assert adv.flatten().tolist() == pytest.approx([1.0 - 0.2, -1.0 + 0.3, 1.0 - 0.6])
    assert ret.flatten().tolist() == pytest.approx([1.0, -1.0, 1.0])
    adv, _ = own_turn_gae(agent_rewards, values, agents, agents >= 0, terminated, gamma=1.0, gae_lambda=0.0)
    assert adv[0].item() == pytest.approx(0.6 - 0.2)  # one-step TD: A's own next value


def test_unfinished_or_truncated_episodes_are_refused():
    agents = torch.tensor([0, 1]).view(2, 1, 1)
    rewards, values = torch.zeros(2, 1, 2), torch.zeros(3, 1, 1)
    with pytest.raises(ValueError, match="whole episodes"):
        own_turn_gae(rewards, values, agents, agents >= 0, torch.tensor([[False], [False]]), 1.0, 1.0)
    with pytest.raises(ValueError, match="truncated"):
        own_turn_gae(rewards, values, agents, agents >= 0, torch.tensor([[False], [False]]), 1.0, 1.0,
                     truncated=torch.tensor([[False], [True]]))


def token_rollout(seed, L=5):
    """:func:`random_rollout` with replies: every turn 1 to L real tokens, token values whose first token's is the
    turn's value (the rest random), empty slots without tokens."""
    agent_rewards, values, agents, terminated = random_rollout(seed)
    T, E, S = agents.shape
    g = torch.Generator().manual_seed(100 + seed)
    lengths = torch.randint(1, L + 1, (T, E, S), generator=g) * (agents >= 0)  # (T, E, S)
    response_mask = (torch.arange(L) < lengths.unsqueeze(-1)).to(torch.float64)  # (T, E, S, L)
    token_values = torch.randn(T, E, S, L, generator=g, dtype=torch.float64)
    token_values[..., 0] = values[:-1]
    return agent_rewards, values, agents, terminated, token_values * response_mask, response_mask


@pytest.mark.parametrize("seed", range(6))
def test_token_level_first_tokens_get_the_action_level_advantages(seed):
    """MARFT-T's own-turn chain with token_gamma = token_gae_lambda = 1: within a reply the token values telescope, so a
    turn's first token gets exactly the action-level own-turn advantage of the turn valued at its first token."""
    agent_rewards, values, agents, terminated, token_values, response_mask = token_rollout(seed)
    played = agents >= 0
    expected, _ = own_turn_gae(agent_rewards, values, agents, played, terminated, gamma=0.97, gae_lambda=0.9)
    advantages, returns = own_turn_token_gae(agent_rewards, token_values, response_mask, agents, played, terminated, 0.97, 0.9)
    torch.testing.assert_close(advantages[..., 0], expected)
    torch.testing.assert_close(returns, (advantages + token_values) * response_mask)
    assert (advantages[response_mask == 0] == 0).all()


def test_token_level_a_seat_is_paid_its_own_outcome_and_discounts_within_its_reply():
    """The hand-worked game of the action-level test, two tokens per reply, token_gamma 0.5 and token_gae_lambda 1: each
    reply's last token is paid its seat's outcome (A +1 at t2, B -1) and bootstraps from its seat's own next turn; the
    first token reaches it through token_gamma."""
    agents = torch.tensor([0, 1, 0]).view(3, 1, 1)
    agent_rewards = torch.tensor([[0.0, 0.0], [0.0, 0.0], [1.0, -1.0]]).view(3, 1, 2)
    token_values = torch.tensor([[0.2, 0.4], [-0.3, -0.5], [0.6, 0.7]]).view(3, 1, 1, 2)
    mask, terminated = torch.ones(3, 1, 1, 2), torch.tensor([False, False, True]).view(3, 1)
    adv, _ = own_turn_token_gae(agent_rewards, token_values, mask, agents, agents >= 0, terminated, gamma=1.0, gae_lambda=1.0,
                                token_gamma=0.5, token_gae_lambda=1.0)
    last_a2 = 1.0 - 0.7  # A's last reply: paid +1, the game over
    first_a2 = 0.5 * 0.7 - 0.6 + 0.5 * last_a2
    last_a0 = 0.0 + 1.0 * 0.6 - 0.4 + first_a2  # A's first reply bootstraps from A's next turn (t2), not B's
    last_b1 = -1.0 - (-0.5)  # B's only reply: paid -1 on A's winning move, nothing of its own after
    assert adv[2, 0, 0].tolist() == pytest.approx([first_a2, last_a2])
    assert adv[0, 0, 0, 1].item() == pytest.approx(last_a0)
    assert adv[0, 0, 0, 0].item() == pytest.approx(0.5 * 0.4 - 0.2 + 0.5 * last_a0)
    assert adv[1, 0, 0].tolist() == pytest.approx([0.5 * -0.5 + 0.3 + 0.5 * last_b1, last_b1])


def test_token_level_refuses_unfinished_episodes():
    agents = torch.tensor([0, 1]).view(2, 1, 1)
    with pytest.raises(ValueError, match="whole episodes"):
        own_turn_token_gae(torch.zeros(2, 1, 2), torch.zeros(2, 1, 1, 3), torch.ones(2, 1, 1, 3), agents, agents >= 0,
                           torch.tensor([[False], [False]]), 1.0, 1.0)


@pytest.mark.parametrize("flags, message", [
    (["--algorithm_name", "GRPO"], "own_turns .* trains with --algorithm_name APPO or TPPO, not GRPO"),
    (["--algorithm_name", "APPO", "--horizon", "3", "--episode_length", "4"], "plays whole episodes: --episode_length 4 must be a multiple of --horizon 3"),
])
def test_the_config_refuses_own_turns_where_it_cannot_hold(flags, message):
    config, _ = parse_config(["--credit_assignment", "own_turns", *flags])
    with pytest.raises(ValueError, match=message):
        config.check()
