"""The KL penalty toward a reference policy: its estimator per reply token and the reference's log-probs.

``--kl_estimator`` with ``r = log p_ref - log p``: k3, ``exp(r) - r - 1`` (as GRPO papers put it in the loss; on the
policy's own samples its gradient is ``-E_ref[grad log p]``, that of KL(reference || policy): a pull toward every
reply the reference writes), or k2, ``r^2 / 2`` (its gradient ``E_p[-r grad log p]`` is that of
KL(policy || reference), the regularised objective's). The reference is ``--kl_reference``'s: the adapter's frozen
copy from the start of training, or the base model.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch

from marft.agents.team import AgentTeam
from marft.algorithms.losses import normalize_logprobs
from marft.config import AlgoConfig
from marft.types import TurnBatch


def reference_kl(config: AlgoConfig, token_logp: torch.Tensor, mb: TurnBatch, reply_mode: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(kl_sum, kl_to_reference)``: the loss's KL term by ``--kl_estimator`` summed over the chunk's loss units (in
    the graph), and the KL's k3 value per real reply token (detached, logged whatever the estimator).

    The update divides ``kl_sum`` by the loss units of the global minibatch, so the KL is weighed against the
    policy loss in that loss's own units, whatever the chunks or the processes: a token's KL beside a token's term
    for the token-level losses (``reply_mode`` None); for a loss per reply (``reply_mode``, its
    ``--normalization_mode``) each reply's token KL combined as its log-prob is (summed, per token or per word), so
    a token's KL keeps the same weight against its advantage in every mode. ``token_logp``: ``(B, L)`` of the
    current policy; ``mb.ref_logprobs`` ``(B, L)`` the reference's."""
    mask = mb.response_mask.float()  # (B, L)
    log_ratio = (mb.ref_logprobs - token_logp) * mask  # (B, L)
    k3 = (torch.exp(log_ratio) - log_ratio - 1) * mask  # (B, L): the KL's value, logged whatever the estimator
    term = k3 if config.kl_estimator == "k3" else 0.5 * log_ratio.square() * mask  # (B, L) the loss's term
    kl_sum = term.sum() if reply_mode is None else normalize_logprobs(term, mask, mb.n_words, reply_mode).sum()
    return kl_sum, k3.sum().detach() / mask.sum().clamp(min=1)


@torch.no_grad()
def reply_logprobs(team: AgentTeam, config: AlgoConfig, samples: TurnBatch, route: str, base_model: bool = False) -> torch.Tensor:
    """``(B, L)`` log-probs of the sampled replies under adapter ``route`` (``base_model``: every adapter off), in
    chunks of one gradient-accumulation chunk's size, without gradients or LoRA dropout; zero at padding."""
    n_samples, L = samples.response_ids.shape
    size = max(1, math.ceil(n_samples / (config.num_mini_batch * config.gradient_cp_steps)))
    out = torch.zeros(n_samples, L)
    with torch.no_grad(), team.bank.lora_dropout_paused(), team.bank.reference_policy() if base_model else nullcontext():
        for rows in torch.arange(n_samples).split(size):
            mb = TurnBatch(agent=samples.agent, prompt_ids=samples.prompt_ids, prompt_mask=samples.prompt_mask, response_ids=samples.response_ids,
                           response_mask=samples.response_mask).rows(rows).trimmed(team.device)
            scores = team.response_logprobs(route, mb.prompt_ids, mb.prompt_mask, mb.response_ids, mb.response_mask, agents=mb.agent)
            out[rows, : scores.logprobs.shape[1]] = scores.logprobs.float().cpu()
    return out


def reference_logprobs(team: AgentTeam, config: AlgoConfig, samples: TurnBatch, adapter: str | None = None) -> torch.Tensor:
    """``(B, L)`` log-probs of the sampled replies under the reference policy of ``adapter`` (``--kl_reference``):
    its frozen copy from the start of training (``initial``: :meth:`AgentTeam.add_reference_adapters`), or the
    base model (``base``: every adapter off, free with LoRA) (:func:`reply_logprobs`)."""
    reference = team.reference_adapters.get(adapter) if adapter is not None else None
    return reply_logprobs(team, config, samples, reference or team.policy_adapters[0], base_model=reference is None)
