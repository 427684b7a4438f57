"""``marft-tiny-instruct``: the embedded model's instruct twin, with a chat template, code and orchestration.

``--model_name_or_path marft-tiny-instruct`` builds (once, cached like ``marft-tiny``, with the same pinned
numerics) a small Qwen2-style LM whose tokenizer has ChatML special tokens and a Qwen2.5-Instruct-style chat
template (:data:`CHATML_TEMPLATE`; EOS = ``<|im_end|>``), so ``--chat_template auto`` renders every agent's
prompt as a chat, as it does for Qwen2.5-Instruct or Llama-3-Instruct. Its warm start is written through that
template (``PromptEncoder`` with ``chat_template="auto"``) and covers three teams, each with noisy labels so
that RL has something to improve:

* ``reasoner_actor`` on the generated arithmetic and ``relay_sum`` (as ``marft-tiny``);
* ``reasoner_actor_code`` on the generated ``f(x) = x <op> k`` code tasks (``marft.envs.code.generated``):
  the Reasoner names the expression (right ``coder_correct`` of the time, else another constant), the Actor
  writes it as a ```` ```python ```` block (copying the Reasoner ``actor_copies`` of the time);
* ``route_orchestrated``: ``RouteEnv.demonstrations``, the orchestrator's ``<call>Role</call>`` / ``<done/>``
  protocol with routing at random (it knows the tags, not whom to call).

``marft-tiny`` stays the default model; the orchestration and code learning benchmarks run on this one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from marft.agents.prompts import PromptEncoder
from marft.envs.code.generated import OPERATIONS, generate_tasks
from marft.envs.profile import load_profile
from marft.envs.route.env import RouteEnv
from marft.models.tiny import EOS, MAX_POSITIONS, TinyRecipe, _corpus_texts, train_tokenizer, warm_start_transcripts
from marft.prompting import format_problem, format_turn, handover_text
from marft.sft import turn_examples

INSTRUCT_MODEL_NAME = "marft-tiny-instruct"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
CHATML_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""Qwen2.5-Instruct's chat template without tools: ChatML turns, a default system turn when the chat has none."""

WARM_START_PROFILES = ("reasoner_actor", "reasoner_actor_code", "route_orchestrated")
"""The teams the warm start writes transcripts for (shipped profile names)."""


@dataclass(frozen=True)
class InstructRecipe(TinyRecipe):
    """``TinyRecipe`` plus the instruct data; its hash names the cache folder ``marft-tiny-instruct-<hash>``."""

    vocab_size: int = 1024
    """BPE vocabulary size (digits are always single tokens; ChatML markers are special tokens)."""
    sft_steps: int = 1800
    """Supervised warm-start steps."""
    coder_correct: float = 0.5
    """Share of warm-start code Reasoner replies with the right constant (others are off by 1-3, mod 10)."""
    code_repeats: int = 3
    """Transcripts per generated code task (both splits) per warm-start epoch."""
    route_episodes: int = 90
    """Orchestrated ``route`` demonstrations per warm-start epoch (routing at random)."""

    name: ClassVar[str] = INSTRUCT_MODEL_NAME

    def make_tokenizer(self):
        return train_tokenizer(_instruct_corpus(self), self.vocab_size, special_tokens=(EOS, IM_START, IM_END),
                               eos_token=IM_END, chat_template=CHATML_TEMPLATE)

    def warm_start_encoders(self, tokenizer) -> dict:
        return {name: PromptEncoder(tokenizer, load_profile(name), max_prompt_len=MAX_POSITIONS, chat_template="auto")
                for name in WARM_START_PROFILES}

    def epoch_examples(self, encoders: dict, eos_id: int, rng) -> list:
        return [example for name, transcripts in epoch_transcripts(self, rng).items()
                for example in turn_examples(encoders[name], transcripts, eos_id=eos_id)]


def code_replies(operation: str, k: int, rng, coder_correct: float, actor_copies: float) -> tuple[str, str]:
    """Warm-start replies on the generated task ``f(x) = x <op> k``: the Reasoner names the expression
    (``"f(x) returns x + 3."``; another constant ``1 - coder_correct`` of the time), the Actor writes it as a
    program (copying the Reasoner's constant ``actor_copies`` of the time, else one off)."""

    symbol = OPERATIONS[operation]
    said = k if rng.random() < coder_correct else (k + int(rng.choice([-1, 1])) * int(rng.integers(1, 4))) % 10
    written = said if rng.random() < actor_copies else (said + int(rng.choice([-1, 1]))) % 10
    return f"f(x) returns x {symbol} {said}.", f"```python\ndef f(x):\n    return x {symbol} {written}\n```"


def code_transcripts(recipe: InstructRecipe, rng) -> list[dict]:
    """``code_repeats`` noisy transcripts per generated code task of both splits (as pretraining would cover them)."""

    out = []
    for problem in (generate_tasks("train") + generate_tasks("test")) * recipe.code_repeats:
        operation, k = problem.task_id.removeprefix("generated/").split("_")
        reasoning, program = code_replies(operation, int(k), rng, recipe.coder_correct, recipe.actor_copies)
        out.append({"problem": problem.text, "private": {},
                    "turns": [{"role": "Reasoner", "text": reasoning}, {"role": "Actor", "text": program}]})
    return out


def route_transcripts(recipe: InstructRecipe, rng) -> list[dict]:
    """``route_episodes`` orchestrated ``route`` demonstrations (boxes of both splits), drawn with ``rng``."""

    env = RouteEnv("train")
    env.tasks = env.tasks + RouteEnv("test").tasks
    env.np_random = rng
    return env.demonstrations(recipe.route_episodes)


def epoch_transcripts(recipe: InstructRecipe, rng) -> dict[str, list[dict]]:
    """Profile name → one epoch of its noisy warm-start transcripts."""
    return {"reasoner_actor": warm_start_transcripts(recipe, rng), "reasoner_actor_code": code_transcripts(recipe, rng),
            "route_orchestrated": route_transcripts(recipe, rng)}


def _instruct_corpus(recipe: InstructRecipe) -> list[str]:
    """The tokenizer's corpus: ``marft-tiny``'s, the warm-start teams' role prompts, and one epoch of their
    transcripts written as ChatML turns (the template's words and markers, code, the orchestration tags)."""

    texts = _corpus_texts(recipe.seed)
    for name in WARM_START_PROFILES:
        for spec in load_profile(name):
            texts.append(f"{IM_START}system\n{spec.prompt}{IM_END}\n{IM_START}user\n{handover_text(spec.role)}{IM_END}\n{IM_START}assistant\n")
    texts.append(f"{IM_START}system\nYou are a helpful assistant.{IM_END}\n")
    for _name, transcripts in epoch_transcripts(recipe, np.random.default_rng(recipe.seed)).items():
        for transcript in transcripts:
            private = "".join(f"{text}\n\n" for text in transcript.get("private", {}).values())
            conversation = private + format_problem(transcript["problem"])
            for turn in transcript["turns"]:
                texts.append(f"{IM_START}user\n{conversation}{IM_END}\n{IM_START}assistant\n{turn['text']}{IM_END}\n")
                conversation += format_turn(turn["role"], turn["text"])
    texts.append(json.dumps(WARM_START_PROFILES))
    return texts
