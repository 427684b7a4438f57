"""Log-probs and entropies of reply tokens from the decoder's last hidden states, the vocabulary's logits
formed a few rows at a time.

A scoring forward needs, for every reply token, the log-softmax over the whole vocabulary. Formed at once
that is several ``(B, L, V)`` float32 tensors (the tempered logits, their log-softmax, for the entropy their
exponential and product), and autograd keeps some of them for the backward: with Qwen2.5's 151,936-token
vocabulary, 128 replies of 128 tokens hold ~9.3 GiB per tensor. Here the rows are cut into chunks whose float32
logits fit a budget (``--max_logits_mib``); each chunk runs the output layer, the log-softmax, the gather and
the entropy, and under autograd runs inside :func:`torch.utils.checkpoint.checkpoint`, which keeps only the
chunk's hidden states and recomputes its logits in the backward. The scoring's peak then follows the budget (a
few times it: the chunk's log-softmax, exponential and gradients live beside its logits), not the batch, for one
more output-layer product per chunk in the backward.

Each row's values are those of the one-pass computation to float rounding (row-wise operations; only the
matrix product's blocking may differ with the number of rows), and a batch within the budget takes the
one-pass path itself, so small models compute exactly what they did (``tests/agents/test_reply_scores.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch.utils.checkpoint import checkpoint

from marft.types import ReplyScores


def rows_per_chunk(rows: int, length: int, vocab: int, max_logits_mib: int) -> int:
    """How many rows of ``length`` positions fit ``max_logits_mib`` MiB of float32 logits over ``vocab``: at least
    one (a row over the budget is a chunk of its own), every row when the budget is 0 (off). The chunk's peak is
    a few times this tensor (its log-softmax, exponential and their gradients live beside it)."""
    if max_logits_mib <= 0:
        return rows
    return max(1, min(rows, (max_logits_mib * 2**20) // max(1, 4 * length * vocab)))


def score_tokens(
    logits: torch.Tensor, response_ids: torch.Tensor, response_mask: torch.Tensor, with_entropy: bool,
    entropy_grad: bool, top_k: int,
) -> ReplyScores:
    """The one-pass scores of ``logits (B, L, V)`` (already tempered, float32) for ``response_ids (B, L)``: a
    :class:`ReplyScores` without the forward's position counts (the caller's)."""
    logp_all = torch.log_softmax(logits, dim=-1)  # (B, L, V)
    taken = logp_all.gather(-1, response_ids.unsqueeze(-1))  # (B, L, 1)
    logprobs = taken.squeeze(-1) * response_mask  # (B, L)
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = -(logp_all.exp() * logp_all).sum(-1) * response_mask  # (B, L)
    out_of_topk = 0
    if top_k > 0:
        with torch.no_grad():
            kth = torch.topk(logp_all, min(top_k, logp_all.shape[-1]), dim=-1).values[..., -1:]  # (B, L, 1)
            out_of_topk = int(((taken < kth).squeeze(-1) & response_mask.bool()).sum())
    return ReplyScores(logprobs, entropy, out_of_topk)


def chunked_token_scores(
    states: torch.Tensor, output_layer: torch.nn.Module,
    scoring_logits: Callable[[torch.Tensor], torch.Tensor], response_ids: torch.Tensor, response_mask: torch.Tensor,
    with_entropy: bool = False, entropy_grad: bool = True, top_k: int = 0, max_logits_mib: int = 0,
) -> ReplyScores:
    """Scores of the reply tokens ``response_ids (B, L)`` from ``states (B, L + 1, H)``, the decoder's last hidden
    states at the prompt's last position and the reply's (position t predicts reply token t; the last one's
    logits are formed and unused, as in transformers' ``logits_to_keep``). ``output_layer``: the model's output
    embeddings (states → logits ``(..., V)``); ``scoring_logits``: logits → the tempered float32 logits whose
    log-softmax is the policy (``SamplingSettings.scoring_logits``).

    Rows are scored :func:`rows_per_chunk` at a time; under autograd each chunk is checkpointed (its logits
    recomputed in the backward)."""
    B, L = response_ids.shape
    step = rows_per_chunk(B, L + 1, output_layer.weight.shape[0], max_logits_mib)  # L + 1 positions form logits

    def chunk_scores(h, ids, mask):  # h (b, L + 1, H)
        return score_tokens(scoring_logits(output_layer(h)[:, :-1]), ids, mask, with_entropy, entropy_grad, top_k)

    if step >= B:  # within the budget: one pass, exactly as without chunking
        return chunk_scores(states, response_ids, response_mask)
    score = partial(checkpoint, chunk_scores, use_reentrant=False) if torch.is_grad_enabled() else chunk_scores
    chunks = [score(states[i:i + step], response_ids[i:i + step], response_mask[i:i + step]) for i in range(0, B, step)]
    entropy = torch.cat([c.entropy for c in chunks]) if with_entropy else None
    return ReplyScores(torch.cat([c.logprobs for c in chunks]), entropy, sum(c.out_of_topk for c in chunks))
