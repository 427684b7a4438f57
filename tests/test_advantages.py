"""The vectorised agent-chain GAE against a plain triple loop."""

import torch

from marft.algorithms.advantages import agent_chain_gae


def reference_chain_gae(rewards, values, dones, gamma, lam):
    """Plain loops: agent n bootstraps from agent n+1, the last agent from agent 0 of the next step."""
    T, E, N = rewards.shape
    adv = torch.zeros(T, E, N, dtype=torch.float64)
    for e in range(E):
        gae = 0.0
        for t in reversed(range(T)):
            for n in reversed(range(N)):
                if n == N - 1:
                    not_done = 0.0 if dones[t, e] else 1.0
                    next_value = values[t + 1, e, 0]
                else:
                    not_done = 1.0
                    next_value = values[t, e, n + 1]
                delta = rewards[t, e, n] + gamma * not_done * next_value - values[t, e, n]
                gae = delta + gamma * lam * not_done * gae
                adv[t, e, n] = gae
    return adv, adv + values[:T]


def test_chain_gae_matches_loop_reference():
    gen = torch.Generator().manual_seed(0)
    for T, E, N in [(1, 1, 1), (4, 3, 2), (6, 5, 4), (3, 2, 3)]:
        rewards = torch.randn(T, E, N, generator=gen, dtype=torch.float64)
        values = torch.randn(T + 1, E, N, generator=gen, dtype=torch.float64)
        dones = torch.rand(T, E, generator=gen) < 0.4
        for gamma, lam in [(0.99, 0.95), (1.0, 1.0), (0.9, 0.0)]:
            adv, ret = agent_chain_gae(rewards, values, dones, gamma, lam)
            ref_adv, ref_ret = reference_chain_gae(rewards, values, dones, gamma, lam)
            torch.testing.assert_close(adv, ref_adv, atol=1e-5, rtol=0)
            torch.testing.assert_close(ret, ref_ret, atol=1e-5, rtol=0)


def test_episode_end_cuts_the_chain():
    """After a done step, the next step's rewards must not leak into earlier advantages."""
    rewards = torch.zeros(2, 1, 2)
    rewards[1, 0, 1] = 100.0
    values = torch.zeros(3, 1, 2)
    dones = torch.tensor([[True], [False]])
    adv, _ = agent_chain_gae(rewards, values, dones, 1.0, 1.0)
    assert adv[0].abs().max() == 0
    assert adv[1, 0, 0] == 100.0 and adv[1, 0, 1] == 100.0
