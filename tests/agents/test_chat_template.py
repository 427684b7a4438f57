"""Chat templates for instruct models (``--chat_template auto|none``): an agent's prompt is its chat, as the
tokenizer's template renders it, with the role header and the generation prompt kept whole."""

import pytest
import torch

from marft.agents.prompts import PromptEncoder
from marft.config import ModelConfig, parse_config
from marft.envs.profile import AgentSpec
from marft.models.tiny_instruct import CHATML_TEMPLATE
from marft.prompting import build_prompt, format_conversation, format_private, format_turn, handover_text
from marft.sft import turn_examples

QWEN2_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
"""Qwen2's pre-tokenizer split (newline runs are their own pieces, as in Llama-3's)."""

CHATML = CHATML_TEMPLATE
"""Qwen2.5-Instruct's template without tools (the embedded marft-tiny-instruct's): a default system turn when the chat has none."""

PROFILE = [AgentSpec("Reasoner", "", False), AgentSpec("Actor", "You are the Actor. Box the answer.", True)]
"""One agent without a role prompt (the template's default system turn), one with."""

HISTORIES = [
    "Problem: What is 3 + 4?\n",
    "Problem: What is 13 - 4?\nReasoner: 13 - 4 = 9\nActor: \\boxed{8}\nJudge: The answer is incorrect. Please try again.\n",
]
EARLIER = [[], [("Reasoner", "13 - 4 = 9")]]
PRIVATE = ["", "The key is 7."]


def _bpe_tokenizer(with_template: bool):
    """A byte-level BPE tokenizer with Qwen2's split, ChatML special tokens and ``<|im_end|>`` as EOS."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    corpus = [spec.prompt for spec in PROFILE] + HISTORIES + PRIVATE + ["system user assistant Now it is Actor's turn."]
    tok.train_from_iterator(corpus * 4, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", clean_up_tokenization_spaces=False)
    if with_template:
        tokenizer.chat_template = CHATML
    return tokenizer


@pytest.fixture(scope="module")
def chat_tokenizer():
    return _bpe_tokenizer(with_template=True)


@pytest.fixture(scope="module")
def plain_tokenizer():
    return _bpe_tokenizer(with_template=False)


def chat_ids(tokenizer, spec, history, earlier, private):
    """The reference: the template applied to the messages an agent's prompt is meant to be."""
    messages = [{"role": "system", "content": spec.prompt}] if spec.prompt else []
    user = format_private(private) + history + "".join(format_turn(r, t) for r, t in earlier) + handover_text(spec.role)
    messages.append({"role": "user", "content": user})
    return tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)


def plain_ids(tokenizer, spec, history, earlier, private, max_prompt_len):
    """The reference plain transcript: header, private observation, body cut from the left."""
    ids = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    header, body = build_prompt(spec.prompt, history, earlier, spec.role)
    kept = ids(header) + ids(format_private(private))
    return kept + ids(body)[-(max_prompt_len - len(kept)) :]


def test_auto_prompts_are_the_template_rendering(chat_tokenizer):
    prompts = PromptEncoder(chat_tokenizer, PROFILE, max_prompt_len=512, chat_template="auto")
    assert prompts.uses_chat_template
    for agent, spec in enumerate(PROFILE):
        rows = prompts.encode_rows(agent, HISTORIES, EARLIER, PRIVATE)
        for row, history, earlier, private in zip(rows, HISTORIES, EARLIER, PRIVATE):
            assert row == chat_ids(chat_tokenizer, spec, history, earlier, private)
            assert row[: len(prompts.header_ids[agent])] == prompts.header_ids[agent]
        assert prompts.encode_rows(agent, HISTORIES, EARLIER) == [  # no private observation at all
            chat_ids(chat_tokenizer, spec, h, e, "") for h, e in zip(HISTORIES, EARLIER)
        ]
    text = chat_tokenizer.decode(prompts.encode_rows(1, HISTORIES[1:], EARLIER[1:], PRIVATE[1:])[0])
    assert text == (
        "<|im_start|>system\nYou are the Actor. Box the answer.<|im_end|>\n<|im_start|>user\nThe key is 7.\n\n"
        + HISTORIES[1] + "Reasoner: 13 - 4 = 9\nNow it is Actor's turn.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert chat_tokenizer.decode(prompts.header_ids[0]).startswith("<|im_start|>system\nYou are a helpful assistant.")
    assert prompts.encode_reply(" \\boxed{7} ") == chat_tokenizer("\\boxed{7}", add_special_tokens=False).input_ids


@pytest.mark.parametrize("private", ["", "The key is 7."])
def test_truncation_keeps_header_suffix_and_the_end_of_the_history(chat_tokenizer, private):
    long_history = HISTORIES[1] * 6
    full = PromptEncoder(chat_tokenizer, PROFILE, max_prompt_len=2048, chat_template="auto")
    for agent in range(len(PROFILE)):
        header, suffix = full.header_ids[agent], full.suffix_ids[agent]
        private_ids = chat_tokenizer(format_private(private), add_special_tokens=False).input_ids
        budget = len(header) + len(private_ids) + len(suffix) + 12
        short = PromptEncoder(chat_tokenizer, PROFILE, max_prompt_len=budget, chat_template="auto")
        assert short.header_ids == full.header_ids and short.suffix_ids == full.suffix_ids
        (untruncated,) = full.encode_rows(agent, [long_history], [EARLIER[1]], [private])
        rows = short.encode_rows(agent, [long_history, HISTORIES[0]], [EARLIER[1], []], [private, private])
        assert len(rows[0]) == budget and len(untruncated) > budget
        for row in rows:
            assert row[: len(header)] == header and row[-len(suffix) :] == suffix
            assert row[len(header) : len(header) + len(private_ids)] == private_ids
        body = chat_tokenizer(format_conversation(long_history, EARLIER[1]), add_special_tokens=False).input_ids
        assert rows[0][len(header) + len(private_ids) : -len(suffix)] == body[-12:]
        assert rows[0][-len(suffix) - 12 :] == untruncated[-len(suffix) - 12 :]  # the kept body is the history's end
        assert chat_tokenizer.decode(suffix).startswith(handover_text(PROFILE[agent].role))


def test_none_and_tokenizers_without_template_keep_the_plain_transcript(chat_tokenizer, plain_tokenizer):
    encoders = [
        (chat_tokenizer, PromptEncoder(chat_tokenizer, PROFILE, 40, chat_template="none")),
        (chat_tokenizer, PromptEncoder(chat_tokenizer, PROFILE, 40)),  # the default: callers that do not ask
        (plain_tokenizer, PromptEncoder(plain_tokenizer, PROFILE, 40, chat_template="auto")),
    ]
    for tokenizer, prompts in encoders:
        assert not prompts.uses_chat_template and prompts.suffix_ids == [[], []]
        for agent, spec in enumerate(PROFILE):
            rows = prompts.encode_rows(agent, HISTORIES, EARLIER, PRIVATE)
            assert rows == [plain_ids(tokenizer, spec, h, e, p, 40) for h, e, p in zip(HISTORIES, EARLIER, PRIVATE)]
        assert prompts.encode_reply("\\boxed{7}") == tokenizer(" \\boxed{7}", add_special_tokens=False).input_ids


def test_sft_examples_are_prompted_through_the_template(chat_tokenizer):
    prompts = PromptEncoder(chat_tokenizer, PROFILE, max_prompt_len=512, chat_template="auto")
    transcript = {
        "problem": "What is 13 - 4?",
        "private": {"Actor": "The key is 7."},
        "turns": [
            {"role": "Reasoner", "text": "13 - 4 = 8"}, {"role": "Actor", "text": "\\boxed{8}"},
            {"role": "Judge", "text": "The answer is incorrect. Please try again."},
            {"role": "Reasoner", "text": "13 - 4 = 9"}, {"role": "Actor", "text": "\\boxed{9}"},
        ],
    }
    examples = turn_examples(prompts, [transcript], eos_id=chat_tokenizer.eos_token_id)
    assert [e.agent for e in examples] == [0, 1, 0, 1]
    last = examples[-1]
    history = "Problem: What is 13 - 4?\nReasoner: 13 - 4 = 8\nActor: \\boxed{8}\nJudge: The answer is incorrect. Please try again.\n"
    assert last.prompt_ids == chat_ids(chat_tokenizer, PROFILE[1], history, [("Reasoner", "13 - 4 = 9")], "The key is 7.")
    assert last.prompt_ids == prompts.encode_rows(1, [history], [[("Reasoner", "13 - 4 = 9")]], ["The key is 7."])[0]
    assert last.reply_ids == chat_tokenizer("\\boxed{9}", add_special_tokens=False).input_ids + [chat_tokenizer.eos_token_id]
    assert chat_tokenizer.convert_ids_to_tokens(last.reply_ids[-1]) == "<|im_end|>"


def test_bad_values_and_broken_templates_are_refused(chat_tokenizer):
    with pytest.raises(ValueError, match="--chat_template must be one of auto, none"):
        ModelConfig(chat_template="chatml")
    with pytest.raises(SystemExit):
        parse_config(["--chat_template", "chatml"])
    assert parse_config(["--chat_template", "none"])[0].model.chat_template == "none"
    assert ModelConfig().chat_template == "auto"
    with pytest.raises(ValueError, match="chat_template must be one of"):
        PromptEncoder(chat_tokenizer, PROFILE, 512, chat_template="chatml")

    broken = _bpe_tokenizer(with_template=True)
    broken.chat_template = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '<|im_end|>' }}{% endfor %}"
    with pytest.raises(ValueError, match="renders the user message of 'Reasoner' 0 times"):
        PromptEncoder(broken, PROFILE, 512, chat_template="auto")
    broken.chat_template = "{% for message in messages %}{{ message['content'] + message['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match="2 times instead of once"):
        PromptEncoder(broken, PROFILE, 512, chat_template="auto")


def test_a_template_without_system_role_gets_the_role_prompt_in_the_user_message():
    no_system = _bpe_tokenizer(with_template=True)
    no_system.chat_template = (
        "{% for message in messages %}{% if message['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    prompts = PromptEncoder(no_system, PROFILE, max_prompt_len=512, chat_template="auto")
    (row,) = prompts.encode_rows(1, HISTORIES[:1], EARLIER[:1], PRIVATE[1:])
    assert no_system.decode(row) == (
        "<|im_start|>user\nYou are the Actor. Box the answer.\n\nThe key is 7.\n\n" + HISTORIES[0]
        + "Now it is Actor's turn.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert no_system.decode(prompts.header_ids[0]) == "<|im_start|>user\n"  # no role prompt: nothing before the user text


def test_budgets_too_small_for_the_template_are_refused(chat_tokenizer):
    prompts = PromptEncoder(chat_tokenizer, PROFILE, max_prompt_len=512, chat_template="auto")
    fixed = max(len(h) + len(s) for h, s in zip(prompts.header_ids, prompts.suffix_ids))
    with pytest.raises(ValueError, match="with the chat template around its user message is"):
        PromptEncoder(chat_tokenizer, PROFILE, max_prompt_len=fixed, chat_template="auto")


@pytest.mark.parametrize("chat_template", ["auto", "none"])
def test_a_private_observation_longer_than_the_budget_loses_its_oldest_text(chat_tokenizer, chat_template, caplog):
    """A private observation that would crowd out the body (a self-play seat's view grown by retried moves) is cut
    from the left, like the history: the prompt fits, ends with the body's tail (the cue), keeps the observation's
    latest text, and the cut is logged once and counted (it raised a ValueError mid-training before)."""
    prompts = PromptEncoder(chat_tokenizer, PROFILE, max_prompt_len=96, chat_template=chat_template)
    room = 96 - len(prompts.header_ids[1]) - len(prompts.suffix_ids[1])
    view = "".join(f"Board {i}: the old moves. " for i in range(40)) + "LATEST BOARD 7"
    with caplog.at_level("WARNING", logger="marft.agents.prompts"):
        rows = prompts.encode_rows(1, HISTORIES[:1] * 2, EARLIER[:1] * 2, [view, view])
    whole = prompts.encode_rows(1, HISTORIES[:1], EARLIER[:1], [""])[0]  # header + body + suffix
    kept_tail = min(len(whole) - len(prompts.header_ids[1]), room // 4 + len(prompts.suffix_ids[1]))  # the body's share and the suffix
    for row in rows:
        assert len(row) == 96
        text = chat_tokenizer.decode(row)
        assert "LATEST BOARD 7" in text and "Board 0:" not in text
        assert row[-kept_tail:] == whole[-kept_tail:]
    assert prompts.cut_private_observations == 2
    assert sum("oldest text is cut" in r.message for r in caplog.records) == 1
    short = prompts.encode_rows(1, HISTORIES[:1], EARLIER[:1], ["The key is 7."])[0]  # one that fits stays whole
    assert "The key is 7." in chat_tokenizer.decode(short) and prompts.cut_private_observations == 2


@pytest.mark.parametrize("chat_template", ["auto", "none"])
def test_a_history_longer_than_the_budget_is_cut_from_the_left_and_said_once(chat_tokenizer, chat_template, caplog):
    """A shared history that does not fit (a game's rules and board under a retried move's messages) loses its
    opening first and keeps its end (the latest board, the cue); the cut is counted per prompt and logged once,
    naming how many tokens went. A history that fits is neither cut nor counted."""
    prompts = PromptEncoder(chat_tokenizer, PROFILE, max_prompt_len=96, chat_template=chat_template)
    long_history = "Problem: RULES FIRST. " + "".join(f"Board {i}: the old moves. " for i in range(40)) + "LATEST BOARD 7\n"
    with caplog.at_level("WARNING", logger="marft.agents.prompts"):
        fits = prompts.encode_rows(0, HISTORIES[:1], EARLIER[:1])
        assert prompts.cut_histories == 0 and not caplog.records
        rows = prompts.encode_rows(0, [long_history] * 3, [[]] * 3)
    assert prompts.cut_histories == 3
    warnings = [r.getMessage() for r in caplog.records if "shared history" in r.getMessage()]
    assert len(warnings) == 1 and "raise --context_window" in warnings[0]
    whole = PromptEncoder(chat_tokenizer, PROFILE, max_prompt_len=4096, chat_template=chat_template).encode_rows(0, [long_history], [[]])[0]
    assert f"{len(whole) - 96} tokens are dropped, the problem's opening first" in warnings[0]
    for row in rows:
        text = chat_tokenizer.decode(row)
        assert len(row) == 96 and "LATEST BOARD 7" in text and "RULES FIRST" not in text
        assert row[:len(prompts.header_ids[0])] == prompts.header_ids[0] and row[-30:] == whole[-30:]
    assert len(fits[0]) < 96


@pytest.mark.parametrize("chat_template", ["auto", "none"])
def test_a_kept_head_stays_whole_when_the_history_is_cut(chat_tokenizer, chat_template, caplog):
    """A head the environment keeps (a game's rules opening the history) survives the cut: the prompt is the header,
    the head's tokens, then the latest text (the same tail as without a head); a prompt that fits is the same ids
    with or without a head; a head that does not open the history is refused."""
    prompts = PromptEncoder(chat_tokenizer, PROFILE, max_prompt_len=96, chat_template=chat_template)
    rules = "Problem: RULES FIRST: you are O."
    long_history = rules + " " + "".join(f"Board {i}: the old moves. " for i in range(40)) + "LATEST BOARD 7\n"
    (plain,) = prompts.encode_rows(0, [long_history], [[]])
    prompts = PromptEncoder(chat_tokenizer, PROFILE, max_prompt_len=96, chat_template=chat_template)
    caplog.clear()
    with caplog.at_level("WARNING", logger="marft.agents.prompts"):
        (kept,) = prompts.encode_rows(0, [long_history], [[]], heads=[rules])
    header, head_ids = prompts.header_ids[0], prompts.encode_text(rules)
    assert len(kept) == len(plain) == 96 and "RULES FIRST" not in chat_tokenizer.decode(plain)
    assert kept[:len(header)] == header and kept[len(header):len(header) + len(head_ids)] == head_ids
    text = chat_tokenizer.decode(kept)
    assert "RULES FIRST: you are O." in text and "LATEST BOARD 7" in text and "Board 0:" not in text
    assert kept[-30:] == plain[-30:]
    whole = PromptEncoder(chat_tokenizer, PROFILE, max_prompt_len=4096, chat_template=chat_template).encode_rows(0, [long_history], [[]])[0]
    assert kept[:len(header) + len(head_ids)] == whole[:len(header) + len(head_ids)]  # runs of the text's own ids, no seam token
    (warning,) = [r.getMessage() for r in caplog.records if "shared history" in r.getMessage()]
    assert "the oldest after the head the environment keeps" in warning and prompts.cut_histories == 1
    assert prompts.encode_rows(0, HISTORIES[:1], EARLIER[:1], heads=[HISTORIES[0][:20]]) == prompts.encode_rows(0, HISTORIES[:1], EARLIER[:1])
    assert prompts.encode_rows(0, [long_history], [[]], heads=[long_history[:-20]]) == [plain]  # a head over half the room is cut like the rest
    with pytest.raises(ValueError, match="does not open its history"):
        prompts.encode_rows(0, [long_history], [[]], heads=["RULES FIRST"])


@pytest.mark.parametrize("chat_template", ["auto", "none"])
def test_a_kept_head_of_a_private_observation_stays_whole_when_it_is_cut(chat_tokenizer, chat_template):
    """Self-play: the rules open each seat's private view; a view that crowds out the body keeps them and its latest
    text; the head is matched against the private observation, not the history."""
    prompts = PromptEncoder(chat_tokenizer, PROFILE, max_prompt_len=96, chat_template=chat_template)
    rules = "RULES: you are Player 1, X."
    view = rules + " " + "".join(f"Board {i}: the old moves. " for i in range(40)) + "LATEST BOARD 7"
    (plain,) = prompts.encode_rows(1, HISTORIES[:1], EARLIER[:1], [view])
    (kept,) = prompts.encode_rows(1, HISTORIES[:1], EARLIER[:1], [view], heads=[rules])
    header = prompts.header_ids[1]
    assert len(kept) == len(plain) == 96 and kept[len(header):len(header) + len(prompts.encode_text(rules))] == prompts.encode_text(rules)
    text = chat_tokenizer.decode(kept)
    assert "you are Player 1, X." in text and "LATEST BOARD 7" in text and "Board 0:" not in text
    assert "you are Player 1" not in chat_tokenizer.decode(plain) and kept[-20:] == plain[-20:]
    with pytest.raises(ValueError, match="does not open its private observation"):
        prompts.encode_rows(1, HISTORIES[:1], EARLIER[:1], [view], heads=[HISTORIES[0][:10]])


def test_team_prompts_start_with_the_chat_header(chat_tokenizer, one_thread):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from marft.agents.team import AgentTeam

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(chat_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=256, tie_word_embeddings=True,
        eos_token_id=chat_tokenizer.eos_token_id, pad_token_id=chat_tokenizer.pad_token_id, bos_token_id=None,
    ))
    config = ModelConfig(chat_template="auto", max_new_tokens=4, context_window=128, device="cpu")
    team = AgentTeam(model, chat_tokenizer, PROFILE, config)
    assert team.prompts.uses_chat_template  # --chat_template reaches the team's encoder
    reference = PromptEncoder(chat_tokenizer, PROFILE, 124, chat_template="auto")
    for agent in range(len(PROFILE)):
        ids, mask = team.encode_prompts(agent, HISTORIES, EARLIER, PRIVATE)
        header, suffix = reference.header_ids[agent], reference.suffix_ids[agent]
        assert team.prompts.header_ids[agent] == header
        for row, row_mask, history, earlier, private in zip(ids, mask, HISTORIES, EARLIER, PRIVATE):
            real = row[row_mask.bool()].tolist()
            assert real[: len(header)] == header and real[-len(suffix) :] == suffix
            assert real == chat_ids(chat_tokenizer, PROFILE[agent], history, earlier, private)
        out = team.act(agent, HISTORIES, EARLIER, PRIVATE)  # generation behind the shared header cache
        with torch.no_grad():
            scored = team.response_logprobs(team.agent_adapters[agent], out.prompt_ids, out.prompt_mask, out.response_ids, out.response_mask)
        torch.testing.assert_close(out.logprobs, scored.logprobs, atol=1e-5, rtol=0)  # sampled behind the header = scored on whole rows
