"""``marft-tiny-instruct``: the embedded instruct twin has a chat template, and its warm start teaches code and
the orchestration protocol through that template, exactly as the team prompts it."""

import os
from collections import Counter

import numpy as np
import pytest
from transformers import AutoTokenizer

from marft.agents.prompts import PromptEncoder
from marft.envs.code.generated import generate_tasks
from marft.envs.code.problem import last_python_block
from marft.envs.profile import load_profile
from marft.envs.route.env import asked_shelf
from marft.envs.workflows import OrchestratedWorkflow
from marft.models.loading import embedded_recipe
from marft.models.tiny import TinyRecipe, ensure_tiny_model
from marft.models.tiny_instruct import (
    CHATML_TEMPLATE,
    INSTRUCT_MODEL_NAME,
    InstructRecipe,
    code_transcripts,
    epoch_transcripts,
    route_transcripts,
)

QUICK = InstructRecipe(hidden_size=32, num_layers=1, num_heads=2, sft_steps=2, sft_batch_size=4)


@pytest.fixture(scope="module")
def quick_model(tmp_path_factory) -> str:
    return ensure_tiny_model(str(tmp_path_factory.mktemp("instruct")), recipe=QUICK)


@pytest.mark.slow
def test_the_shipped_embedded_models_have_their_own_names_and_folders(quick_model):
    assert type(embedded_recipe("marft-tiny")) is TinyRecipe and type(embedded_recipe(INSTRUCT_MODEL_NAME)) is InstructRecipe
    assert embedded_recipe("Qwen/Qwen2.5-0.5B") is None
    assert os.path.basename(quick_model).startswith(f"{INSTRUCT_MODEL_NAME}-")
    from marft.models.loading import check_model_path

    check_model_path(INSTRUCT_MODEL_NAME)  # an embedded name, not a missing folder


def test_the_tokenizer_speaks_chatml(quick_model):
    tokenizer = AutoTokenizer.from_pretrained(quick_model)
    assert tokenizer.chat_template == CHATML_TEMPLATE
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    for marker in ("<|im_start|>", "<|im_end|>"):
        assert len(tokenizer(marker, add_special_tokens=False).input_ids) == 1  # never split
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Problem: What is 3 + 4?"}], tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n") and text.endswith("<|im_start|>assistant\n")
    assert PromptEncoder(tokenizer, load_profile("reasoner_actor"), 256, chat_template="auto").uses_chat_template


@pytest.mark.parametrize("profile", ["reasoner_actor", "reasoner_actor_code", "route_orchestrated"])
def test_warm_start_examples_are_the_template_rendered_team_prompts(quick_model, profile):
    """Every warm-start turn is the chat the team renders (checked against ``apply_chat_template`` for each first
    turn), and the reply is the bare assistant text followed by ``<|im_end|>``."""
    from marft.sft import turn_examples

    tokenizer = AutoTokenizer.from_pretrained(quick_model)
    encoders = QUICK.warm_start_encoders(tokenizer)
    transcripts = epoch_transcripts(QUICK, np.random.default_rng(0))[profile]
    specs = load_profile(profile)
    for transcript in transcripts[:5]:
        first = transcript["turns"][0]
        spec = next(s for s in specs if s.role == first["role"])
        example = turn_examples(encoders[profile], [transcript], eos_id=tokenizer.eos_token_id)[0]
        private = transcript["private"].get(spec.role, "")
        user = (f"{private}\n\n" if private else "") + f"Problem: {transcript['problem']}\n" + f"Now it is {spec.role}'s turn."
        chat = [{"role": "system", "content": spec.prompt}, {"role": "user", "content": user}]
        expected = tokenizer(tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True), add_special_tokens=False).input_ids
        assert example.prompt_ids == expected
        assert example.reply_ids[-1] == tokenizer.eos_token_id
        assert tokenizer.decode(example.reply_ids[:-1]) == first["text"]


def test_code_transcripts_are_noisy_programs_of_every_task():
    recipe = InstructRecipe()
    transcripts = code_transcripts(recipe, np.random.default_rng(0))
    tasks = {p.text: p for p in generate_tasks("train") + generate_tasks("test")}
    assert Counter(t["problem"] for t in transcripts) == {text: recipe.code_repeats for text in tasks}
    right = 0
    for transcript in transcripts:
        reasoning, program = (turn["text"] for turn in transcript["turns"])
        code = last_python_block(program)
        assert code is not None and code.startswith("def f(x):")
        problem = tasks[transcript["problem"]]
        right += code == problem.solution
    assert 0.15 < right / len(transcripts) < 0.5  # about coder_correct x actor_copies: RL has room to improve


def test_route_transcripts_route_at_random_and_keepers_answer():
    transcripts = route_transcripts(InstructRecipe(), np.random.default_rng(0))
    workflow = OrchestratedWorkflow(("Keeper 1", "Keeper 2", "Orchestrator"), (0, 1), orchestrator=2)
    calls, right = Counter(), 0
    for transcript in transcripts:
        call, host, answer, done = transcript["turns"]
        called = workflow.parse(call["text"])
        assert called in (0, 1) and workflow.parse(done["text"]) == -1 and host["role"] == "Host"
        calls[called] += 1
        right += "\\boxed{" in answer["text"]
        assert ("\\boxed{" in answer["text"]) == (answer["role"] in transcript["private"])  # only the keeper knows
        assert list(transcript["private"]) == [("Keeper 1", "Keeper 2")[asked_shelf(transcript["problem"])]]
    assert abs(calls[0] - calls[1]) < 0.3 * len(transcripts)  # routing at random: the warm start does not tell whom to call
    assert 0.3 < right / len(transcripts) < 0.7
