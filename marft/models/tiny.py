"""The embedded default model: a tiny Qwen2-style LM the project builds itself.

Nothing can be downloaded here, so ``--model_name_or_path marft-tiny`` (the default)
builds, once, a small causal LM and a BPE tokenizer trained with ``tokenizers``, and
warm-starts it with a short supervised pass on Reasoner → Actor transcripts written
exactly as the team will prompt it (``marft.prompting``): the generated arithmetic of
the math environment, and the cooperative ``relay_sum`` task. The warm-start labels
are deliberately noisy (in arithmetic the Reasoner is sometimes off by a little; in
``relay_sum`` it mostly ignores the hidden key and guesses one; the Actor sometimes
miscopies), so the sampled team is right only part of the time and RL has signal to
improve on. The result is cached under ``$MARFT_CACHE`` (default
``~/.cache/marft``) in a folder named after a hash of the recipe, written atomically.

The build runs in a child process whose numerics are pinned before torch loads, so a
fresh build gives the same weights on any x86-64 machine, whatever the parent's threads
and environment (``PINNED_ENV``): MKL's Conditional Numerical Reproducibility
(``MKL_CBWR=COMPATIBLE``: the same code path on Intel and AMD processors, whatever
AVX2/AVX-512 they have), ATen's baseline kernels (``ATEN_CPU_CAPABILITY=default``:
not the AVX2/AVX-512 ones picked per CPU, whose reductions and exp/log round
differently), one thread everywhere, ``torch.use_deterministic_algorithms(True)``.
Unpinned, the ~1500 warm-start steps turn last-bit differences into a different model,
and the same training run starts from a different team. Still varying: the versions of
torch, transformers and tokenizers (a different version may build different weights;
``marft_recipe.json`` in the model folder records them), and CPUs that are not x86-64
(no MKL). The RL training itself runs with the machine's own kernels and threads, so
its figures vary a little from machine to machine (compare seeds, not digits).

``build_random_model`` saves an untrained model of any size in a second, for tests
and benchmarks.
"""

from __future__ import annotations

import collections
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from marft.agents.prompts import PromptEncoder
from marft.envs.math.arithmetic import generate_arithmetic
from marft.envs.profile import load_profile
from marft.envs.relay_sum.env import keeper_observation, relay_problem
from marft.prompting import format_private, format_problem, format_turn
from marft.sft import collate_turns, reply_loss, turn_examples

logger = logging.getLogger(__name__)

TINY_MODEL_NAME = "marft-tiny"
MAX_POSITIONS = 2048
EOS = "<|endoftext|>"
PROFILES_DIR = Path(__file__).resolve().parents[1] / "envs" / "profiles"
CORPUS_PROFILES = tuple(f"{name}{twin}" for name in ("planner_solver", "planner_solver_reflector_verifier", "planner_solver_verifier",
                                                      "reasoner_actor") for twin in ("", "_anonymous"))
"""The shipped profiles whose text trains the tokenizer: a fixed list, so shipping a new profile does not change the
embedded model (its cache hash covers the recipe, not the corpus)."""

PACKAGE_ROOT = Path(__file__).resolve().parents[2]
"""The folder holding the ``marft`` package that this module is part of (put first on the child's path)."""

PINNED_ENV = {
    "MKL_CBWR": "COMPATIBLE",  # MKL: one code path on every x86-64 CPU (Intel or AMD, any AVX level)
    "ATEN_CPU_CAPABILITY": "default",  # ATen: baseline kernels, not the AVX2/AVX-512 ones chosen per CPU
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "RAYON_NUM_THREADS": "1",  # the tokenizers BPE trainer (gave the same files multi-threaded too)
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONHASHSEED": "0",
}
"""Environment of the build's child process: set before torch loads, whatever the parent has."""


@dataclass(frozen=True)
class TinyRecipe:
    """Everything that decides the embedded model; its hash names the cache folder."""

    vocab_size: int = 1024
    """BPE vocabulary size (digits are always single tokens)."""
    hidden_size: int = 64
    """Transformer width."""
    num_layers: int = 3
    """Transformer blocks."""
    num_heads: int = 4
    """Attention heads (2 key/value heads)."""
    sft_steps: int = 1450
    """Supervised warm-start steps."""
    sft_batch_size: int = 32
    """Transcripts per warm-start step."""
    sft_lr: float = 3e-3
    """Warm-start learning rate (AdamW, cosine decay)."""
    reasoner_correct: float = 0.55
    """Share of warm-start Reasoner replies with the right result (others are off by 1-3)."""
    actor_copies: float = 0.6
    """Share of warm-start Actor replies that box the Reasoner's result (others are off by 1)."""
    keeper_tells: float = 0.15
    """Share of warm-start ``relay_sum`` Reasoner replies that use the hidden key; the others use a
    random digit instead (right one time in ten by chance)."""
    seed: int = 0
    """Seed of the tokenizer corpus, the initial weights and the warm-start data."""
    version: int = 2
    """Bump to force a rebuild when the code below changes (2: built in a child with pinned numerics)."""

    name: ClassVar[str] = TINY_MODEL_NAME
    """The ``--model_name_or_path`` that builds this recipe; it also starts the cache folder's name."""

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()[:12]

    def make_tokenizer(self):
        """The model's tokenizer, trained on :func:`_corpus_texts` (profiles and warm-start transcripts)."""
        return train_tokenizer(_corpus_texts(self.seed), self.vocab_size)

    def warm_start_encoders(self, tokenizer) -> dict:
        """Profile name → the ``PromptEncoder`` its warm-start transcripts are written with."""
        return {"reasoner_actor": warm_start_prompts(tokenizer)}

    def epoch_examples(self, encoders: dict, eos_id: int, rng) -> list:
        """One epoch of warm-start ``TurnExample``s (fresh noisy labels drawn with ``rng``)."""

        return turn_examples(encoders["reasoner_actor"], warm_start_transcripts(self, rng), eos_id=eos_id)


SMALL_MODEL_NAME = "marft-small"


@dataclass(frozen=True)
class SmallRecipe(TinyRecipe):
    """``marft-small``: ``marft-tiny``'s recipe at twice its width (hidden 128: ~0.7M parameters against ~0.2M), the
    same tokenizer, warm-start data, noise and steps; its hash names the cache folder ``marft-small-<hash>``. For
    telling whether a figure is limited by the tiny model's size: one variable changed, everything else the same."""

    hidden_size: int = 128
    """Transformer width (twice ``marft-tiny``'s)."""

    name: ClassVar[str] = SMALL_MODEL_NAME


# ---------------------------------------------------------------------- tokenizer and model
def train_tokenizer(texts, vocab_size: int = 1024, special_tokens: tuple[str, ...] = (EOS,), eos_token: str = EOS, chat_template: str | None = None):
    """A byte-level BPE tokenizer with single-digit tokens, ``<|endoftext|>`` as PAD and ``eos_token`` as EOS
    (default ``<|endoftext|>`` too); ``special_tokens`` are never split (``<|endoftext|>`` first)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(special_tokens), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(list(texts), trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos_token, pad_token=EOS, clean_up_tokenization_spaces=False)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def _qwen2_config(tokenizer, hidden_size: int, num_layers: int, num_heads: int):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 3,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=max(1, num_heads // 2),
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )


def _corpus_texts(seed: int = 0) -> list[str]:
    """Profile prompts, arithmetic transcripts and judge feedback: what the tokenizer should know."""

    profile_files = sorted(PROFILES_DIR / f"{name}.json" for name in CORPUS_PROFILES)
    texts = [json.dumps(json.loads(p.read_text())) for p in profile_files]
    for spec_file in profile_files:
        texts += [entry.get("prompt", "") + "\n" + entry.get("role", "") + ":" for entry in json.loads(spec_file.read_text())]
    for row in generate_arithmetic("train") + generate_arithmetic("test"):
        a, op, b = _operands(row)
        reasoning, final = f"{a} {op} {b} = {row['answer']}", f"\\boxed{{{row['answer']}}}"
        texts.append(format_problem(row["problem"]) + format_turn("Reasoner", reasoning) + format_turn("Actor", final))
    for key, number in _relay_pairs():
        row = relay_problem(key, number)
        reasoning = f"{key} + {number} = {row['answer']}"
        texts.append(format_private(keeper_observation(key)) + format_problem(row["problem"]) + format_turn("Reasoner", reasoning))
    texts.append("Judge: The answer is incorrect. Please check the reasoning and try again.\n")
    return texts


def build_random_model(
    path: str,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    vocab_size: int = 512,
    seed: int = 0,
    vocab_texts=None,
) -> str:
    """Save an UNTRAINED Qwen2-style model + tokenizer to ``path`` in a second or two; return ``path``.

    For tests and benchmarks (e.g. ``hidden_size=512, num_layers=8``). ``vocab_texts`` replaces the
    default tokenizer corpus (profiles and arithmetic transcripts).
    """
    from transformers import Qwen2ForCausalLM

    tokenizer = train_tokenizer(_corpus_texts(seed) if vocab_texts is None else vocab_texts, vocab_size)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(_qwen2_config(tokenizer, hidden_size, num_layers, num_heads))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# ---------------------------------------------------------------------- warm-start data
def _off_by(value: int, rng, low: int = 1, high: int = 3) -> int:
    return value + int(rng.choice([-1, 1])) * int(rng.integers(low, high + 1))


def _operands(row: dict) -> list[str]:
    """``"What is 3 + 4?"`` → ``["3", "+", "4"]``."""
    return row["problem"].removeprefix("What is ").removesuffix("?").split()


def _relay_pairs(n_keys: int = 10, n_tens: int = 9) -> list[tuple[int, int]]:
    """Every (key, number) pair of ``relay_sum`` (both splits, as pretraining would cover them), in one fixed
    seeded order that does not depend on how the env splits them (so changing the split does not change the
    embedded model; it is the order the warm start has always used)."""
    pairs = [(key, 10 * tens) for key in range(n_keys) for tens in range(1, n_tens + 1)]
    order = np.random.default_rng(0).permutation(len(pairs))
    first_split = int(round(0.2 * len(pairs)))  # the first 18 of the shuffle were the test split when the warm start was written
    return [pairs[i] for i in np.concatenate([order[first_split:], order[:first_split]])]


def _noisy_copy(result: int, rng, actor_copies: float) -> str:
    """The Actor's warm-start reply: ``"\\boxed{result}"``, sometimes off by 1."""
    boxed = result if rng.random() < actor_copies else _off_by(result, rng, 1, 1)
    return f"\\boxed{{{boxed}}}"


def _noisy_replies(row: dict, rng, reasoner_correct: float, actor_copies: float) -> tuple[str, str]:
    """Warm-start replies of the Reasoner (``"3 + 4 = 7"``, result sometimes off by 1-3) and the
    Actor (``"\\boxed{7}"``, sometimes off by 1 from the Reasoner's result)."""
    a, op, b = _operands(row)
    answer = int(row["answer"])
    result = answer if rng.random() < reasoner_correct else _off_by(answer, rng)
    return f"{a} {op} {b} = {result}", _noisy_copy(result, rng, actor_copies)


def _noisy_relay_replies(key: int, number: int, rng, keeper_tells: float, actor_copies: float) -> tuple[str, str]:
    """Warm-start replies on ``relay_sum``: the Reasoner adds the key (``"7 + 50 = 57"``) only
    ``keeper_tells`` of the time, else a random digit; the Actor boxes its result, sometimes off by 1."""
    used = key if rng.random() < keeper_tells else int(rng.integers(10))
    return f"{used} + {number} = {used + number}", _noisy_copy(used + number, rng, actor_copies)


def warm_start_transcripts(recipe: TinyRecipe, rng) -> list[dict]:
    """One epoch of noisy warm-start transcripts, in ``marft.sft``'s JSONL format (problem, private, turns).

    The whole arithmetic table, as pretraining would cover it; the labels are noisy, so the model knows
    the answers only in part. RL trains on the train split; evaluation uses the test split, which RL never
    sees. (A 3-layer model cannot learn to add from 160 pairs in a minute: warming up on the train split
    alone leaves ~18% sampled / 25% greedy on test, too little for RL to sharpen.) Then every ``relay_sum``
    pair, the key private to the Reasoner as in RelaySumEnv.
    """

    def transcript(problem: str, reasoning: str, final: str, private: dict | None = None) -> dict:
        turns = [{"role": "Reasoner", "text": reasoning}, {"role": "Actor", "text": final}]
        return {"problem": problem, "private": private or {}, "turns": turns}

    transcripts = [transcript(row["problem"], *_noisy_replies(row, rng, recipe.reasoner_correct, recipe.actor_copies))
                   for row in generate_arithmetic("train") + generate_arithmetic("test")]
    for key, number in _relay_pairs():
        replies = _noisy_relay_replies(key, number, rng, recipe.keeper_tells, recipe.actor_copies)
        transcripts.append(transcript(relay_problem(key, number)["problem"], *replies, private={"Reasoner": keeper_observation(key)}))
    return transcripts


def warm_start_prompts(tokenizer):
    """The prompt encoder of the Reasoner → Actor team the embedded model is warm-started as."""

    return PromptEncoder(tokenizer, load_profile("reasoner_actor", n_agents=2), max_prompt_len=MAX_POSITIONS)


def _warm_start(model, tokenizer, recipe: TinyRecipe) -> float:
    """Supervised pass on fresh noisy transcripts each epoch; loss on reply tokens only. Returns the last loss.

    The same code path as a team's warm start (``marft.sft``: ``turn_examples``, ``collate_turns``,
    ``reply_loss``), on every weight of the model rather than on LoRA adapters."""

    rng = np.random.default_rng(recipe.seed)
    encoders = recipe.warm_start_encoders(tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.sft_lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + np.cos(np.pi * min(s / recipe.sft_steps, 1.0))))
    examples: list = []
    model.train()
    loss_value = float("nan")
    for step in range(recipe.sft_steps):
        if len(examples) < recipe.sft_batch_size:
            examples = recipe.epoch_examples(encoders, tokenizer.eos_token_id, rng)
            examples = [examples[i] for i in rng.permutation(len(examples))]
        batch, examples = examples[: recipe.sft_batch_size], examples[recipe.sft_batch_size :]
        loss = reply_loss(model, *collate_turns(batch, tokenizer.pad_token_id))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = loss.item()
        if step % 100 == 0:
            logger.info("tiny model warm-start step %d/%d: loss %.3f", step, recipe.sft_steps, loss_value)
    model.eval()
    return loss_value


class TinyModelBuildError(RuntimeError):
    """The child process that builds the embedded model failed."""


_CHILD_LOG_PREFIX = "marft-tiny build: "


def build_tiny_model(path: str, recipe: TinyRecipe = TinyRecipe()) -> str:
    """Build the embedded model into ``path`` in a child process with pinned numerics (``PINNED_ENV``,
    one thread, deterministic algorithms): the same weights on every x86-64 machine. Returns ``path``.

    The child's log lines are relayed to this process's log.

    Raises:
        TinyModelBuildError: the child failed; the message ends with the last lines it printed.
    """
    env = {**os.environ, **PINNED_ENV}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PACKAGE_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    entry = "import sys; from marft.models.tiny import _build_in_this_process_main; _build_in_this_process_main(sys.argv[1:])"
    recipe_class = f"{type(recipe).__module__}:{type(recipe).__qualname__}"
    command = [sys.executable, "-c", entry, path, json.dumps(dataclasses.asdict(recipe)), recipe_class]
    tail: collections.deque = collections.deque(maxlen=25)
    child = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in child.stdout:
            tail.append(line.rstrip("\n"))
            if line.startswith(_CHILD_LOG_PREFIX):
                logger.info("%s", line[len(_CHILD_LOG_PREFIX) :].rstrip())
        exit_code = child.wait()
    finally:
        if child.poll() is None:  # interrupted: do not leave a build running
            child.kill()
            child.wait()
    if exit_code != 0:
        raise TinyModelBuildError(
            f"building the embedded tiny model failed (child exit code {exit_code}); its last lines:\n" + "\n".join(tail)
        )
    return path


def _build_in_this_process_main(argv: list[str]) -> None:
    """The child's entry point: ``argv = [path, recipe as JSON, "module:RecipeClass"]``; pins torch, then builds."""
    import importlib

    logging.basicConfig(level=logging.INFO, format=_CHILD_LOG_PREFIX + "%(message)s", stream=sys.stdout)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    module, _, class_name = argv[2].partition(":")
    path, recipe = argv[0], getattr(importlib.import_module(module), class_name)(**json.loads(argv[1]))
    _build_in_this_process(path, recipe)


def _build_in_this_process(path: str, recipe: TinyRecipe) -> str:
    """Train the tokenizer, initialise the model and warm-start it; save to ``path`` with
    ``marft_recipe.json`` (the recipe, the last warm-start loss and what the numerics ran on).

    Bit-for-bit reproducible only under the pinning of :func:`build_tiny_model`, which runs this."""
    import tokenizers
    import transformers
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(recipe.seed)
    tokenizer = recipe.make_tokenizer()
    model = Qwen2ForCausalLM(_qwen2_config(tokenizer, recipe.hidden_size, recipe.num_layers, recipe.num_heads))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    loss = _warm_start(model, tokenizer, recipe)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    numerics = {
        "torch": torch.__version__, "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
        "machine": platform.machine(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(), **{name: os.environ.get(name) for name in ("MKL_CBWR", "ATEN_CPU_CAPABILITY")},
    }
    Path(path, "marft_recipe.json").write_text(
        json.dumps({"name": recipe.name, **dataclasses.asdict(recipe), "final_sft_loss": loss, "built_with": numerics}, indent=2)
    )
    return path


def cached_model_dir(recipe: TinyRecipe, cache_dir: str | None = None) -> Path:
    """Where :func:`ensure_tiny_model` keeps ``recipe``'s build: ``<cache>/<name>-<hash>``, the cache ``cache_dir`` or
    ``$MARFT_CACHE`` or ``~/.cache/marft``. The folder exists only once the build is complete."""
    root = Path(cache_dir or os.environ.get("MARFT_CACHE") or Path.home() / ".cache" / "marft")
    return root / f"{recipe.name}-{recipe.digest()}"


def ensure_tiny_model(cache_dir: str | None = None, rebuild: bool = False, recipe: TinyRecipe = TinyRecipe()) -> str:
    """The embedded model's folder, built on first use and cached (two processes never build it twice).

    Args:
        cache_dir: default ``$MARFT_CACHE`` or ``~/.cache/marft``.
        rebuild: build again even when cached.
        recipe: what to build (its name and hash name the folder; :data:`marft.models.loading.EMBEDDED_RECIPES` holds the shipped ones).
    """
    final = cached_model_dir(recipe, cache_dir)
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second process waits here, then finds the folder built
        if final.is_dir() and not rebuild:
            return str(final)
        tmp = root / f".{final.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        start = time.perf_counter()
        logger.info("building the embedded model %s into %s (once; cached afterwards)", recipe.name, final)
        try:
            build_tiny_model(str(tmp), recipe)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        logger.info("built the embedded model %s in %.0fs", recipe.name, time.perf_counter() - start)
    return str(final)
