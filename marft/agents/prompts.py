"""The prompt encoder: an agent's prompt as token ids, written the one way the team, the supervised
warm start (``marft.sft``) and the embedded model's build (``marft.models.tiny``) all share.

Every prompt of agent ``a`` is ``[role header a][private observation][shared history + earlier
replies + cue]`` (``marft.prompting``); the header is kept whole, the history is cut from the left to fit
the prompt budget. The private observation is kept whole too, unless it would leave the body less than a
quarter of the room (or the whole body, if shorter): then its oldest text goes, as the history's does
(e.g. a self-play game seat's view grown by retried moves: its latest board stays), and a warning says so
once per encoder. A head the environment keeps (``MultiAgentTextEnv.kept_heads``: e.g. a game's rules, which
open the history or the private observation) stays whole when it takes at most half of what its part may
keep: the oldest text after it goes instead. Prompts that fit are the same ids with or without a head.

With a chat template (``--chat_template auto`` and a tokenizer that has one) the same parts are one chat:
``[template up to the user content: system turn = role prompt][private observation][shared history +
earlier replies][handover line + template after the user content: end of user turn, assistant
generation prompt]``. The first part is again the role header (the same for every prompt of the agent,
so its keys/values stay shareable), the last is kept whole. A template that refuses a system message gets
the role prompt at the head of the user message, inside the header all the same.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence

import torch

from marft.choices import CHAT_TEMPLATE_MODES
from marft.prompting import build_prompt, format_conversation, format_header, format_private, handover_text

logger = logging.getLogger(__name__)

USER_PLACEHOLDER = "MARFT-USER-CONTENT-1f7c"
"""Rendered as the user message once per agent to find where its prompts' own text goes in the template."""


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


def right_pad(rows: Sequence[list[int]], pad_id: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Id lists, right-padded to the longest (as replies are): ``ids (B, W)`` and ``mask (B, W)`` (1 on real tokens)."""
    ids, mask = left_pad([row[::-1] for row in rows], pad_id, device)
    return ids.flip(1), mask.flip(1)


class PromptEncoder:
    """Tokenises agents' prompts.

    Args:
        tokenizer: a Hugging Face tokenizer (no special tokens are added).
        profile: one ``AgentSpec`` (role, prompt) per agent.
        max_prompt_len: prompt budget in tokens (``--context_window - --max_new_tokens`` in a team).
        chat_template: ``auto``: render prompts with ``tokenizer.chat_template`` when it is set; ``none``: the
            plain transcript (:data:`CHAT_TEMPLATE_MODES`).

    Raises:
        ValueError: an unknown ``chat_template``; a role header (with the chat suffix) alone fills the budget;
            a chat template that does not render the user message exactly once.
    """

    def __init__(self, tokenizer, profile: Sequence, max_prompt_len: int, chat_template: str = "none"):
        if chat_template not in CHAT_TEMPLATE_MODES:
            raise ValueError(f"chat_template must be one of {', '.join(CHAT_TEMPLATE_MODES)}, got {chat_template!r}")
        self.tokenizer = tokenizer
        self.profile = list(profile)
        self.max_prompt_len = max_prompt_len
        self.cut_private_observations = 0
        """Prompts whose private observation was cut from the left to leave the body its share of the budget."""
        self.cut_histories = 0
        """Prompts whose body (the shared history, the earlier replies, the cue) was cut from the left to fit: its
        oldest text went, the problem's opening lines first (e.g. a game's rules under a long retried move)."""
        self.uses_chat_template = chat_template == "auto" and bool(getattr(tokenizer, "chat_template", None))
        """Whether prompts are rendered with the tokenizer's chat template (else the plain transcript)."""
        if self.uses_chat_template:
            parts = [self._chat_parts(spec) for spec in self.profile]
        else:
            parts = [(build_prompt(spec.prompt, "", [], spec.role)[0], "") for spec in self.profile]
        self.header_ids = [self.encode_text(prefix) for prefix, _ in parts]
        """Per agent, its role header's ids (shared by every prompt of that agent: every row starts with it)."""
        self.suffix_ids = [self.encode_text(suffix) if suffix else [] for _, suffix in parts]
        """Per agent, the ids every prompt of it ends with: with a chat template the handover line, the end of the
        user turn and the assistant generation prompt; none in the plain transcript (its cue ends the body)."""
        for spec, header, suffix in zip(self.profile, self.header_ids, self.suffix_ids):
            if len(header) + len(suffix) >= max_prompt_len:
                framing = " with the chat template around its user message" if self.uses_chat_template else ""
                raise ValueError(
                    f"the role header of {spec.role!r}{framing} is {len(header) + len(suffix)} tokens, leaving nothing of "
                    f"the prompt budget ({max_prompt_len} = --context_window - --max_new_tokens); raise --context_window"
                )

    def _chat_parts(self, spec) -> tuple[str, str]:
        """``(prefix, suffix)``: the agent's chat rendered around its user message, the handover line leading the suffix."""
        import jinja2  # a dependency of chat templates in transformers; only needed when a tokenizer has one

        system = spec.prompt.strip()

        def render(messages: list[dict]) -> str:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

        try:
            text = render(([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": USER_PLACEHOLDER}])
        except jinja2.TemplateError:
            if not system:
                raise
            # a template without a system role (Gemma's, early Mistral's): the role prompt opens the user message
            text = render([{"role": "user", "content": format_header(system) + USER_PLACEHOLDER}])
        if text.count(USER_PLACEHOLDER) != 1:
            raise ValueError(
                f"the tokenizer's chat template renders the user message of {spec.role!r} "
                f"{text.count(USER_PLACEHOLDER)} times instead of once, so marft cannot tell where a prompt's text goes; "
                "fix the template or pass --chat_template none"
            )
        prefix, suffix = text.split(USER_PLACEHOLDER)
        return prefix, handover_text(spec.role) + suffix

    def encode_text(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def encode_reply(self, text: str) -> list[int]:
        """A reply as the agent would sample it (no EOS): after the plain cue ``"Role:"`` it opens with a space,
        as the assistant turn of a chat template it does not."""
        return self.encode_text(text.strip() if self.uses_chat_template else " " + text.strip())

    def encode_rows(
        self,
        agent: int,
        histories: Sequence[str],
        earlier_turns: Sequence[list[tuple[str, str]]],
        private: Sequence[str] | None = None,
        heads: Sequence[str] | None = None,
    ) -> list[list[int]]:
        """Agent ``agent``'s prompts as unpadded id lists, each ≤ ``max_prompt_len``:
        ``header_ids[agent] + private + body + suffix_ids[agent]``, the body cut from the left.

        Args:
            histories: per prompt, the environment's shared observation.
            earlier_turns: per prompt, ``(role, reply)`` of the agents that already spoke this step.
            private: per prompt, text only this agent sees (None: nothing).
            heads: per prompt, the text that opens its private observation (when it has one) or else its history
                and that a cut keeps whole (``MultiAgentTextEnv.kept_heads``; "" or None: none).

        Raises:
            ValueError: a head that does not open the text it belongs to.
        """
        spec = self.profile[agent]
        if self.uses_chat_template:
            bodies = [format_conversation(h, turns) for h, turns in zip(histories, earlier_turns)]
        else:
            bodies = [build_prompt(spec.prompt, h, turns, spec.role)[1] for h, turns in zip(histories, earlier_turns)]
        header, suffix = self.header_ids[agent], self.suffix_ids[agent]
        private_texts = [format_private(text) for text in private] if private is not None else [""] * len(bodies)
        with_starts = heads is not None and any(heads)  # where each token starts, to find a head's end in the ids
        private_ids, private_starts = [[] for _ in bodies], None
        if any(private_texts):
            private_ids, private_starts = self._tokenize(private_texts, with_starts)
        body_ids, body_starts = self._tokenize(bodies, with_starts)
        room = self.max_prompt_len - len(header) - len(suffix)  # > 0, checked in __init__
        rows = []
        for row, (kept, ids) in enumerate(zip(private_ids, body_ids)):
            private_head, body_head = self._place_head(spec.role, heads[row] if heads is not None else "", private_texts[row], bodies[row])
            body_share = min(len(ids), max(1, room // 4))
            if len(kept) + body_share > room:  # the private observation's oldest text goes, the body keeps its share
                kept = self.cut_left(kept, None if private_starts is None else private_starts[row], private_head, room - body_share)
                if not self.cut_private_observations:
                    logger.warning("the private observation of %r is longer than the prompt budget leaves it (%d of %d tokens): "
                                   "its oldest text is cut%s (once per run: raise --context_window to keep it whole)", spec.role,
                                   room - body_share, self.max_prompt_len, ", after the head the environment keeps" if private_head else "")
                self.cut_private_observations += 1
            budget = room - len(kept)
            if len(ids) > budget:
                if not self.cut_histories:
                    logger.warning("the shared history of %r's prompt is longer than the prompt budget leaves it (%d tokens for %d): "
                                   "%d tokens are dropped, %s first (warned once per run: raise --context_window to keep the "
                                   "problem whole)", spec.role, len(ids), budget, len(ids) - budget,
                                   "the oldest after the head the environment keeps (e.g. a game's rules)" if body_head
                                   else "the problem's opening")
                self.cut_histories += 1
                ids = self.cut_left(ids, None if body_starts is None else body_starts[row], body_head, budget)
            rows.append(header + kept + ids + suffix)
        return rows

    @staticmethod
    def _place_head(role: str, head: str, private_text: str, body: str) -> tuple[str, str]:
        """``(private head, body head)``: a kept head belongs to the private observation when there is one, else to
        the body; it must open it (ValueError otherwise)."""
        if head and not (private_text or body).startswith(head):
            part = "private observation" if private_text else "history"
            raise ValueError(f"the kept head {head[:60]!r} of {role!r}'s prompt does not open its {part} "
                             f"({(private_text or body)[:60]!r}): kept_heads must return the text's opening")
        return (head, "") if private_text else ("", head)

    def _tokenize(self, texts: list[str], with_starts: bool) -> tuple[list[list[int]], list[list[int]] | None]:
        """``(ids, starts)`` per text: its tokens and, when asked and the tokenizer gives offsets (a slow one does
        not: None), the character each token starts at."""
        if with_starts:
            try:
                encoding = self.tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
                return encoding.input_ids, [[start for start, _ in offsets] for offsets in encoding["offset_mapping"]]
            except NotImplementedError:
                pass
        return self.tokenizer(texts, add_special_tokens=False).input_ids, None

    def cut_left(self, ids: list[int], starts: list[int] | None, head: str, budget: int) -> list[int]:
        """``ids`` cut to their last ``budget``, or, when their text opens with a ``head`` that takes at most half of
        ``budget``, to the head's tokens and the last of the others: both runs of the text's own tokens (every token
        that starts inside the head goes with it, found from ``starts``, the tokens' character offsets; without
        them the head is tokenised alone), so no seam token appears that the text lacks."""
        if budget <= 0:
            return []
        if head:
            n_head = bisect.bisect_left(starts, len(head)) if starts is not None else len(self.encode_text(head))
            if n_head <= budget // 2:
                return ids[:n_head] + ids[len(ids) - (budget - n_head):]
        return ids[max(0, len(ids) - budget):]

    def encode(
        self,
        agent: int,
        histories: Sequence[str],
        earlier_turns: Sequence[list[tuple[str, str]]],
        private: Sequence[str] | None = None,
        pad_id: int = 0,
        heads: Sequence[str] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`encode_rows`, left-padded: ``prompt_ids (B, P)`` and ``prompt_mask (B, P)``, P ≤ ``max_prompt_len``."""
        return left_pad(self.encode_rows(agent, histories, earlier_turns, private, heads), pad_id)
