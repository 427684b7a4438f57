"""``--max_chunk_tokens`` (issue 30, memory): a minibatch's gradient-accumulation chunks are cut by a padded-token
budget, so a chunk of later agents' longer prompts holds no more tokens than the budget; the gradient is the same."""

import pytest
import torch
from test_rl_audit import one_step_gradients, perturb_adapters
from test_team import fill_buffer, make_team

from marft.algorithms import TRAINERS, trainer_class
from marft.algorithms.appo_trainer import APPOTrainer
from marft.config import AlgoConfig
from marft.types import TurnBatch

pytestmark = pytest.mark.usefixtures("one_thread")


def padded_tokens(samples: TurnBatch, chunk: torch.Tensor) -> int:
    """Tokens of ``chunk``'s forward as the trainer runs it: rows x (trimmed prompt + trimmed reply columns)."""
    mb = TurnBatch(prompt_ids=samples.prompt_ids, prompt_mask=samples.prompt_mask, response_ids=samples.response_ids,
                   response_mask=samples.response_mask).rows(chunk).trimmed("cpu")
    width = mb.prompt_ids.shape[1] + (mb.response_ids.shape[1] if mb.response_ids is not None else 0)
    return len(chunk) * width


def test_split_keeps_order_and_fits_the_budget():
    """Rows in order, padded width = longest prompt + longest reply; a row wider than the budget is a part alone."""
    prompt = torch.tensor([2, 3, 3, 4, 9, 5])  # real prompt tokens per row
    reply = torch.tensor([1, 1, 2, 2, 3, 1])
    P, L = 10, 4
    prompt_mask = (torch.arange(P).flip(0) < prompt[:, None]).long()  # left padding
    response_mask = (torch.arange(L) < reply[:, None]).long()  # right padding
    samples = TurnBatch(prompt_ids=prompt_mask * 7, prompt_mask=prompt_mask, response_ids=response_mask * 7, response_mask=response_mask)
    chunk = torch.tensor([5, 0, 1, 2, 3, 4])
    parts = APPOTrainer._token_budget_split(samples, chunk, budget=12)
    # row 5 (6) + row 0 -> 2 x 6 = 12 fits; + row 1 -> 3 x 6 = 18 no; rows 1,2 -> 2 x 5 = 10; + row 3 -> 3 x 6 no;
    # row 3 (6) alone (+ row 4 -> 2 x 12 no); row 4 (12) alone
    assert [p.tolist() for p in parts] == [[5, 0], [1, 2], [3], [4]]
    assert torch.equal(torch.cat(parts), chunk)
    assert all(padded_tokens(samples, p) <= 12 for p in parts)
    assert [p.tolist() for p in APPOTrainer._token_budget_split(samples, chunk, budget=1)] == [[r] for r in chunk.tolist()]
    assert [p.tolist() for p in APPOTrainer._token_budget_split(samples, chunk, budget=10**6)] == [chunk.tolist()]


def test_split_counts_the_longest_header_before_the_longest_rest():
    """Rows of agents whose role headers differ run behind shared headers as [longest header][longest rest]: two rows
    of 8 prompt tokens, one behind a 6-token header (rest 2), one behind a 2-token header (rest 6), take 2 x (6 + 6)
    tokens together, not 2 x 8 (the critic's chunks mix agents)."""
    P = 10
    prompt_mask = (torch.arange(P).flip(0) < torch.tensor([8, 8])[:, None]).long()
    samples = TurnBatch(prompt_ids=prompt_mask * 7, prompt_mask=prompt_mask)
    chunk, headers = torch.tensor([0, 1]), torch.tensor([6, 2])
    assert [p.tolist() for p in APPOTrainer._token_budget_split(samples, chunk, budget=20)] == [[0, 1]]
    assert [p.tolist() for p in APPOTrainer._token_budget_split(samples, chunk, budget=20, header_lengths=headers)] == [[0], [1]]
    assert [p.tolist() for p in APPOTrainer._token_budget_split(samples, chunk, budget=24, header_lengths=headers)] == [[0, 1]]


@pytest.mark.parametrize("algorithm", sorted(TRAINERS))
def test_gradient_does_not_depend_on_the_chunk_token_budget(random_model_dir, algorithm):
    """The policy's and the critic's first-step gradients are the same (allclose) with no budget (one chunk) and
    with a budget that cuts each minibatch into several chunks, every one within the budget."""
    torch.manual_seed(0)
    team = make_team(random_model_dir)
    perturb_adapters(team, std=0.1)
    results, seen = {}, {}
    for budget in (None, "small"):
        if budget is None:
            trainer = trainer_class(algorithm)(team, AlgoConfig(algorithm_name=algorithm, ppo_epoch=1), steps_per_iteration=8)
            torch.manual_seed(0)
            buffer = fill_buffer(team, trainer=trainer)
            lengths = torch.tensor([1, 6, 2, 5, 3, 6, 1, 4])  # (T·E,) ragged replies
            ragged = (torch.arange(buffer.response_mask.shape[-1]) < lengths.view(2, 4, 1, 1)).long()  # (T, E, 1, L)
            buffer.response_mask = buffer.response_mask * ragged
            trainer.compute_advantages(buffer)
            policy_samples = buffer.agent_samples(0, trainer.token_level)
            critic_samples = buffer.critic_samples(trainer.token_level)
            rows = torch.arange(len(policy_samples.prompt_ids))
            budget_value = padded_tokens(policy_samples, rows) // 3  # about three chunks of the policy's minibatch
        else:
            trainer = trainer_class(algorithm)(
                team, AlgoConfig(algorithm_name=algorithm, ppo_epoch=1, max_chunk_tokens=budget_value), steps_per_iteration=8
            )
        chunks_seen = []
        original = trainer._minibatches

        def spy(samples, chunks_per_minibatch, original=original, chunks_seen=chunks_seen):
            out = original(samples, chunks_per_minibatch)
            chunks_seen.append([(samples, chunk) for chunks, _ in out for chunk in chunks])
            return out

        trainer._minibatches = spy
        results[budget] = [one_step_gradients(trainer, trainer.update_policy, "reasoner", policy_samples)]
        if trainer.uses_critic:  # GRPO has none
            results[budget].append(one_step_gradients(trainer, trainer.update_critic, critic_samples))
        seen[budget] = chunks_seen
        team.set_active(None)
    assert [len(call) for call in seen[None]] == [1, team.n_agents][: len(seen[None])]  # policy: 1 chunk, critic: one per agent
    for call, uncut in zip(seen["small"], seen[None]):
        assert len(call) > len(uncut)  # the budget cut the policy's and the critic's minibatches further
        assert sorted(torch.cat([c for _, c in call]).tolist()) == list(range(len(call[0][0].prompt_ids)))  # every row once
        assert all(padded_tokens(s, c) <= budget_value for s, c in call if len(c) > 1)
    for ones, cut in zip(results[None], results["small"]):
        assert len(ones) == len(cut) > 0 and any(g.abs().sum() > 0 for g in ones)
        for a, b in zip(ones, cut):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_the_budget_must_be_positive():
    with pytest.raises(ValueError, match="--max_chunk_tokens must be"):
        AlgoConfig(max_chunk_tokens=0)
