"""Supervised warm start of an agent team (SFT before RL): each role's adapter learns its own turns.

Data are multi-agent transcripts, one episode per JSONL line::

    {"problem": "Agree on one word: apple, river, stone, cloud.",
     "private": {"Reasoner": "x = 7"},                         # optional: what a role alone sees
     "kept_heads": {"Reasoner": "x = 7"},                      # optional: the opening a cut prompt keeps whole
     "turns": [{"role": "Agent 1", "text": "PICK: river"},
               {"role": "Agent 2", "text": "PICK: river"},
               {"role": "Judge", "text": "Try again."}, ...]}  # optional judge feedback between team steps

or drawn from an environment's ``demonstrations(n)`` (a scripted, deliberately imperfect expert). Every
agent turn becomes one example: the prompt the team would build at that moment (``PromptEncoder``:
role header, private observation, shared history, earlier replies of the step, the cue; or the same parts in
the tokenizer's chat template with ``--chat_template auto``) and the reply tokens (+ EOS) as the team would
sample them; the loss is on that reply only, through that role's adapter.
The result is a checkpoint (``checkpoints/steps_0``) that ``--load_path`` starts RL from.

The embedded model's build (``marft.models.tiny``) goes through the same path: its warm-start data are
transcripts, turned into examples by :func:`turn_examples`, batched by :func:`collate_turns` and scored by
:func:`reply_loss`, on all the model's weights instead of adapters.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from marft.agents.prompts import left_pad, right_pad
from marft.prompting import HOST_ROLE, JUDGE_ROLE, format_problem, format_turn
from marft.validation import check_fields

logger = logging.getLogger(__name__)


@dataclass
class SFTConfig:
    """The supervised warm start (``scripts/sft.py``)."""

    sft_data: str = "demonstrations"
    """Transcripts: a JSONL file (one episode per line), or ``demonstrations`` to draw them from the env's demonstrations(n)."""
    n_demonstrations: int = 2000
    """How many episodes to draw from the env's demonstrations (training split)."""
    recovery_share: float = 0.0
    """The share of demonstrated moves made after a rejected attempt (environments whose ``demonstrations`` take a
    ``recovery_share``: TextArena games), so the warm start shows what to do once the game rejects a move; 0: none."""
    sft_steps: int = 300
    """Optimizer steps of the warm start."""
    sft_batch_size: int = 32
    """Agent turns per step (all roles mixed; each role's turns go through its own adapter)."""
    sft_lr: float = 2e-3
    """Learning rate of the adapters during the warm start (AdamW, cosine decay)."""

    def __post_init__(self):
        check_fields(self)  # types, finite numbers and ranges (marft.validation.RULES)


@dataclass(frozen=True)
class TurnExample:
    """One agent turn to imitate."""

    agent: int
    """Index of the speaking agent in the profile."""
    prompt_ids: list[int]
    """The team's prompt for that turn, token ids (no padding)."""
    reply_ids: list[int]
    """The reply as the team would sample it (``PromptEncoder.encode_reply``: ``" " + text`` after the plain cue, the bare
    text as a chat template's assistant turn), then EOS."""


def load_transcripts(path: str | Path) -> tuple[list[dict], int]:
    """``(transcripts, skipped)`` from a JSONL file; a malformed line is skipped, counted and logged.

    Raises:
        FileNotFoundError: no such file.
        ValueError: no usable transcript at all.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--sft_data {path} does not exist; pass a JSONL file of transcripts or 'demonstrations'")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"--sft_data {path} is not UTF-8 text (byte {error.start}: {error.reason}); pass a JSONL file of transcripts") from None
    except OSError as error:
        raise ValueError(f"--sft_data {path} cannot be read: {error.strerror or error}") from None
    transcripts, skipped = [], 0
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            transcripts.append(check_transcript(json.loads(line)))
        except (ValueError, TypeError, KeyError) as error:
            skipped += 1
            logger.warning("%s line %d skipped: %s", path, number, error)
    if not transcripts:
        raise ValueError(f"{path} holds no usable transcript ({skipped} malformed lines)")
    return transcripts, skipped


def check_transcript(row: dict) -> dict:
    """``row`` itself when it is a transcript: a ``problem`` string and a list of ``turns`` with ``role`` and ``text``."""
    if not isinstance(row.get("problem"), str) or not isinstance(row.get("turns"), list) or not row["turns"]:
        raise ValueError("a transcript needs a 'problem' string and a non-empty 'turns' list")
    for turn in row["turns"]:
        if not isinstance(turn.get("role"), str) or not isinstance(turn.get("text"), str):
            raise ValueError(f"a turn needs 'role' and 'text' strings, got {turn!r}")
    for key in ("private", "kept_heads"):
        texts = row.get(key, {})
        if not isinstance(texts, dict) or not all(isinstance(text, str) for text in texts.values()):
            raise ValueError(f"'{key}' must map roles to texts")
    return row


def turn_examples(
    prompts, transcripts: Iterable[dict], *, eos_id: int, max_reply_tokens: int | None = None
) -> list[TurnExample]:
    """Every agent turn of ``transcripts`` as an example, prompted exactly as the team prompts it.

    A team step starts when the first agent speaks; the turns of the step before an agent's are its
    ``earlier_turns``, everything before the step (judge lines included) its history.

    Args:
        prompts: the team's :class:`~marft.agents.prompts.PromptEncoder` (``team.prompts``).
        eos_id: appended to every reply.
        max_reply_tokens: replies are cut to this many tokens, EOS included (the team's ``--max_new_tokens``).

    Raises:
        ValueError: a turn's role is not on the team (naming it and the team's roles).
    """
    roles = [spec.role for spec in prompts.profile]
    examples = []
    for transcript in transcripts:
        history, step_turns = format_problem(transcript["problem"]), []
        private, heads = transcript.get("private", {}), transcript.get("kept_heads", {})
        for turn in transcript["turns"]:
            role, text = turn["role"], turn["text"]
            if role == JUDGE_ROLE:
                history += "".join(format_turn(r, t) for r, t in step_turns) + format_turn(role, text)
                step_turns = []
                continue
            if role == HOST_ROLE:  # an orchestrated step's handover line: part of what the next speakers see
                step_turns.append((role, text))
                continue
            if role not in roles:
                raise ValueError(f"transcript turn by {role!r}, but the team's roles are {roles}")
            agent = roles.index(role)
            if agent == 0 and step_turns:  # a new team step
                history += "".join(format_turn(r, t) for r, t in step_turns)
                step_turns = []
            (prompt_ids,) = prompts.encode_rows(agent, [history], [list(step_turns)], [private.get(role, "")], [heads.get(role, "")])
            reply = prompts.encode_reply(text) + [eos_id]
            examples.append(TurnExample(agent, prompt_ids, reply[:max_reply_tokens]))
            step_turns.append((role, text))
    return examples


def collate_turns(batch: Sequence[TurnExample], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids, mask, labels)``, each ``(B, T)``: prompt then reply per row, RIGHT-padded (every row's
    positions start at 0, so no position ids are needed); ``labels`` hold the reply ids, -100 elsewhere."""
    width = max(len(e.prompt_ids) + len(e.reply_ids) for e in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, e in enumerate(batch):
        n = len(e.prompt_ids) + len(e.reply_ids)
        ids[row, :n] = torch.tensor(e.prompt_ids + e.reply_ids)
        labels[row, len(e.prompt_ids) : n] = torch.tensor(e.reply_ids)
        mask[row, :n] = 1
    return ids, mask, labels


def reply_loss(lm, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Mean next-token cross-entropy over the reply tokens (``labels != -100``) of a causal LM (with
    whatever LoRA adapter is active in it), the LM head run only where a reply token is predicted: most
    positions are prompt, and the head is a large share of a small model. ``reduction="none"``: one value per
    reply token ``(N,)``, in the rows' order.

    ``ids``, ``mask``, ``labels``: ``(B, T)``, as :func:`collate_turns` makes them.
    """
    hidden = lm.get_decoder()(input_ids=ids, attention_mask=mask).last_hidden_state  # (B, T, C)
    targets = labels[:, 1:]  # (B, T-1): the token each position predicts
    scored = targets != -100  # (B, T-1)
    logits = lm.get_output_embeddings()(hidden[:, :-1][scored])  # (N, V), N reply tokens in the batch
    return torch.nn.functional.cross_entropy(logits.float(), targets[scored], reduction=reduction)


def reply_nll(team, adapter: str, batch: Sequence[TurnExample], reduction: str = "mean") -> torch.Tensor:
    """Mean negative log-likelihood of the batch's reply tokens under ``adapter`` (temperature 1); ``reduction="none"``:
    per reply token, in the order of ``[t for e in batch for t in e.reply_ids]``.

    With ``--share_prompt_openings`` the prompts run as the update runs them: each agent's role header and an opening
    its prompts share once for the batch (``team.headers``), the rest on its real tokens (``--unpadded_forward``), and
    the output layer only where a reply token is predicted; the same loss as :func:`reply_loss` of the whole rows
    (without it), to float32 rounding."""
    team.bank.route(adapter)
    headers = team.headers
    if not headers.share_openings:
        ids, mask, labels = (t.to(team.device) for t in collate_turns(batch, team.pad_id))
        return reply_loss(team.model.get_base_model(), ids, mask, labels, reduction)
    prompt_ids, prompt_mask = left_pad([e.prompt_ids for e in batch], team.pad_id, team.device)  # (B, P)
    reply_ids, reply_mask = right_pad([e.reply_ids for e in batch], team.pad_id, team.device)  # (B, L)
    agents = torch.tensor([e.agent for e in batch], dtype=torch.long)  # (B,)
    cache, prompt_ids, prompt_mask = headers.rows_behind_headers(agents, prompt_ids, prompt_mask, by_layer=headers.reads_by_layer)
    ids, mask = torch.cat([prompt_ids, reply_ids], dim=1), torch.cat([prompt_mask, reply_mask], dim=1)  # (B, S + L)
    hidden = headers.decoder_states(cache, ids, mask, tail=reply_ids.shape[1] + 1)[:, :-1]  # (B, L, C): before each reply token
    scored = reply_mask.bool()  # (B, L)
    logits = team.model.get_base_model().get_output_embeddings()(hidden[scored])  # (N, V), N reply tokens
    return torch.nn.functional.cross_entropy(logits.float(), reply_ids[scored], reduction=reduction)


def warm_start(team, examples: Sequence[TurnExample], config: SFTConfig, seed: int = 0) -> list[float]:
    """Train each role's adapter on its own turns for ``config.sft_steps`` steps; return the loss per step.

    Each step draws ``sft_batch_size`` turns; the turns of each adapter are one forward/backward through
    that adapter, and each adapter's own optimizer steps. Nothing but the agents' adapters changes."""
    if not examples:
        raise ValueError("no transcript turn to learn from")
    rng = random.Random(seed)
    adapters = list(team.policy_adapters)
    optimizers = {a: torch.optim.AdamW(team.adapter_parameters(a), lr=config.sft_lr, weight_decay=0.0) for a in adapters}
    schedules = {a: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.5 * (1 + math.cos(math.pi * min(s / config.sft_steps, 1.0))))
                 for a, o in optimizers.items()}
    losses = []
    with team.bank.lora_dropout_active():
        for step in range(config.sft_steps):
            batch = [examples[rng.randrange(len(examples))] for _ in range(config.sft_batch_size)]
            total = 0.0
            for adapter in adapters:
                mine = [e for e in batch if team.agent_adapters[e.agent] == adapter]
                if not mine:
                    continue
                team.set_active(adapter, trainable=True)
                loss = reply_nll(team, adapter, mine)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(team.adapter_parameters(adapter), 1.0)
                optimizers[adapter].step()
                optimizers[adapter].zero_grad(set_to_none=True)
                total += loss.detach().item() * len(mine) / len(batch)
            for schedule in schedules.values():
                schedule.step()
            losses.append(total)
            if step % 50 == 0 or step == config.sft_steps - 1:
                logger.info("sft step %d/%d: reply loss %.3f", step + 1, config.sft_steps, total)
    team.set_active(None)
    return losses


def training_reply_loss(team, examples: Sequence[TurnExample], most: int = 1024, batch_size: int = 32) -> float:
    """The trained adapters' mean reply loss (nats per reply token, as :func:`warm_start`'s steps count it) over
    ``most`` of the training turns, spread evenly over them (all when fewer): unlike the last step's loss, which is
    one batch's, a figure to compare between runs and with the demonstrations' floor."""
    if not examples:
        raise ValueError("no transcript turn to score")
    sample = list(examples[:: max(1, -(-len(examples) // most))])
    total, tokens = 0.0, 0
    with torch.no_grad():
        for adapter in team.policy_adapters:
            mine = [e for e in sample if team.agent_adapters[e.agent] == adapter]
            for start in range(0, len(mine), batch_size):
                batch = mine[start:start + batch_size]
                n = sum(len(e.reply_ids) for e in batch)
                total += float(reply_nll(team, adapter, batch)) * n
                tokens += n
    team.set_active(None)
    return total / tokens


def unlearned_reply_tokens(team, examples: Sequence[TurnExample], nll_above: float = 3.0, min_share: float = 0.2,
                           max_examples: int = 256, most: int = 10) -> dict[str, float]:
    """The format tokens the warm start left unlikely: ``{token: mean negative log-likelihood}`` (at most ``most``,
    the least likely first) of the reply tokens that occur in at least ``min_share`` of the first ``max_examples``
    examples' replies (a format's tokens, not content) with a mean above ``nll_above`` nats, each reply scored
    through its own agent's adapter.

    A token the base model never learned to output can be out of reach of every adapter on the decoder (the frozen
    output layer caps it): the embedded models' ``[`` and ``]`` stay near 4.8 nats. Adapting the output layer
    (``--lora_target_modules all-linear,lm_head``) lifts the cap."""
    sample = list(examples[:max_examples])
    vocab = team.model.get_output_embeddings().weight.shape[0]
    nll_sum, tokens_seen, replies_with = torch.zeros(vocab), torch.zeros(vocab), torch.zeros(vocab)  # per token id
    with torch.no_grad():
        for adapter in team.policy_adapters:
            mine = [e for e in sample if team.agent_adapters[e.agent] == adapter]
            for start in range(0, len(mine), 32):
                batch = mine[start:start + 32]
                tokens = torch.tensor([t for e in batch for t in e.reply_ids])  # (N,) the order of reply_nll's values
                nll_sum.index_add_(0, tokens, reply_nll(team, adapter, batch, reduction="none").float().cpu())
                tokens_seen.index_add_(0, tokens, torch.ones(len(tokens)))
                distinct = torch.tensor([t for e in batch for t in set(e.reply_ids)])  # each token once per reply
                replies_with.index_add_(0, distinct, torch.ones(len(distinct)))
    team.set_active(None)
    mean = nll_sum / tokens_seen.clamp(min=1)
    flagged = ((replies_with >= min_share * len(sample)) & (mean > nll_above)).nonzero().flatten()
    unlikely = sorted(((float(mean[t]), int(t)) for t in flagged), reverse=True)[:most]
    return {team.tokenizer.convert_ids_to_tokens(token): round(m, 2) for m, token in unlikely}


def demonstrations(make_env, n: int, seed: int, recovery_share: float = 0.0) -> list[dict]:
    """``n`` transcripts from an environment's ``demonstrations(n)`` (drawn with its ``np_random`` after ``reset(seed)``);
    ``recovery_share``: see :attr:`SFTConfig.recovery_share`.

    Raises:
        ValueError: the environment has no ``demonstrations`` method, or a ``recovery_share`` its method does not take.
    """
    env = make_env()
    unwrapped = env.unwrapped
    if not hasattr(unwrapped, "demonstrations"):
        raise ValueError(f"{type(unwrapped).__name__} has no demonstrations(n); pass --sft_data transcripts.jsonl instead")
    kwargs = {}
    if recovery_share:
        if "recovery_share" not in inspect.signature(unwrapped.demonstrations).parameters:
            raise ValueError(f"--recovery_share is for environments whose demonstrations(n, recovery_share=...) show moves after a "
                             f"rejected one (TextArena games); {type(unwrapped).__name__}'s do not")
        kwargs["recovery_share"] = recovery_share
    env.reset(seed=seed)
    return [check_transcript(t) for t in unwrapped.demonstrations(n, **kwargs)]
