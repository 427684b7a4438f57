"""``--lora_target_modules all-linear,lm_head``: adapters on the output layer too.

An adapter on the decoder alone can only steer the final state; which tokens that state can make likely is set by the
frozen output layer. On the embedded models ``[`` and ``]`` (every TextArena move's brackets) never were outputs in
their build, and no final state gives either more than ~0.8 %: a game's moves cannot be learned there without an
adapted output layer. These tests check that the output layer is adapted exactly when asked, that a tied output layer
(its weight is the input embedding too) is never folded into (which would change the input embedding), that
checkpoints hold LoRA weights only, that the export's merged model keeps the input embedding, and that on the embedded model the warm start learns a bracketed move with it and not without it.
"""

import json

import pytest
import torch
from test_team import HISTORIES, make_team

from marft.cli.train import main as train_main

HEAD = "all-linear,lm_head"


def adapted_modules(team) -> set[str]:
    return {name.split(".lora_A.")[0].rsplit(".", 1)[-1] for name, _ in team.model.named_parameters() if ".lora_A." in name}


def randomize_adapters(team, std=0.3):
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in team.model.named_parameters():
            if "lora_" in name:
                p.normal_(std=std)


def test_all_linear_with_lm_head_adapts_the_output_layer_besides_every_linear_layer(random_model_dir):
    plain, with_head = make_team(random_model_dir), make_team(random_model_dir, lora_target_modules=HEAD)
    assert with_head.model.get_output_embeddings() is not plain.model.get_output_embeddings()
    assert adapted_modules(with_head) - adapted_modules(plain) == {"lm_head"}
    assert adapted_modules(plain) <= adapted_modules(with_head) and "q_proj" in adapted_modules(plain)
    assert with_head.bank.output_layer_adapted and not plain.bank.output_layer_adapted
    assert len(with_head.bank.tied_layers) == 1  # the random model ties its output layer to the input embedding


def test_the_targets_read_all_linear_in_any_case_and_refuse_a_name_no_module_has(random_model_dir):
    from transformers import AutoModelForCausalLM

    from marft.agents.adapters import lora_targets

    model = AutoModelForCausalLM.from_pretrained(random_model_dir)
    assert lora_targets(model, "ALL-LINEAR, lm_head,") == lora_targets(model, "all-linear,lm_head")
    assert lora_targets(model, "All-Linear") == "all-linear" and lora_targets(model, "q_proj,v_proj") == ["q_proj", "v_proj"]
    with pytest.raises(ValueError, match="lm_haed"):
        lora_targets(model, "all-linear,lm_haed")  # peft would adapt the rest and skip it silently
    plain = make_team(random_model_dir, lora_target_modules="ALL-LINEAR")
    assert "q_proj" in adapted_modules(plain) and "lm_head" not in adapted_modules(plain)


def test_the_output_layer_adapter_changes_the_logits_and_the_input_embedding_stays(random_model_dir):
    team = make_team(random_model_dir, lora_target_modules=HEAD)
    randomize_adapters(team)
    embedding = team.model.get_input_embeddings().weight.detach().clone()
    ids, mask = team.encode_prompts(1, HISTORIES, [[("Reasoner", "hi")], [], []])
    head = team.model.get_output_embeddings()
    team.bank.route(team.agent_adapters[1])
    with torch.no_grad():
        adapted = team.model(input_ids=ids, attention_mask=mask).logits
        head.lora_B[team.agent_adapters[1]].weight.zero_()  # the same adapter without its output-layer part
        decoder_only = team.model(input_ids=ids, attention_mask=mask).logits
    assert (adapted - decoder_only).abs().max() > 1e-2
    assert torch.equal(team.model.get_input_embeddings().weight, embedding)


def test_merged_sampling_keeps_a_tied_output_layer_unfolded(random_model_dir):
    """Folding the output layer's update into a weight shared with the input embedding would change the input
    embedding too; inside ``merged`` the logits equal the unmerged ones and the embedding is the very same tensor."""
    team = make_team(random_model_dir, lora_target_modules=HEAD)
    randomize_adapters(team)
    embedding = team.model.get_input_embeddings().weight
    before = embedding.detach().clone()
    ids, mask = team.encode_prompts(1, HISTORIES, [[("Reasoner", "hi")], [], []])
    for adapter in team.agent_adapters:
        team.bank.route(adapter)
        with torch.no_grad():
            unmerged = team.model(input_ids=ids, attention_mask=mask).logits
            with team.bank.merged(adapter):
                assert torch.equal(team.model.get_input_embeddings().weight, before)
                merged = team.model(input_ids=ids, attention_mask=mask).logits
        scale = unmerged.abs().max()  # logits of ~50 with these adapters: float32 rounding ~1e-5 of that
        torch.testing.assert_close(merged, unmerged, atol=float(1e-4 * scale), rtol=0)
        assert scale > 1
    assert torch.equal(embedding, before)


@pytest.fixture(scope="module")
def head_run(random_model_dir, tmp_path_factory):
    run = tmp_path_factory.mktemp("head_run")
    argv = ["--model_name_or_path", random_model_dir, "--env_name", "dense_relay_sum", "--max_new_tokens", "6",
            "--context_window", "128", "--n_rollout_threads", "4", "--episode_length", "1", "--num_env_steps", "8",
            "--eval_episodes", "2", "--n_eval_threads", "2", "--seed", "5", "--lr", "0.05", "--lora_target_modules", HEAD,
            "--output_dir", str(run)]
    assert train_main(argv) == 0
    return run


def test_checkpoints_hold_lora_weights_only_and_load_back(head_run):
    from safetensors.torch import load_file

    from marft.trained.evaluate import checkpoint_config, load_team

    checkpoint = head_run / "checkpoints" / "steps_2"
    for file in checkpoint.rglob("adapter_model.safetensors"):
        names = load_file(file)
        assert names and all("lora_" in name for name in names), file  # no copy of the embedding
        assert any("lm_head" in name for name in names), file
    config, found = checkpoint_config(head_run)
    team, _, _ = load_team(config, found)
    saved = load_file(checkpoint / team.agent_adapters[0] / "adapter_model.safetensors")
    head_b = next(v for k, v in saved.items() if "lm_head.lora_B" in k)
    assert head_b.abs().max() > 0  # the update trained the output layer's adapter
    assert torch.equal(team.model.get_output_embeddings().lora_B[team.agent_adapters[0]].weight, head_b)


def test_the_exported_merged_model_keeps_the_input_embedding(head_run, tmp_path):
    for _, base, merged in merged_exports(head_run, tmp_path):
        assert torch.equal(merged.get_input_embeddings().weight, base.get_input_embeddings().weight)
        assert not torch.equal(merged.get_output_embeddings().weight, base.get_output_embeddings().weight)


@pytest.mark.usefixtures("one_thread")
def test_the_embedded_model_learns_a_bracketed_move_only_with_an_adapted_output_layer():
    """The warm start on Tic-Tac-Toe's random legal moves (`` [4]``): without the output layer the ``[`` stays at the
    frozen layer's ceiling (log-prob ≈ -4.8 whatever the adapter); with it, the move's brackets are learned."""
    pytest.importorskip("textarena", reason="textarena is not installed (pip install -r requirements-dev.txt)")
    from marft.config import parse_config
    from marft.launch import build_team, validate
    from marft.sft import SFTConfig, collate_turns, demonstrations, turn_examples, warm_start

    nll_of_bracket = {}
    for target in ("all-linear", HEAD):
        config, _ = parse_config(["--env_name", "textarena:TicTacToe-v0", "--profile_path", "game_player", "--max_new_tokens", "4",
                                  "--context_window", "160", "--lora_target_modules", target])
        profile, make_env, _ = validate(config)
        team, _ = build_team(config, profile)
        transcripts = demonstrations(make_env, 400, seed=0)
        examples = turn_examples(team.prompts, transcripts, eos_id=team.eos_id, max_reply_tokens=4)
        assert team.tokenizer.convert_ids_to_tokens(examples[0].reply_ids[1]) == "["
        warm_start(team, examples[:300], SFTConfig(sft_steps=60), seed=0)
        held_out = examples[300:364]
        ids, mask, labels = collate_turns(held_out, team.pad_id)
        team.bank.route(team.agent_adapters[0])
        with torch.no_grad():
            logp = torch.log_softmax(team.model(input_ids=ids, attention_mask=mask).logits[:, :-1].float(), -1)
        targets = labels[:, 1:]
        first = (targets != -100).float().argmax(1)  # the reply's first position (" "); the "[" is next
        rows = torch.arange(len(held_out))
        nll_of_bracket[target] = -logp[rows, first + 1, targets[rows, first + 1]].mean().item()
    assert nll_of_bracket["all-linear"] > 4.0, nll_of_bracket  # capped by the frozen output layer
    assert nll_of_bracket[HEAD] < 1.0, nll_of_bracket


@pytest.mark.usefixtures("one_thread")
def test_the_warm_start_names_format_tokens_it_could_not_make_likely(tmp_path, caplog):
    """``marft sft``: after the warm start, reply tokens in many replies that are still unlikely are logged with the
    flag that lifts an output layer's cap, and recorded in ``sft_summary.json``; with the output layer adapted none."""
    pytest.importorskip("textarena", reason="textarena is not installed (pip install -r requirements-dev.txt)")
    import logging

    from marft.cli.sft import main as sft_main

    common = ["--env_name", "textarena:TicTacToe-v0", "--profile_path", "game_player", "--max_new_tokens", "4", "--context_window", "160",
              "--n_demonstrations", "300", "--sft_steps", "60"]
    with caplog.at_level(logging.WARNING, logger="marft.sft"):
        assert sft_main([*common, "--output_dir", str(tmp_path / "plain")]) == 0
    unlearned = json.loads((tmp_path / "plain" / "sft_summary.json").read_text())["unlearned_reply_tokens"]
    assert set(unlearned) >= {"[", "]"} and min(unlearned.values()) > 3.0, unlearned
    assert "--lora_target_modules all-linear,lm_head" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="marft.sft"):
        assert sft_main([*common, "--lora_target_modules", HEAD, "--output_dir", str(tmp_path / "head")]) == 0
    assert json.loads((tmp_path / "head" / "sft_summary.json").read_text())["unlearned_reply_tokens"] == {}
    assert "still unlikely" not in caplog.text


def test_an_export_of_an_adapted_input_embedding_keeps_the_output_layer(random_model_dir, tmp_path):
    """A tied model with its input embedding adapted (``all-linear,embed_tokens``): the merge must not fold the
    embedding's update into the output layer that shares its weight; peft's tied-layer warning is kept for it."""
    run = tmp_path / "run"
    assert train_main(["--model_name_or_path", random_model_dir, "--env_name", "dense_relay_sum", "--max_new_tokens", "6",
                       "--context_window", "128", "--n_rollout_threads", "4", "--episode_length", "1", "--num_env_steps", "4",
                       "--eval_episodes", "2", "--n_eval_threads", "2", "--seed", "5", "--lr", "0.05",
                       "--lora_target_modules", "all-linear,embed_tokens", "--output_dir", str(run)]) == 0
    for team, base, merged in merged_exports(run, tmp_path):
        assert not team.bank.quiet_tied
        assert torch.equal(merged.get_output_embeddings().weight, base.get_output_embeddings().weight)


def merged_exports(run, tmp_path):
    """Export ``run`` with merged models; yield ``(team, base model, merged model)`` per role, the team routed through
    that role's adapter, after checking the merged model's logits equal the team's."""
    from transformers import AutoModelForCausalLM

    from marft.trained.evaluate import checkpoint_config, load_team
    from marft.trained.export import export

    out = export(run, tmp_path / "team", merge=True)
    team_file = json.loads((out / "team.json").read_text())
    config, checkpoint = checkpoint_config(run)
    team, _, _ = load_team(config, checkpoint)
    base = AutoModelForCausalLM.from_pretrained(team_file["base_model_path"])
    ids = torch.tensor([[5, 17, 33, 41, 2, 9, 12]])
    for role in team_file["roles"]:
        team.set_active(role["adapter"])
        merged = AutoModelForCausalLM.from_pretrained(str(out / role["merged_model"]))
        with torch.no_grad():
            assert (team.model(input_ids=ids).logits - merged(input_ids=ids).logits).abs().max() <= 1e-4
        yield team, base, merged
    team.set_active(None)
