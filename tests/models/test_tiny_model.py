"""The embedded tiny model: built from a config, deterministic, cached."""

import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from marft.models.tiny import TinyModelBuildError, TinyRecipe, build_random_model, ensure_tiny_model

QUICK = TinyRecipe(vocab_size=400, hidden_size=32, num_layers=1, num_heads=2, sft_steps=2, sft_batch_size=4)
SENSITIVE = TinyRecipe(**{**QUICK.__dict__, "sft_steps": 30, "sft_batch_size": 8})  # enough steps for last bits to show


def test_random_model_loads_and_tokenizer_round_trips(random_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(random_model_dir)
    model = AutoModelForCausalLM.from_pretrained(random_model_dir)
    assert model.config.vocab_size == len(tokenizer) and tokenizer.eos_token_id == tokenizer.pad_token_id
    for text in ["Problem: What is 12 + 7?\n", "Actor: \\boxed{19}", " 3 - 15 = -12"]:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        assert tokenizer.decode(ids) == text
    pieces = tokenizer.convert_ids_to_tokens(tokenizer("1234", add_special_tokens=False).input_ids)
    assert pieces == ["1", "2", "3", "4"]  # digits are single tokens


def test_random_model_size_overrides(tmp_path):
    path = build_random_model(str(tmp_path / "m"), hidden_size=48, num_layers=3)
    config = AutoModelForCausalLM.from_pretrained(path).config
    assert (config.hidden_size, config.num_hidden_layers) == (48, 3)


@pytest.mark.slow
def test_ensure_tiny_model_builds_once_and_caches(tmp_path):
    first = ensure_tiny_model(str(tmp_path), recipe=QUICK)
    stamp = os.path.getmtime(os.path.join(first, "model.safetensors"))
    assert ensure_tiny_model(str(tmp_path), recipe=QUICK) == first
    assert os.path.getmtime(os.path.join(first, "model.safetensors")) == stamp  # not rebuilt
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]  # no temp folder left behind
    other = ensure_tiny_model(str(tmp_path), recipe=TinyRecipe(**{**QUICK.__dict__, "seed": 1}))
    assert other != first  # a different recipe gets its own folder


@pytest.mark.slow
def test_tiny_model_is_deterministic(tmp_path):
    from safetensors.torch import load_file

    a = load_file(os.path.join(ensure_tiny_model(str(tmp_path / "a"), recipe=QUICK), "model.safetensors"))
    b = load_file(os.path.join(ensure_tiny_model(str(tmp_path / "b"), recipe=QUICK), "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_build_does_not_depend_on_the_parents_threads_or_kernels(tmp_path, monkeypatch):
    """The build's child pins its own numerics: parents with different threads, ATen kernels and MKL
    code paths build the same weights. (The child inheriting these settings builds different weights:
    baseline and AVX2 kernels round differently, and a few dozen steps make that visible.)"""
    from safetensors.torch import load_file

    def weights(folder, **parent_env):
        for name, value in parent_env.items():
            monkeypatch.setenv(name, value)
        return load_file(os.path.join(ensure_tiny_model(str(tmp_path / folder), recipe=SENSITIVE), "model.safetensors"))

    a = weights("a", OMP_NUM_THREADS="1", ATEN_CPU_CAPABILITY="default", MKL_CBWR="AUTO")
    b = weights("b", OMP_NUM_THREADS="2", ATEN_CPU_CAPABILITY="avx2", MKL_CBWR="AVX2")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_a_failed_build_says_why_and_leaves_nothing(tmp_path):
    with pytest.raises(TinyModelBuildError, match="max\\(\\) .*empty"):  # the child's own error, in the parent
        ensure_tiny_model(str(tmp_path), recipe=TinyRecipe(**{**QUICK.__dict__, "sft_batch_size": 0}))
    assert not [p for p in os.listdir(tmp_path) if not p.endswith(".lock")]


def test_random_model_vocab_texts_and_heads(tmp_path):
    path = build_random_model(str(tmp_path / "m"), num_heads=2, vocab_size=300, vocab_texts=["What is 3 + 4?", "\\boxed{7}"])
    config = AutoModelForCausalLM.from_pretrained(path).config
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert config.num_attention_heads == 2 and config.vocab_size == len(tokenizer) <= 300
    assert tokenizer.decode(tokenizer("\\boxed{12}", add_special_tokens=False).input_ids) == "\\boxed{12}"



def test_warm_start_prompts_are_the_teams_prompts(random_model_dir):
    """The warm start teaches the replies to exactly the token ids the team will be prompted with:
    arithmetic (math env) and relay_sum, whose Reasoner prompt holds the private key."""
    import numpy as np

    from marft.agents.team import AgentTeam
    from marft.config import ModelConfig
    from marft.envs.math.arithmetic import generate_arithmetic
    from marft.envs.profile import load_profile
    from marft.envs.relay_sum.env import keeper_observation, relay_problem, relay_tasks
    from marft.models.loading import load_base_model
    from marft.models.tiny import _relay_pairs, warm_start_prompts, warm_start_transcripts
    from marft.prompting import format_problem
    from marft.sft import turn_examples

    config = ModelConfig(model_name_or_path=random_model_dir, context_window=256)
    model, tokenizer = load_base_model(config)
    team = AgentTeam(model, tokenizer, load_profile("reasoner_actor", n_agents=2), config)
    transcripts = warm_start_transcripts(TinyRecipe(), np.random.default_rng(0))
    examples = [(e.prompt_ids, e.reply_ids) for e in turn_examples(warm_start_prompts(tokenizer), transcripts, eos_id=tokenizer.eos_token_id)]
    arithmetic = generate_arithmetic("train") + generate_arithmetic("test")
    pairs = _relay_pairs()
    assert sorted(pairs) == sorted(relay_tasks("train") + relay_tasks("test"))
    assert len(examples) == 2 * (len(arithmetic) + len(pairs))  # a Reasoner and an Actor example per task

    def team_prompt(agent, problem, turns, private=None):
        ids, mask = team.encode_prompts(agent, [format_problem(problem)], [turns], private)
        return ids[0][mask[0].bool()].tolist()

    def reply_text(reply_ids):
        return tokenizer.decode(reply_ids[:-1]).strip()

    row = arithmetic[0]
    (reasoner_prompt, reasoning), (actor_prompt, final) = examples[0], examples[1]
    assert reasoner_prompt == team_prompt(0, row["problem"], [])
    assert actor_prompt == team_prompt(1, row["problem"], [("Reasoner", reply_text(reasoning))])
    told = 0
    for i, (key, number) in enumerate(pairs):
        (reasoner_prompt, reasoning), (actor_prompt, final) = examples[2 * (len(arithmetic) + i) : 2 * (len(arithmetic) + i) + 2]
        problem = relay_problem(key, number)["problem"]
        assert reasoner_prompt == team_prompt(0, problem, [], [keeper_observation(key)])
        assert actor_prompt == team_prompt(1, problem, [("Reasoner", reply_text(reasoning))])  # the Actor never sees the key
        used, plus, shown, equals, result = reply_text(reasoning).split()
        assert (plus, int(shown), equals, int(result)) == ("+", number, "=", int(used) + number)
        assert reply_text(final).startswith("\\boxed{") and reasoning[-1] == final[-1] == tokenizer.eos_token_id
        told += int(used) == key
    assert 0.1 < told / len(pairs) < 0.5  # the keeper mostly guesses: RL has to teach it to tell


def test_marft_small_is_the_tiny_recipe_twice_as_wide():
    """``--model_name_or_path marft-small``: marft-tiny's recipe with one field changed (hidden 64 -> 128), in a cache
    folder of its own, so a figure on both tells whether the tiny model's size limits it."""
    import dataclasses

    from marft.models.loading import embedded_recipe

    small, tiny = embedded_recipe("marft-small"), embedded_recipe("marft-tiny")
    differs = {f.name for f in dataclasses.fields(TinyRecipe) if getattr(small, f.name) != getattr(tiny, f.name)}
    assert differs == {"hidden_size"} and (tiny.hidden_size, small.hidden_size) == (64, 128)
    assert small.name == "marft-small" and small.digest() != tiny.digest()


@pytest.mark.slow
def test_a_recipe_subclass_is_built_as_itself(tmp_path):
    """The build's child rebuilds the recipe from its class: a ``SmallRecipe`` lands in ``marft-small-<hash>`` with its
    own sizes and name."""
    import json

    from marft.models.tiny import SmallRecipe

    recipe = SmallRecipe(**{**QUICK.__dict__, "hidden_size": 48})
    path = ensure_tiny_model(str(tmp_path), recipe=recipe)
    assert os.path.basename(path) == f"marft-small-{recipe.digest()}"
    assert AutoModelForCausalLM.from_pretrained(path).config.hidden_size == 48
    assert json.loads(open(os.path.join(path, "marft_recipe.json")).read())["name"] == "marft-small"
