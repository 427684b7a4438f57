"""The diagnostics that show a policy's entropy collapse early, and the clip-higher surrogate."""

import pytest
import torch

from marft.algorithms.losses import clipped_policy_loss
from marft.runner.shared.buffer import RolloutBuffer
from marft.runner.shared.diagnostics import TeamDiagnostics


def plain_surrogate(new_logp, old_logp, advantages, low, high):
    """PPO's clipped surrogate entry by entry (a Python loop over floats), averaged; and the clip fraction."""
    total, clipped = 0.0, 0
    for new, old, adv in zip(new_logp.tolist(), old_logp.tolist(), advantages.tolist()):
        ratio = pow(2.718281828459045, new - old)
        bounded = min(max(ratio, 1 - low), 1 + high)
        total += min(ratio * adv, bounded * adv)
        clipped += ratio < 1 - low or ratio > 1 + high
    return -total / len(advantages), clipped / len(advantages)


@pytest.mark.parametrize("high", [None, 0.2, 0.28, 0.5])
def test_clip_higher_surrogate_matches_a_plain_loop(high):
    gen = torch.Generator().manual_seed(0)
    new_logp, old_logp = torch.randn(64, generator=gen) * 0.4, torch.randn(64, generator=gen) * 0.4
    advantages = torch.randn(64, generator=gen)
    loss, stats = clipped_policy_loss(new_logp, old_logp, advantages, 0.2, clip_param_high=high)
    expected, clip_frac = plain_surrogate(new_logp, old_logp, advantages, 0.2, 0.2 if high is None else high)
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    assert float(stats["clip_frac"]) == pytest.approx(clip_frac)


def test_clip_higher_lets_an_unlikely_good_reply_gain_more():
    """With a positive advantage, the gradient vanishes once the ratio passes 1 + clip: a wider upper bound keeps it."""
    old = torch.zeros(1)
    new = torch.tensor([0.25], requires_grad=True)  # ratio 1.28 > 1.2
    clipped_policy_loss(new, old, torch.ones(1), 0.2)[0].backward()
    assert float(new.grad) == 0.0
    new.grad = None
    clipped_policy_loss(new, old, torch.ones(1), 0.2, clip_param_high=0.3)[0].backward()
    assert float(new.grad) < 0  # the loss still falls as the reply's probability rises


def test_zero_advantage_share_per_role_and_overall():
    T, E, N = 2, 3, 2
    buffer = RolloutBuffer(T, E, N, max_prompt_len=4, max_new_tokens=3, pad_id=0)
    buffer.agent[:] = torch.arange(N)  # every slot played, slot n by agent n
    buffer.response_mask[..., :2] = 1
    buffer.advantages[:, :, 0] = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.0, 0.0]])  # agent 0: 4 of 6 turns zero
    buffer.advantages[:, :, 1] = 1.0  # agent 1: none zero
    stats = TeamDiagnostics(["Reasoner", "Actor"]).rollout_stats(buffer)
    assert stats["roles/Reasoner/zero_advantage_share"] == pytest.approx(4 / 6)
    assert stats["roles/Actor/zero_advantage_share"] == 0.0
    assert stats["charts/zero_advantage_share"] == pytest.approx(4 / 12)
    # token level: a turn is zero when every real reply token's advantage is 0 (padding does not count)
    buffer.token_advantages[..., 2] = 7.0  # padding only
    buffer.token_advantages[0, 0, 1, 1] = 0.3  # one real token of one Actor turn
    stats = TeamDiagnostics(["Reasoner", "Actor"]).rollout_stats(buffer, token_level=True)
    assert stats["roles/Reasoner/zero_advantage_share"] == 1.0
    assert stats["roles/Actor/zero_advantage_share"] == pytest.approx(5 / 6)


def bare_trainer(**algo):
    """An APPOTrainer without a team: enough for its entropy-control arithmetic."""
    from marft.algorithms.appo_trainer import APPOTrainer
    from marft.config import AlgoConfig
    from marft.distributed import SINGLE

    trainer = APPOTrainer.__new__(APPOTrainer)
    trainer.config, trainer.dist = AlgoConfig(**algo), SINGLE
    trainer.entropy_coefs = {"Reasoner": trainer.config.entropy_coef, "Actor": trainer.config.entropy_coef}
    return trainer


def test_adaptive_entropy_weight_rises_below_the_target_and_falls_to_zero_above():
    trainer = bare_trainer(target_entropy=0.2, entropy_coef_step=0.01)
    for expected in (0.01, 0.02, 0.03):
        trainer.adapt_entropy_coef("Reasoner", [0.05, 0.15])  # mean 0.1 < 0.2
        assert trainer.entropy_coefs["Reasoner"] == pytest.approx(expected)
    assert trainer.entropy_coefs["Actor"] == 0.0  # each adapter its own weight
    for expected in (0.02, 0.01, 0.0, 0.0):
        trainer.adapt_entropy_coef("Reasoner", [0.3])
        assert trainer.entropy_coefs["Reasoner"] == pytest.approx(expected)
    trainer.adapt_entropy_coef("Reasoner", [])  # no chunk: nothing measured, nothing moves
    assert trainer.entropy_coefs["Reasoner"] == 0.0


def test_a_fixed_entropy_weight_never_moves():
    trainer = bare_trainer(entropy_coef=0.01)
    trainer.adapt_entropy_coef("Reasoner", [0.0])
    assert trainer.entropy_coefs["Reasoner"] == 0.01


@pytest.mark.parametrize("flag, value", [("target_entropy", 0.0), ("target_entropy", -1.0), ("entropy_coef_step", -0.1),
                                         ("clip_param", 0.0), ("clip_param", 1.0), ("clip_param_high", 0.0)])
def test_entropy_and_clip_flags_are_validated(flag, value):
    from marft.config import AlgoConfig

    with pytest.raises(ValueError, match=f"--{flag}"):
        AlgoConfig(**{flag: value})
