"""The vectorised agent-chain GAE against a plain triple loop."""

import torch

from marft.algorithms.advantages import agent_chain_gae


def reference_chain_gae(rewards, values, dones, gamma, lam, truncated=None, final_values=None):
    """Plain loops: agent n bootstraps from agent n+1, the last agent from agent 0 of the next step;
    a terminated episode's last agent from nothing, a truncated one's from the final observation's value."""
    T, E, N = rewards.shape
    adv = torch.zeros(T, E, N, dtype=torch.float64)
    for e in range(E):
        gae = 0.0
        for t in reversed(range(T)):
            for n in reversed(range(N)):
                cut = truncated is not None and bool(truncated[t, e])
                if n == N - 1:
                    not_done = 0.0 if dones[t, e] or cut else 1.0
                    next_value = values[t + 1, e, 0]
                    if cut:
                        next_value = final_values[t, e]
                    if dones[t, e]:
                        next_value = 0.0
                else:
                    not_done = 1.0
                    next_value = values[t, e, n + 1]
                delta = rewards[t, e, n] + gamma * next_value - values[t, e, n]
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


def test_chain_gae_with_truncation_matches_loop_reference():
    gen = torch.Generator().manual_seed(1)
    for T, E, N in [(1, 1, 1), (4, 3, 2), (5, 4, 3)]:
        rewards = torch.randn(T, E, N, generator=gen, dtype=torch.float64)
        values = torch.randn(T + 1, E, N, generator=gen, dtype=torch.float64)
        terminated = torch.rand(T, E, generator=gen) < 0.3
        truncated = torch.rand(T, E, generator=gen) < 0.3
        final_values = torch.randn(T, E, generator=gen, dtype=torch.float64)
        for gamma, lam in [(0.99, 0.95), (1.0, 1.0)]:
            adv, ret = agent_chain_gae(rewards, values, terminated, gamma, lam, truncated, final_values)
            ref_adv, ref_ret = reference_chain_gae(rewards, values, terminated, gamma, lam, truncated, final_values)
            torch.testing.assert_close(adv, ref_adv, atol=1e-5, rtol=0)
            torch.testing.assert_close(ret, ref_ret, atol=1e-5, rtol=0)


def test_truncation_bootstraps_from_the_final_observation():
    """gymnasium semantics: a truncated episode's last turn is worth r + gamma * V(final obs), a terminated one's r;
    neither sees the next episode's values or rewards."""
    rewards = torch.tensor([[[1.0, 2.0]], [[50.0, 60.0]]])  # (T=2, E=1, N=2)
    values = torch.tensor([[[0.5, 0.25]], [[70.0, 80.0]], [[90.0, 95.0]]])  # next episode's values must not leak
    final = torch.tensor([[10.0], [0.0]])
    cut = torch.tensor([[True], [False]])
    never = torch.zeros(2, 1, dtype=torch.bool)
    adv, _ = agent_chain_gae(rewards, values, never, 0.5, 1.0, truncated=cut, final_values=final)
    assert adv[0, 0, 1] == 2.0 + 0.5 * 10.0 - 0.25
    adv, _ = agent_chain_gae(rewards, values, cut, 0.5, 1.0)  # the same step terminated instead
    assert adv[0, 0, 1] == 2.0 - 0.25
