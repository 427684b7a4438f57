"""Token-level agent-chain GAE (MARFT-T) against a plain per-token loop."""

import torch

from marft.algorithms.advantages import token_chain_gae


def reference_token_gae(rewards, values, mask, bootstrap, dones, gamma, lam, tgamma, tlam, truncated=None, final_values=None):
    """Walk each env's chain token by token, exactly as the docstring of token_chain_gae says."""
    T, E, N, L = values.shape
    adv = torch.zeros(T, E, N, L, dtype=torch.float64)
    for e in range(E):
        # Forward pass: list the real tokens in chain order with their reward and flags.
        tokens = []  # dicts: index, value, reward, last_of_reply, terminal
        for t in range(T):
            for n in range(N):
                length = int(mask[t, e, n].sum())
                if length == 0:
                    # Empty reply: its reward goes to the previous real token of the same episode.
                    if tokens and not tokens[-1]["terminal"]:
                        tokens[-1]["reward"] += float(rewards[t, e, n])
                    continue
                for l in range(length):
                    tokens.append(dict(index=(t, n, l), value=float(values[t, e, n, l]), reward=0.0, last=l == length - 1, terminal=False))
                tokens[-1]["reward"] = float(rewards[t, e, n])
            cut = truncated is not None and bool(truncated[t, e]) and not dones[t, e]
            if (dones[t, e] or cut) and tokens:
                tokens[-1]["terminal"] = True
                tokens[-1]["after_end"] = float(final_values[t, e]) if cut else 0.0
        # Backward pass: standard GAE with per-link discounts.
        gae, next_value = 0.0, float(bootstrap[e])
        for k in range(len(tokens) - 1, -1, -1):
            tok = tokens[k]
            g, lm = (gamma, lam) if tok["last"] else (tgamma, tlam)
            if tok["terminal"]:
                gae, next_value = 0.0, tok["after_end"]
            delta = tok["reward"] + g * next_value - tok["value"]
            gae = delta + g * lm * gae
            t, n, l = tok["index"]
            adv[t, e, n, l] = gae
            next_value = tok["value"]
    return adv, (adv + values) * mask


def random_case(gen, T, E, N, L):
    rewards = torch.randn(T, E, N, generator=gen, dtype=torch.float64)
    values = torch.randn(T, E, N, L, generator=gen, dtype=torch.float64)
    lengths = torch.randint(0, L + 1, (T, E, N), generator=gen)  # ragged, 0 = empty reply
    mask = (torch.arange(L) < lengths.unsqueeze(-1)).long()
    values = values * mask
    bootstrap = torch.randn(E, generator=gen, dtype=torch.float64)
    dones = torch.rand(T, E, generator=gen) < 0.35
    return rewards, values, mask, bootstrap, dones


def test_token_gae_matches_per_token_loop():
    gen = torch.Generator().manual_seed(0)
    for T, E, N, L in [(1, 1, 1, 1), (2, 3, 2, 5), (4, 5, 3, 7), (3, 8, 4, 1), (5, 4, 2, 12)]:
        case = random_case(gen, T, E, N, L)
        for params in [(0.99, 0.95, 1.0, 1.0), (0.9, 0.8, 0.99, 0.95), (1.0, 0.0, 0.5, 0.0)]:
            adv, ret = token_chain_gae(*case, *params)
            ref_adv, ref_ret = reference_token_gae(*case, *params)
            torch.testing.assert_close(adv, ref_adv, atol=1e-5, rtol=0)
            torch.testing.assert_close(ret, ref_ret, atol=1e-5, rtol=0)


def test_final_reward_is_not_discounted_away_within_a_reply():
    """With token_gamma = token_lambda = 1 every token of a 512-token reply sees the full reward."""
    T, E, N, L = 1, 1, 1, 512
    adv, _ = token_chain_gae(
        torch.ones(T, E, N), torch.zeros(T, E, N, L), torch.ones(T, E, N, L), torch.zeros(E), torch.ones(T, E, dtype=torch.bool), 0.99, 0.95
    )
    assert torch.allclose(adv, torch.ones_like(adv))


def test_padding_gets_nothing():
    gen = torch.Generator().manual_seed(1)
    rewards, values, mask, bootstrap, dones = random_case(gen, 3, 4, 2, 6)
    adv, ret = token_chain_gae(rewards, values, mask, bootstrap, dones, 0.99, 0.95)
    assert (adv[mask == 0] == 0).all() and (ret[mask == 0] == 0).all()


def test_token_gae_with_truncation_matches_per_token_loop():
    gen = torch.Generator().manual_seed(2)
    for T, E, N, L in [(1, 1, 1, 1), (3, 4, 2, 5), (4, 5, 3, 7)]:
        rewards, values, mask, bootstrap, terminated = random_case(gen, T, E, N, L)
        truncated = torch.rand(T, E, generator=gen) < 0.35
        final_values = torch.randn(T, E, generator=gen, dtype=torch.float64)
        for params in [(0.99, 0.95, 1.0, 1.0), (0.9, 0.8, 0.99, 0.95)]:
            adv, ret = token_chain_gae(rewards, values, mask, bootstrap, terminated, *params, truncated, final_values)
            ref_adv, ref_ret = reference_token_gae(rewards, values, mask, bootstrap, terminated, *params, truncated, final_values)
            torch.testing.assert_close(adv, ref_adv, atol=1e-5, rtol=0)
            torch.testing.assert_close(ret, ref_ret, atol=1e-5, rtol=0)
