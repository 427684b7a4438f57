"""Prompts that open alike after the role header (a game's rules) run that opening once per group of rows
(``--share_prompt_openings``, off by default): the chosen opening is the one a plain search over every length picks, and the
log-probs, gradients, values and samples equal those of the role header shared alone."""

import random

import pytest
import torch
from test_team import make_team

from marft.agents.openings import MIN_SAVED_SHARE, drop_openings, positions_saved, shared_opening
from marft.agents.prompts import left_pad

pytestmark = pytest.mark.usefixtures("one_thread")

RULES = ("You are Player {seat} in a game of Four.\nDrop a disc into a column from 0 to 6.\nThe first to connect "
         "four discs wins.\nAnswer with the column in brackets, e.g. [col 3].\n")
BOARDS = ["Board:\n. . X . . . .\n", "Board:\n. O X . . . .\n", "Board:\n. O X X . . .\n",
          "Board:\nO O X X . . .\nYour move.\n", "Board:\n. . . . . . X\n", "Board:\nX . . . . . .\n"]
HISTORIES = [RULES.format(seat=i % 2) + board for i, board in enumerate(BOARDS)]
"""Six prompts of two seats: two long openings (each seat's rules) and a short rest each."""


def plain_opening(rows: list[list[int]], header_tokens: int, min_share: float = MIN_SAVED_SHARE) -> int:
    """The opening length by trying every length: the most positions saved, the shortest among equals, none when it
    saves less than ``min_share`` of the rows' tokens."""
    best, best_saved = 0, min_share * sum(map(len, rows))
    for length in range(1, min(map(len, rows))):
        saved = positions_saved(length, len(rows), len({tuple(r[:length]) for r in rows}), header_tokens)
        if saved > best_saved:
            best, best_saved = length, saved
    return best


def test_positions_saved_counts_the_dropped_openings_and_the_extra_headers():
    assert positions_saved(10, rows=6, groups=2, header_tokens=5) == 10 * 4 - 5
    assert positions_saved(10, rows=6, groups=6, header_tokens=0) == 0


@pytest.mark.parametrize("seed", range(40))
def test_the_opening_is_the_one_a_search_over_every_length_picks(seed):
    """Random batches built from a few openings of random lengths, tails of random lengths (some rows only an
    opening and a token, some sharing part of another opening), left-padded: the length equals the plain search's,
    rows of a group share their opening and different groups' openings differ, groups numbered by first appearance."""
    rng = random.Random(seed)
    stems = [[rng.randrange(5) for _ in range(rng.randrange(0, 30))] for _ in range(rng.randrange(1, 4))]
    rows = [rng.choice(stems) + [rng.randrange(5) for _ in range(rng.randrange(1, 12))] for _ in range(rng.randrange(1, 9))]
    ids, mask = left_pad(rows, pad_id=99)
    header_tokens = rng.choice([0, 3, 20])
    opening = shared_opening(ids, mask, header_tokens)
    assert opening.length == plain_opening(rows, header_tokens)
    prefixes = [tuple(r[: opening.length]) for r in rows]
    firsts = list(dict.fromkeys(prefixes))
    assert opening.openings == [list(p) for p in firsts]
    assert opening.group_of_row.tolist() == [firsts.index(p) for p in prefixes]
    rest_ids, rest_mask = drop_openings(ids, mask, opening.length, pad_id=99)
    assert rest_ids.shape[1] == max(len(r) for r in rows) - opening.length
    for row, r_ids, r_mask in zip(rows, rest_ids, rest_mask):
        rest = row[opening.length:]
        assert len(rest) >= 1 and r_mask.tolist() == [0] * (len(r_mask) - len(rest)) + [1] * len(rest)
        assert r_ids.tolist() == [99] * (len(r_ids) - len(rest)) + rest


def test_nothing_is_shared_when_switched_off_or_for_one_row():
    ids, mask = left_pad([[1, 2, 3, 4], [1, 2, 3, 5]], pad_id=0)
    assert shared_opening(ids, mask, 0).length == 3
    assert shared_opening(ids, mask, 0, enabled=False).length == 0
    assert shared_opening(ids[:1], mask[:1], 0).length == 0


def _scores_and_gradients(team, adapter, agent, prompt_ids, prompt_mask, response_ids, response_mask):
    team.set_active(adapter, trainable=True)
    agents = torch.full((len(prompt_ids),), agent, dtype=torch.long)
    scores = team.response_logprobs(adapter, prompt_ids, prompt_mask, response_ids, response_mask, agents=agents)
    (scores.logprobs * response_mask).sum().backward()
    grads = [p.grad.clone() for p in team.adapter_parameters(adapter)]
    team.model.zero_grad(set_to_none=True)
    team.set_active(None)
    return scores, grads


def test_rows_sharing_their_rules_run_them_once_with_the_plain_results(random_model_dir, monkeypatch):
    """Two seats' rules open six prompts: the rules run once per seat with the role header (two header rows, each
    longer than the header by most of the rules), the forward runs fewer positions, and the log-probs, LoRA
    gradients, critic values and sampled replies equal those with the role header shared alone."""
    team = make_team(random_model_dir, context_window=256, share_prompt_openings=True)
    with torch.no_grad():
        for name, p in team.model.named_parameters():
            if "lora_" in name:
                p.normal_(std=0.3)
    agent, adapter = 1, team.agent_adapters[1]
    prompt_ids, prompt_mask = team.encode_prompts(agent, HISTORIES, [[("Reasoner", "column 3")]] * len(HISTORIES))
    header_rows = []
    original = team.headers.forward_headers
    monkeypatch.setattr(team.headers, "forward_headers", lambda ids, mask: header_rows.append(mask.sum(1).tolist()) or original(ids, mask))
    torch.manual_seed(0)
    sampled = team.sample(adapter, prompt_ids, prompt_mask, agent=agent)
    results = {}
    for share in (True, False):
        team.headers.share_openings = share
        torch.manual_seed(0)
        replies = team.sample(adapter, prompt_ids, prompt_mask, agent=agent)
        scores, grads = _scores_and_gradients(team, adapter, agent, prompt_ids, prompt_mask, replies.response_ids, replies.response_mask)
        with torch.no_grad():
            values = team.critic.values(prompt_ids, prompt_mask, agent=agent)
        results[share] = replies, scores, grads, values
    header = len(team.prompts.header_ids[agent])
    rules = len(team.prompts.encode_text(RULES.format(seat=0)))
    assert len(header_rows[0]) == 2 and min(header_rows[0]) >= header + rules - 12  # the seats' rules differ early on
    assert [len(rows) for rows in header_rows[-2:]] == [1, 1]  # switched off: the role header alone (policy, critic)
    (on_replies, on_scores, on_grads, on_values), (off_replies, off_scores, off_grads, off_values) = results[True], results[False]
    assert torch.equal(sampled.response_ids, on_replies.response_ids) and torch.equal(on_replies.response_ids, off_replies.response_ids)
    torch.testing.assert_close(on_replies.logprobs, off_replies.logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(on_scores.logprobs, off_scores.logprobs, atol=1e-5, rtol=0)
    assert on_scores.positions < off_scores.positions - 3 * rules
    for ours, theirs in zip(on_grads, off_grads, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-4 * float(theirs.abs().max()), rtol=0)
    assert any(g.abs().sum() > 0 for g in off_grads)
    torch.testing.assert_close(on_values, off_values, atol=1e-5, rtol=0)


def test_the_flag_reaches_the_header_cache(random_model_dir):
    assert not make_team(random_model_dir).headers.share_openings  # off unless asked: seeded runs keep their draws
    assert make_team(random_model_dir, share_prompt_openings=True).headers.share_openings


def test_the_warm_starts_loss_is_the_whole_rows_loss(random_model_dir):
    """With ``--share_prompt_openings``, ``marft.sft.reply_nll`` (each role header and the seats' rules once per batch,
    the rest on its real tokens) gives the per-token losses and LoRA gradients of :func:`marft.sft.reply_loss` on whole
    rows (what it runs without the flag)."""
    from marft.sft import TurnExample, collate_turns, reply_loss, reply_nll

    team = make_team(random_model_dir, context_window=256, share_prompt_openings=True)
    with torch.no_grad():
        for name, p in team.model.named_parameters():
            if "lora_" in name:
                p.normal_(std=0.3)
    batch = []
    for agent in range(team.n_agents):
        (prompt_ids, prompt_mask) = team.encode_prompts(agent, HISTORIES, [[]] * len(HISTORIES))
        batch += [TurnExample(agent, ids[mask.bool()].tolist(), team.prompts.encode_reply(f" [col {i}]")[: 2 + i] + [team.eos_id])
                  for i, (ids, mask) in enumerate(zip(prompt_ids, prompt_mask))]
    adapter = team.agent_adapters[0]
    results = []
    for whole in (True, False):
        team.set_active(adapter, trainable=True)
        if whole:
            team.bank.route(adapter)
            losses = reply_loss(team.model.get_base_model(), *collate_turns(batch, team.pad_id), reduction="none")
        else:
            losses = reply_nll(team, adapter, batch, reduction="none")
        losses.sum().backward()
        results.append((losses.detach(), [p.grad.clone() for p in team.adapter_parameters(adapter)]))
        team.model.zero_grad(set_to_none=True)
    (whole_losses, whole_grads), (shared_losses, shared_grads) = results
    assert len(shared_losses) == sum(len(e.reply_ids) for e in batch)
    torch.testing.assert_close(shared_losses, whole_losses, atol=1e-5, rtol=0)
    for ours, theirs in zip(shared_grads, whole_grads, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-4 * float(theirs.abs().max()), rtol=0)
    assert any(g.abs().sum() > 0 for g in whole_grads)
    torch.testing.assert_close(reply_nll(team, adapter, batch), whole_losses.mean(), atol=1e-5, rtol=0)
