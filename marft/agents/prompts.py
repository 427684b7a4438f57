"""The prompt encoder: an agent's prompt as token ids, written the one way the team, the supervised
warm start (``marft.sft``) and the embedded model's build (``marft.models.tiny``) all share.

Every prompt of agent ``a`` is ``[role header a][private observation][shared history + earlier
replies + cue]`` (``marft.prompting``); the header and the private observation are kept whole, the
history is cut from the left to fit the prompt budget.
"""

from __future__ import annotations

from typing import Sequence

import torch

from marft.prompting import build_prompt, format_private


def left_pad(rows: Sequence[list[int]], pad_id: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Id lists, left-padded to the longest: ``ids (B, W)`` and ``mask (B, W)`` (1 on real tokens)."""
    width = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for b, row in enumerate(rows):
        if row:
            ids[b, width - len(row) :] = torch.tensor(row, dtype=torch.long)
            mask[b, width - len(row) :] = 1
    return ids.to(device), mask.to(device)


class PromptEncoder:
    """Tokenises agents' prompts.

    Args:
        tokenizer: a Hugging Face tokenizer (no special tokens are added).
        profile: one ``AgentSpec`` (role, prompt) per agent.
        max_prompt_len: prompt budget in tokens (``--context_window - --max_new_tokens`` in a team).

    Raises:
        ValueError: a role header alone fills the budget.
    """

    def __init__(self, tokenizer, profile: Sequence, max_prompt_len: int):
        self.tokenizer = tokenizer
        self.profile = list(profile)
        self.max_prompt_len = max_prompt_len
        self.header_ids = [self.encode_text(build_prompt(spec.prompt, "", [], spec.role)[0]) for spec in self.profile]
        """Per agent, its role header's ids (shared by every prompt of that agent)."""
        for spec, ids in zip(self.profile, self.header_ids):
            if len(ids) >= max_prompt_len:
                raise ValueError(
                    f"the role header of {spec.role!r} is {len(ids)} tokens, more than the prompt budget "
                    f"({max_prompt_len} = --context_window - --max_new_tokens); raise --context_window"
                )

    def encode_text(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def encode_rows(
        self,
        agent: int,
        histories: Sequence[str],
        earlier_turns: Sequence[list[tuple[str, str]]],
        private: Sequence[str] | None = None,
    ) -> list[list[int]]:
        """Agent ``agent``'s prompts as unpadded id lists, each ≤ ``max_prompt_len``.

        Args:
            histories: per prompt, the environment's shared observation.
            earlier_turns: per prompt, ``(role, reply)`` of the agents that already spoke this step.
            private: per prompt, text only this agent sees (None: nothing).
        """
        spec = self.profile[agent]
        bodies = [build_prompt(spec.prompt, h, turns, spec.role)[1] for h, turns in zip(histories, earlier_turns)]
        headers = [self.header_ids[agent]] * len(bodies)
        if private is not None and any(private):
            private_ids = self.tokenizer([format_private(text) for text in private], add_special_tokens=False).input_ids
            headers = [self.header_ids[agent] + ids for ids in private_ids]
        rows = []
        for header, ids in zip(headers, self.tokenizer(bodies, add_special_tokens=False).input_ids):
            budget = self.max_prompt_len - len(header)
            if budget <= 0:
                raise ValueError(f"the role header and private observation of {spec.role!r} fill the whole prompt budget; raise --context_window")
            rows.append(header + ids[-budget:])
        return rows

    def encode(
        self,
        agent: int,
        histories: Sequence[str],
        earlier_turns: Sequence[list[tuple[str, str]]],
        private: Sequence[str] | None = None,
        pad_id: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`encode_rows`, left-padded: ``prompt_ids (B, P)`` and ``prompt_mask (B, P)``, P ≤ ``max_prompt_len``."""
        return left_pad(self.encode_rows(agent, histories, earlier_turns, private), pad_id)
