"""The ``marft`` command: pass@k, YAML run configs, eval / export / play on a trained checkpoint, one-line errors."""

import itertools
import json
import subprocess
import sys
from math import comb
from pathlib import Path

import pytest
import torch

import marft.trained.evaluate as evaluate_module
from marft.cli.main import main as marft
from marft.cli.train import main as train_main
from marft.config import parse_config
from marft.trained.evaluate import pass_at_k

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------- pass@k
@pytest.mark.parametrize("n", [1, 2, 3, 5, 6])
def test_pass_at_k_equals_the_share_of_k_subsets_with_a_correct_sample(n):
    """Brute force: over every k-subset of n samples (c of them correct), the share that holds a correct one."""
    for c in range(n + 1):
        samples = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(samples, k))
            expected = sum(any(s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)
            assert len(subsets) == comb(n, k)


def test_pass_at_k_refuses_k_above_n():
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(2, 1, 3)


# ---------------------------------------------------------------------- YAML run configs
def test_a_yaml_config_equals_the_same_flags_and_flags_override_it(tmp_path):
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("env_name: relay_sum\nalgo:\n  lr: 0.0005\n  algorithm_name: TPPO\nn_rollout_threads: 8\nshared_lora: true\n"
                         "target_kl: none\n")
    from_yaml, given_yaml = parse_config(["--config", str(yaml_file)])
    from_flags, given_flags = parse_config(["--env_name", "relay_sum", "--lr", "0.0005", "--algorithm_name", "TPPO",
                                            "--n_rollout_threads", "8", "--shared_lora", "true"])
    assert from_yaml.to_dict() == from_flags.to_dict()
    assert given_yaml >= given_flags  # fields in the file count as given (a resume keeps them)
    overridden, _ = parse_config(["--config", str(yaml_file), "--lr", "0.002"])
    assert overridden.algo.lr == 0.002 and overridden.algo.algorithm_name == "TPPO"


def test_the_run_directory_config_yaml_reads_back_as_the_same_config(tmp_path):
    config, _ = parse_config(["--env_name", "relay_sum", "--lr", "0.0005", "--seed", "3"])
    (tmp_path / "config.yaml").write_text(config.to_yaml())
    again, _ = parse_config(["--config", str(tmp_path / "config.yaml")])
    assert again.to_dict() == config.to_dict()


@pytest.mark.parametrize("text, message", [
    ("learning_rate: 0.001\n", "unknown key 'learning_rate'"),
    ("lrr: 0.001\n", "did you mean 'lr'"),
    ("algo:\n  n_rollout_threads: 8\n", "unknown key 'n_rollout_threads' in section 'algo'"),
    ("lr: fast\n", "lr"),
    ("n_rollout_threads: 2.5\n", "n_rollout_threads: invalid literal for int()"),
    ("- lr\n", "a mapping"),
    ("lr: [0.1]\n", "lr must be float"),
    ("lr: [\n", "not valid YAML"),
    ("lr: 0.1\nalgo:\n  lr: 0.2\n", "set twice"),
    ("lr: 0.1\nlr: 0.2\n", "set twice"),  # YAML itself would keep the last silently
    ("algo: {lr: 0.1}\nmodel: {lora_r: 4}\nalgo: {ppo_epoch: 3}\n", "set twice"),
    ("seed: 1:30\n", "seed"),  # YAML 1.1 would read base 60 (90)
    ("seed: 0x10\n", "seed"),
    ("model: foo\n", "section 'model'"),
    ("lr: " + "[" * 5000 + "\n", "nested too deeply"),
])
def test_a_bad_yaml_config_fails_in_one_line_before_anything_loads(tmp_path, monkeypatch, capsys, text, message):
    import marft.launch

    monkeypatch.setattr(marft.launch, "validate", lambda *a, **k: pytest.fail("validated a bad config"))
    (tmp_path / "run.yaml").write_text(text)
    with pytest.raises(SystemExit) as stop:
        train_main(["--config", str(tmp_path / "run.yaml")])
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_yaml_numbers_and_booleans_read_as_the_flags_read_them(tmp_path):
    (tmp_path / "run.yaml").write_text("seed: 010\nshared_lora: 1\ntarget_kl: null\nlr: 5\n")
    from_yaml, _ = parse_config(["--config", str(tmp_path / "run.yaml")])
    from_flags, _ = parse_config(["--seed", "010", "--shared_lora", "1", "--target_kl", "none", "--lr", "5"])
    assert from_yaml.to_dict() == from_flags.to_dict() and from_yaml.runner.seed == 10  # not YAML 1.1's octal 8


def test_config_given_twice_is_refused(tmp_path, capsys):
    (tmp_path / "a.yaml").write_text("seed: 1\n")
    with pytest.raises(SystemExit):
        parse_config(["--config", str(tmp_path / "a.yaml"), "--config", str(tmp_path / "a.yaml")])
    assert "--config given 2 times" in capsys.readouterr().err


def test_a_missing_yaml_config_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit):
        train_main(["--config", str(tmp_path / "nope.yaml")])
    assert "nope.yaml" in capsys.readouterr().err


def test_the_shipped_configs_parse():
    files = sorted((ROOT / "configs").glob("*.yaml"))
    assert files, "configs/ ships run configs"
    for path in files:
        parse_config(["--config", str(path)])


# ---------------------------------------------------------------------- the command and its errors
def test_help_and_unknown_commands_are_one_screen_without_traceback(capsys):
    assert marft(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("train", "sft", "eval", "export", "play"))
    assert marft(["evaluate"]) == 2
    assert capsys.readouterr().err.strip().startswith("error: unknown command 'evaluate'")
    for command in ("eval", "export", "play", "train", "sft"):
        with pytest.raises(SystemExit) as stop:
            marft([command, "--help"])
        assert stop.value.code == 0
        assert "--" in capsys.readouterr().out


def test_python_dash_m_marft_runs_the_command():
    result = subprocess.run([sys.executable, "-m", "marft", "--help"], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0 and "commands:" in result.stdout


@pytest.mark.parametrize("argv, message", [
    (["eval", "--load_path", "/nonexistent/run"], "does not exist"),
    (["export", "--load_path", "/nonexistent/run", "--output_dir", "/tmp/x"], "does not exist"),
    (["play", "--load_path", "/nonexistent/run", "hi"], "does not exist"),
    (["eval", "--k", "1,x"], "comma-separated integers"),
    (["eval"], "--load_path is required"),
    (["eval", "--load_path", "/x", "--episodes", "4", "--k", "2"], "go without it"),
])
def test_bad_input_is_one_error_line(capsys, argv, message):
    try:
        code = marft(argv)
    except SystemExit as stop:
        code = stop.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


# ---------------------------------------------------------------------- on a trained checkpoint
@pytest.fixture(scope="module")
def trained_run(random_model_dir, tmp_path_factory):
    run = tmp_path_factory.mktemp("cli_run")
    argv = ["--model_name_or_path", random_model_dir, "--env_name", "dense_relay_sum", "--max_new_tokens", "6",
            "--context_window", "128", "--n_rollout_threads", "4", "--episode_length", "1", "--num_env_steps", "8",
            "--eval_episodes", "6", "--n_eval_threads", "3", "--seed", "5", "--lr", "0.05", "--output_dir", str(run)]
    assert train_main(argv) == 0
    return run


def test_eval_replays_the_evaluation_training_printed(trained_run, capsys):
    summary_after = json.loads((trained_run / "summary.json").read_text())
    assert marft(["eval", "--load_path", str(trained_run), "--episodes", "6", "--seed", "5", "--output_dir", str(trained_run / "e1")]) == 0
    summary = json.loads((trained_run / "e1" / "summary.json").read_text())
    assert summary["return"] == pytest.approx(summary_after["return_after"], abs=1e-12)
    transcripts = (trained_run / "e1" / "transcripts.jsonl").read_text().splitlines()
    assert len(transcripts) == 6 and all(json.loads(line)["steps"] for line in transcripts)
    assert [json.loads(line)["task"] for line in transcripts] == list(range(6))  # episode k plays task k % 18 (the test split)
    assert set(summary["roles"]) == {"Reasoner", "Actor"} and summary["roles"]["Actor"]["turns"] == 6


def test_more_episodes_than_tasks_are_said_to_revisit_them(trained_run, caplog):
    assert marft(["eval", "--load_path", str(trained_run), "--episodes", "20", "--output_dir", str(trained_run / "e20")]) == 0
    summary = json.loads((trained_run / "e20" / "summary.json").read_text())
    tasks = [json.loads(line)["task"] for line in (trained_run / "e20" / "transcripts.jsonl").read_text().splitlines()]
    assert summary["episodes"] == 20 and summary["distinct_tasks"] == len(set(tasks)) == 18
    assert any("revisits the 18 tasks" in r.getMessage() and "18 distinct tasks, not 20" in r.getMessage() for r in caplog.records)
    caplog.clear()
    assert marft(["eval", "--load_path", str(trained_run), "--episodes", "18", "--output_dir", str(trained_run / "e18")]) == 0
    assert json.loads((trained_run / "e18" / "summary.json").read_text())["distinct_tasks"] == 18
    assert not any("revisits" in r.getMessage() for r in caplog.records)


def test_eval_reports_pass_at_k_per_task(trained_run):
    assert marft(["eval", "--load_path", str(trained_run), "--n", "2", "--k", "1,2"]) == 0
    summary = json.loads((trained_run / "eval" / "steps_2" / "test-n2" / "summary.json").read_text())  # per checkpoint, split, n
    assert summary["n"] == 2 and summary["episodes"] == 2 * summary["tasks"]
    assert 0.0 <= summary["pass@1"] <= summary["pass@2"] <= 1.0


def test_eval_of_the_base_model_uses_fresh_adapters(trained_run):
    assert marft(["eval", "--load_path", str(trained_run), "--base_model", "--episodes", "3"]) == 0
    assert json.loads((trained_run / "eval" / "steps_2-base_model" / "test-episodes3" / "summary.json").read_text())["checkpoint"] is None


def test_exported_adapters_load_in_plain_peft_with_the_teams_logits(trained_run, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from marft.trained.evaluate import checkpoint_config, load_team
    from marft.trained.export import export

    out = export(trained_run, tmp_path / "team", merge=True)
    team_file = json.loads((out / "team.json").read_text())
    assert [r["role"] for r in team_file["roles"]] == ["Reasoner", "Actor"]
    config, checkpoint = checkpoint_config(trained_run)
    team, _, _ = load_team(config, checkpoint)
    ids = torch.tensor([[5, 17, 33, 41, 2, 9, 12]])
    for role in team_file["roles"]:
        adapter = role["adapter"]
        assert (out / adapter / "adapter_model.safetensors").is_file()
        team.set_active(adapter)
        with torch.no_grad():
            expected = team.model(input_ids=ids).logits
            plain = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(team_file["base_model_path"]), str(out / adapter))
            merged = AutoModelForCausalLM.from_pretrained(str(out / role["merged_model"]))
            assert (expected - plain(input_ids=ids).logits).abs().max() <= 1e-5
            assert (expected - merged(input_ids=ids).logits).abs().max() <= 1e-4
        assert expected.abs().max() > 0
    team.set_active(None)
    assert "PeftModel.from_pretrained" in (out / "README.md").read_text()


def test_a_new_run_refuses_a_folder_holding_another_runs_checkpoints(trained_run, random_model_dir, capsys):
    argv = ["--model_name_or_path", random_model_dir, "--env_name", "dense_relay_sum", "--output_dir", str(trained_run)]
    assert train_main(argv) == 2
    err = capsys.readouterr().err
    assert "already holds a run's checkpoints" in err and f"--load_path {trained_run}" in err


def test_play_with_an_empty_problem_prints_only_the_error(trained_run, capsys):
    assert marft(["play", "--load_path", str(trained_run), "  "]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("error: the problem is empty")


def test_export_refuses_a_folder_that_is_not_empty(trained_run, tmp_path, capsys):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert marft(["export", "--load_path", str(trained_run), "--output_dir", str(tmp_path / "full")]) == 2
    assert "not empty" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["eval", "export"])
def test_an_output_dir_nothing_can_be_written_in_fails_before_the_team_loads(trained_run, unwritable_dir, capsys, monkeypatch, command):
    def load(*args, **kwargs):
        pytest.fail("the team loaded before the output folder was checked")

    monkeypatch.setattr(evaluate_module, "load_team", load)
    out = unwritable_dir / "out"
    assert marft([command, "--load_path", str(trained_run), "--output_dir", str(out)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]  # after the checkpoint's line
    assert len(err) == 1 and err[0].startswith(f"error: --output_dir {out}: cannot write in {unwritable_dir}: "), err


def test_play_prints_every_turn_with_its_role(trained_run, capsys, monkeypatch):
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO("Agree on one digit.\n"))
    assert marft(["play", "--load_path", str(trained_run)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "Problem: Agree on one digit."
    assert lines[1].startswith("Reasoner: ") and lines[2].startswith("Actor: ")


def test_each_subcommands_help_names_it(capsys):
    for command in ("train", "eval", "export", "play", "sft"):
        with pytest.raises(SystemExit):
            marft([command, "--help"])
        assert capsys.readouterr().out.startswith(f"usage: marft {command} "), command


def test_training_prints_progress_lines_without_a_terminal(random_model_dir, tmp_path, capsys):
    """Output to a file or a pipe has no progress bar: about every twentieth of the run prints one line."""
    argv = ["--model_name_or_path", random_model_dir, "--env_name", "dense_relay_sum", "--max_new_tokens", "4",
            "--context_window", "128", "--n_rollout_threads", "2", "--episode_length", "1", "--num_env_steps", "4",
            "--eval_episodes", "2", "--n_eval_threads", "2", "--output_dir", str(tmp_path / "run")]
    assert train_main(argv) == 0
    out = capsys.readouterr().out
    assert "iteration 1/2: training accuracy" in out and "iteration 2/2: training accuracy" in out and " s\n" in out
