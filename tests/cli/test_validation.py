"""Every flag validated before the model loads: a flag fuzzer over every config field (training and warm start)
with invalid values (NaN, inf, negative, zero, huge, wrong type, empty, a folder, an undecodable file): each is
either a one-line error (exit code 2, no traceback) or an accepted value that the field's documented rule
(:data:`marft.validation.RULES`, shown in ``--help``) allows. In-process through ``main`` (the model load
stubbed out), plus a few end-to-end subprocess cases.
"""

import dataclasses
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import get_type_hints

import pytest
import torch

import marft.cli.sft
import marft.cli.train
import marft.launch
import marft.sft
from marft.config import CHOICES, SECTIONS, build_parser, field_docs
from marft.sft import SFTConfig
from marft.validation import RULES, _base_type, check_device, numeric_fields

ROOT = Path(__file__).resolve().parents[2]
ALL_SECTIONS = {**SECTIONS, "sft": SFTConfig}

INVALID_NUMBERS = ["nan", "inf", "-inf", "-1", "0", "1e300", "1" + "0" * 30, "abc", "1.5", ""]
INVALID_BOOLS = ["maybe", "2", "nan", ""]
ACCEPTS_ANY_STRING = {
    "model_name_or_path": "a hub name (like 'nan'): one the hub does not have is a one-line error (exit 2) when the model loads",
    "experiment_name": "a name for the default run directory",
    "output_dir": "a folder to create (the values fuzzed here are relative folder names)",
    "lora_target_modules": "module names only the loaded model knows: a name it lacks is a one-line error (exit 2) once it loads",
    "dataset_path": "an empty value means the env's default",
    "eval_dataset_path": "an empty value means the test split of --dataset_path",
    "load_path": "an empty value means no resume",
}
"""String fields whose fuzzed values (``""``, ``"nan"``, ``"-1"``) are legal before the model loads, and why."""


class Accepted(Exception):
    """Raised instead of loading the model: validation let the flags through."""


def string_values(tmp_path: Path) -> list[str]:
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\xff\xfe\x00\x81 not utf-8 \xc3\x28")
    (tmp_path / "a_folder").mkdir(exist_ok=True)
    return ["", "nan", "-1", str(tmp_path / "a_folder"), str(binary)]


def values_for(hint, tmp_path: Path) -> list[str]:
    kind, _ = _base_type(hint)
    if kind in (int, float):
        return INVALID_NUMBERS
    if kind is bool:
        return INVALID_BOOLS
    return string_values(tmp_path)


def cases():
    for section, cls in ALL_SECTIONS.items():
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            yield section, f.name, hints[f.name]


@pytest.fixture
def stubbed(monkeypatch):
    """``main`` of both commands stops where the model would load; SFT demonstrations are not drawn."""
    def accept(*args, **kwargs):
        raise Accepted

    monkeypatch.setattr(marft.launch, "build_runner", accept)
    monkeypatch.setattr(marft.launch, "build_team", accept)
    monkeypatch.setattr(marft.cli.sft, "build_team", accept)
    monkeypatch.setattr(marft.cli.sft, "demonstrations", lambda make_env, n, seed, recovery_share=0.0: [])


def base_flags(model_dir: str, run_dir: Path) -> list[str]:
    return ["--model_name_or_path", model_dir, "--env_name", "dense_relay_sum", "--max_new_tokens", "6", "--context_window", "128",
            "--n_rollout_threads", "2", "--episode_length", "1", "--num_env_steps", "4", "--eval_episodes", "1",
            "--n_eval_threads", "1", "--output_dir", str(run_dir)]


def outcome(command, argv: list[str], capsys) -> tuple[str, str]:
    """``("accepted" | "error", the error line)``; fails on a traceback, an exception or more than one error line."""
    try:
        code = command(argv)
    except Accepted:
        return "accepted", ""
    except SystemExit as stop:  # argparse
        code = stop.code
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and lines and lines[-1].startswith("error: "), (code, err)
    assert sum(line.startswith("error:") for line in lines) == 1, err
    return "error", lines[-1]


@pytest.mark.slow
def test_the_flag_fuzzer_every_field_every_invalid_value(random_model_dir, tmp_path, monkeypatch, capsys, stubbed):
    monkeypatch.chdir(tmp_path)  # --output_dir values that are relative names land here
    run_dir = tmp_path / "run"
    tried, errors = 0, 0
    for section, name, hint in cases():
        command = marft.cli.sft.main if section == "sft" else marft.cli.train.main
        for value in values_for(hint, tmp_path):
            if name == "output_dir" and value == str(tmp_path / "binary.jsonl"):
                continue  # a file as --output_dir: its own case below
            argv = base_flags(random_model_dir, run_dir) + [f"--{name}", value]
            result, line = outcome(command, argv, capsys)
            tried += 1
            kind, optional = _base_type(hint)
            if result == "error":
                errors += 1
                if kind in (int, float, bool) and value not in ("", "abc", "maybe"):  # a rule or the parser named the flag
                    assert f"--{name}" in line or f"argument --{name}" in line, (name, value, line)
                continue
            # accepted: only what the field's documentation allows
            if kind in (int, float):
                number = float(value) if value not in ("",) else None
                assert number is not None and math.isfinite(number), (name, value)
                assert RULES[name].accepts(number), (name, value, RULES[name].describe())
            elif kind is bool:
                pytest.fail(f"--{name} {value!r} accepted as a bool")
            elif name in CHOICES:
                pytest.fail(f"--{name} {value!r} accepted, not one of {list(CHOICES[name])}")
            else:
                assert name in ACCEPTS_ANY_STRING or (value == "" and optional), (name, value)
    assert tried > 400 and errors > 300, (tried, errors)


def test_fuzzer_values_through_the_warm_start_command(random_model_dir, tmp_path, capsys, stubbed):
    """The warm start's own flags, and an undecodable --sft_data file named in its error."""
    binary = tmp_path / "sft.jsonl"
    binary.write_bytes(b"\xff\xfe\x00\x81")
    result, line = outcome(marft.cli.sft.main, base_flags(random_model_dir, tmp_path / "run") + ["--sft_data", str(binary)], capsys)
    assert result == "error" and str(binary) in line and "not UTF-8" in line, line
    result, line = outcome(marft.cli.sft.main, base_flags(random_model_dir, tmp_path / "run") + ["--sft_lr", "nan"], capsys)
    assert line.startswith("error: --sft_lr must be a finite number, got nan")


@pytest.mark.parametrize("argv_extra, expected", [
    (["--lr", "nan"], "error: --lr must be a finite number, got nan (see --help)"),
    (["--critic_lr", "1e999"], "error: --critic_lr must be a finite number, got inf (see --help)"),
    (["--num_env_steps", "0"], "error: --num_env_steps must be >= 1, got 0 (see --help)"),
    (["--num_env_steps", "1"], "error: --num_env_steps 1 is less than one iteration: one iteration collects 2 environment steps"),
    (["--gamma", "-0.5"], "error: --gamma must be in [0, 1], got -0.5 (see --help)"),
    (["--seed", "99999999999"], "error: --seed must be in [0, 2147483647], got 99999999999 (see --help)"),
    (["--ppo_epoch", "2.5"], "error: argument --ppo_epoch: invalid int value: '2.5' (see --help)"),
    (["--shared_lora", "maybe"], "error: argument --shared_lora: expected true or false, got 'maybe' (see --help)"),
    (["--device", "banana"], "error: --device 'banana' is not a torch device"),
])
def test_named_errors(random_model_dir, tmp_path, capsys, stubbed, argv_extra, expected):
    result, line = outcome(marft.cli.train.main, base_flags(random_model_dir, tmp_path / "run") + argv_extra, capsys)
    assert result == "error" and line.startswith(expected), line


def test_an_output_dir_that_is_a_file(random_model_dir, tmp_path, capsys, stubbed):
    file = tmp_path / "a_file"
    file.write_text("x")
    result, line = outcome(marft.cli.train.main, base_flags(random_model_dir, file), capsys)
    assert line == f"error: --output_dir {file} exists and is not a folder"


def test_an_output_dir_nothing_can_be_written_in(random_model_dir, unwritable_dir, capsys, monkeypatch):
    def load(*args, **kwargs):
        pytest.fail("the model loaded before the output folder was checked")

    monkeypatch.setattr(marft.launch, "build_team", load)
    run = unwritable_dir / "run"
    result, line = outcome(marft.cli.train.main, base_flags(random_model_dir, run), capsys)
    assert line.startswith(f"error: --output_dir {run}: cannot write in {unwritable_dir}: "), line
    assert "free" not in line  # the cause, not a disk-space hint


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_cuda_without_cuda_names_device_cpu():
    with pytest.raises(ValueError, match=r"--device cuda: this machine has no usable CUDA GPU .*use --device cpu"):
        check_device("cuda")


def wrong_type(hint):
    kind, _ = _base_type(hint)
    return {int: "8", float: "0.1", bool: "yes", str: 3}.get(kind, object())


@pytest.mark.parametrize("section, name, hint", list(cases()), ids=lambda x: x if isinstance(x, str) else "")
def test_a_wrong_python_type_is_a_named_error(section, name, hint):
    """Configs built in Python or read from a checkpoint's JSON: a value of the wrong type is refused by name."""
    with pytest.raises(ValueError, match=f"^--{name} must be"):
        ALL_SECTIONS[section](**{name: wrong_type(hint)})


def test_every_numeric_field_has_a_rule():
    missing = [f"{section}.{name}" for section, cls in ALL_SECTIONS.items() for name in numeric_fields(cls) if name not in RULES]
    assert not missing, f"add a rule for {missing} to marft.validation.RULES (the allowed range, shown in --help)"


def test_help_shows_each_rule():
    text = build_parser().format_help()
    assert "[> 0]" in text and "[in [0, 1]]" in text and "[>= 1]" in text
    assert "--save_every_minutes" in text and "--continue_on_save_error" in text
    docs = field_docs(SFTConfig)
    assert "sft_lr" in docs


# ---------------------------------------------------------------------- end to end
def run_script(script: str, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(ROOT / "scripts" / script), *argv], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("script, argv, expected", [
    ("train_math.py", ["--lr", "nan"], "error: --lr must be a finite number, got nan"),
    ("train_math.py", ["--num_env_steps", "0"], "error: --num_env_steps must be >= 1, got 0"),
    ("train_math.py", ["--num_env_steps", "31"], "error: --num_env_steps 31 is less than one iteration: one iteration collects 32"),
    ("train_math.py", ["--device", "cuda"], "error: --device cuda: this machine has no usable CUDA GPU"),
    ("sft.py", ["--sft_data", "BINARY"], "is not UTF-8 text"),
    ("sft.py", ["--sft_batch_size", "-3"], "error: --sft_batch_size must be >= 1, got -3"),
])
@pytest.mark.slow
def test_end_to_end_one_line_errors(tmp_path, script, argv, expected):
    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    binary = tmp_path / "data.jsonl"
    binary.write_bytes(b"\xff\xfe\x00\x81")
    argv = [str(binary) if a == "BINARY" else a for a in argv]
    result = run_script(script, *argv, "--output_dir", str(tmp_path / "run"))
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error:") and expected in lines[-1], lines
    if "BINARY" in argv or script == "sft.py" and "--sft_data" in argv:
        assert str(binary) in lines[-1]
    assert not (tmp_path / "run").exists()  # nothing written before the error
