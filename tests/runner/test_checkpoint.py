"""Checkpoints: exact resume, atomic saves (even under ``kill -9``), safe and verified loading.

Every run here goes through ``marft.cli.train.main`` on a tiny random model, 2 envs, 1 team step per
iteration and a horizon of 3, so episodes run across iteration boundaries and the saved episode
states and running returns matter. The env is ``relay_sum`` with a dense reward (a random model
never solves the task, and all-zero rewards would hide a lost episode return).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from marft.algorithms import TRAINERS
from marft.cli.train import main
from marft.faults import CheckpointError
from marft.runner.shared.checkpoint import find_checkpoint, load_checkpoint, save_checkpoint

ROOT = Path(__file__).resolve().parents[2]
E = 2  # n_rollout_threads; one team step per iteration, so num_env_steps = E * iterations
N = 2  # iterations before the stop


pytestmark = pytest.mark.usefixtures("one_thread")


def flags(model_dir, iterations: int, output_dir=None, *extra: str, env: str = "dense_relay_sum") -> list[str]:
    argv = [
        "--model_name_or_path", model_dir, "--env_name", env, "--horizon", "3",
        "--max_new_tokens", "6", "--context_window", "128", "--n_rollout_threads", str(E), "--episode_length", "1",
        "--eval_episodes", "1", "--n_eval_threads", "1", "--num_env_steps", str(E * iterations), *extra,
    ]
    return argv + (["--output_dir", str(output_dir)] if output_dir else [])


def weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every adapter's weights and the value head of a checkpoint, by ``<file>/<tensor>``."""
    out = {}
    for file in sorted(checkpoint.rglob("*.safetensors")):
        for name, tensor in load_file(file).items():
            out[f"{file.relative_to(checkpoint)}/{name}"] = tensor
    return out


def scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    """TensorBoard scalars of a run, ``{tag: {step: value}}`` (a later event at a step wins)."""
    events = EventAccumulator(str(run_dir / "logs"), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


TIMING = ("seconds", "per_s")


# ---------------------------------------------------------------------- exact resume
@pytest.mark.parametrize("interval", [0, 1])
@pytest.mark.parametrize("algorithm", sorted(TRAINERS))
def test_resume_is_exact(random_model_dir, tmp_path, algorithm, interval):
    """2N iterations in one go == N iterations, stop, resume (from the run directory) for N more."""
    extra = ("--algorithm_name", algorithm, "--agent_iteration_interval", str(interval * E))  # env steps: every `interval` iterations
    if algorithm == "GRPO":  # one group of both envs; whole episodes per iteration (one step each)
        extra += ("--group_size", str(E), "--horizon", "1")
    check_resume_is_exact(random_model_dir, tmp_path, extra)


@pytest.mark.parametrize("algorithm", ["APPO", "TPPO"])
def test_resume_is_exact_with_per_agent_critics_and_a_reference_kl(random_model_dir, tmp_path, algorithm):
    check_resume_is_exact(random_model_dir, tmp_path, ("--algorithm_name", algorithm, "--critic_mode", "per_agent", "--kl_coef", "0.1"))


def check_resume_is_exact(random_model_dir, tmp_path, extra):
    """The stopped run is a run of N iterations extended to 2N: constant learning rates, so that its first N steps
    are those of the 2N run (a linear decay over N would end at 0; tests/algorithms/test_lr_schedule.py resumes one mid-decay)."""
    extra = (*extra, "--lr_schedule", "constant")
    one_go, stopped = tmp_path / "one_go", tmp_path / "stopped"
    assert main(flags(random_model_dir, 2 * N, one_go, *extra)) == 0
    assert main(flags(random_model_dir, N, stopped, *extra)) == 0
    assert main(["--load_path", str(stopped), "--num_env_steps", str(E * 2 * N)]) == 0

    expected, resumed = weights(one_go / "checkpoints" / f"steps_{2 * N}"), weights(stopped / "checkpoints" / f"steps_{2 * N}")
    assert expected.keys() == resumed.keys() and len(expected) > 4
    for name in expected:
        torch.testing.assert_close(resumed[name], expected[name], rtol=0, atol=1e-6, msg=name)
    halfway = weights(stopped / "checkpoints" / f"steps_{N}")
    assert any(not torch.equal(halfway[k], resumed[k]) for k in halfway if "critic" not in k), "the agents did not train after resuming"

    expected_state = json.loads((one_go / "checkpoints" / f"steps_{2 * N}" / "trainer_state.json").read_text())
    resumed_state = json.loads((stopped / "checkpoints" / f"steps_{2 * N}" / "trainer_state.json").read_text())
    for key in ("iteration", "env_steps", "next_agents", "counters", "episode_returns", "envs", "rng"):
        assert resumed_state[key] == expected_state[key], key

    logged, relogged = scalars(one_go), scalars(stopped)
    assert any(v != 0 for v in logged["charts/episode_return"].values())
    compared = 0
    for tag, points in logged.items():
        if any(t in tag for t in TIMING):
            continue
        for step, value in points.items():
            assert relogged[tag][step] == pytest.approx(value, abs=1e-6, nan_ok=True), (tag, step)
            compared += 1
    assert compared >= 2 * N * 5


@pytest.mark.slow
def test_resume_of_an_orchestrated_run_mid_episode_is_exact(random_model_dir, tmp_path, scripted_orchestrator):
    """Orchestrated steps of different lengths, episodes of 3 steps across the stop (the horizon): still exact."""
    check_resume_is_exact(random_model_dir, tmp_path, ("--env_name", "dense_route", "--profile_path", "route_orchestrated_anonymous",
                                                       "--context_window", "192"))


# ---------------------------------------------------------------------- resuming with another config
@pytest.fixture(scope="module")
def trained_run(random_model_dir, tmp_path_factory):
    """A run of N iterations saved every iteration (copy it before writing into it); torch's thread count is
    restored afterwards (the tests after this module run with the default)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    run = tmp_path_factory.mktemp("trained") / "run"
    assert main(flags(random_model_dir, N, run, "--save_interval", "1", "--lr", "2e-3")) == 0
    yield run
    torch.set_num_threads(threads)


def copy_run(run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run, tmp_path / "run"))


@pytest.mark.parametrize(
    "change, named",
    [
        (["--lora_r", "4"], "--lora_r"),
        (["--n_agents", "3", "--profile_path", "planner_solver_verifier"], "--n_agents"),
        (["--profile_path", "planner_solver"], "roles"),
        (["--model_name_or_path", "marft-tiny"], "--model_name_or_path"),
    ],
)
def test_flags_that_cannot_change_stop_with_a_clear_error(trained_run, tmp_path, capsys, change, named):
    run = copy_run(trained_run, tmp_path)
    assert main(["--load_path", str(run), "--num_env_steps", str(E * (N + 1)), *change]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: cannot resume") and named in err[0], err
    assert not (run / "checkpoints" / f"steps_{N + 1}").exists()


def test_flags_that_may_change_are_taken_and_logged(trained_run, tmp_path, caplog):
    run = copy_run(trained_run, tmp_path)
    caplog.set_level("INFO")
    assert main(["--load_path", str(run / "checkpoints" / f"steps_{N}"), "--num_env_steps", str(E * (N + 1)), "--lr", "5e-4", "--save_interval", "0"]) == 0
    assert "resuming with --lr changed: 0.002 in the checkpoint, 0.0005 now" in caplog.text
    assert "resuming with --num_env_steps changed" in caplog.text and "--save_interval changed" in caplog.text
    config = json.loads((run / "config.json").read_text())  # the run directory of the checkpoint is reused
    assert config["algo"]["lr"] == 5e-4 and config["model"]["max_new_tokens"] == 6  # not given: from the checkpoint
    optimizers = torch.load(run / "checkpoints" / f"steps_{N + 1}" / "optimizers.pt", weights_only=True)
    rates = [g["lr"] for opt in optimizers["policy_optimizers"].values() for g in opt["param_groups"]]
    assert rates == pytest.approx([5e-4 * (1 - N / (N + 1))] * len(rates))  # the last iteration's rate of the linear decay


def test_a_checkpoint_from_before_chat_templates_resumes_with_plain_prompts(trained_run, tmp_path):
    """A checkpoint whose config has no ``chat_template`` was trained on plain transcripts: it resumes with
    ``none`` (an instruct model would otherwise switch to its chat template mid-run), unless the flag is given."""
    from marft.config import parse_config
    from marft.runner.shared.checkpoint import MANIFEST, _write_manifest, resume_config

    checkpoint = copy_run(trained_run, tmp_path) / "checkpoints" / f"steps_{N}"
    assert resume_config(*parse_config(["--load_path", str(checkpoint)])).model.chat_template == "auto"  # saved with the flag
    saved = json.loads((checkpoint / "config.json").read_text())
    del saved["model"]["chat_template"]
    (checkpoint / "config.json").write_text(json.dumps(saved))
    (checkpoint / MANIFEST).unlink()
    _write_manifest(checkpoint)
    assert resume_config(*parse_config(["--load_path", str(checkpoint)])).model.chat_template == "none"
    assert resume_config(*parse_config(["--load_path", str(checkpoint), "--chat_template", "auto"])).model.chat_template == "auto"


@pytest.mark.parametrize("field, saved_value, before, given", [("max_chunk_mib", None, 0, "512"), ("lr_schedule", "linear", "constant", "linear")])
def test_a_checkpoint_from_before_a_flag_resumes_as_it_ran(trained_run, tmp_path, field, saved_value, before, given):
    """A checkpoint whose config has no ``max_chunk_mib`` ran its update chunks with no budget (unless
    ``--max_chunk_tokens`` gave one), one without ``lr_schedule`` at constant learning rates: it resumes so, unless
    the flag is given; a new one keeps the default."""
    from marft.config import parse_config
    from marft.runner.shared.checkpoint import MANIFEST, _write_manifest, resume_config

    checkpoint = copy_run(trained_run, tmp_path) / "checkpoints" / f"steps_{N}"
    assert getattr(resume_config(*parse_config(["--load_path", str(checkpoint)])).algo, field) == saved_value  # saved with the flag
    saved = json.loads((checkpoint / "config.json").read_text())
    del saved["algo"][field]
    (checkpoint / "config.json").write_text(json.dumps(saved))
    (checkpoint / MANIFEST).unlink()
    _write_manifest(checkpoint)
    assert getattr(resume_config(*parse_config(["--load_path", str(checkpoint)])).algo, field) == before
    given_value = getattr(resume_config(*parse_config(["--load_path", str(checkpoint), f"--{field}", given])).algo, field)
    assert str(given_value) == given


def test_load_path_run_directory_takes_latest_complete_checkpoint(trained_run, tmp_path):
    run = copy_run(trained_run, tmp_path)
    checkpoints = run / "checkpoints"
    shutil.copytree(checkpoints / "steps_1", checkpoints / ".steps_7.tmp-999999999")  # a partial save of a dead process
    (checkpoints / "steps_9").mkdir()  # not a checkpoint: no trainer state
    assert find_checkpoint(run) == checkpoints / f"steps_{N}"
    assert find_checkpoint(checkpoints) == checkpoints / f"steps_{N}"
    assert find_checkpoint(checkpoints / "steps_1") == checkpoints / "steps_1"
    assert main(["--load_path", str(run), "--num_env_steps", str(E * (N + 1))]) == 0
    assert (checkpoints / f"steps_{N + 1}").is_dir()
    assert not (checkpoints / ".steps_7.tmp-999999999").exists(), "the partial checkpoint was not cleaned up"
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        find_checkpoint(tmp_path)


def test_a_resume_with_another_rollout_size_counts_the_schedule_in_env_steps(random_model_dir, tmp_path):
    """2 iterations of 2 envs (4 env steps), then a resume with 4 envs and --num_env_steps 12: 2 more iterations
    (8 env steps left at 4 a time), and the agent schedule (--agent_iteration_interval 4 env steps) goes on from the
    4 env steps collected: iteration 2 ends at 8 (agent 0), iteration 3 at 12 (agent 1). Before, both were counted
    as if every past iteration had had 4 envs: 3 iterations in all (12 // 4) and agent 1 at iteration 2 (issue 30)."""
    run = tmp_path / "run"
    assert main(flags(random_model_dir, 2, run, "--agent_iteration_interval", "4", "--save_interval", "1", "--keep_checkpoints", "0")) == 0
    assert main(["--load_path", str(run), "--n_rollout_threads", "4", "--num_env_steps", "12"]) == 0
    checkpoints = run / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir() if p.name != "best") == ["steps_1", "steps_2", "steps_3", "steps_4"]
    states = {i: json.loads((checkpoints / f"steps_{i}" / "trainer_state.json").read_text()) for i in (2, 3, 4)}
    assert [states[i]["env_steps"] for i in (2, 3, 4)] == [4, 8, 12]
    before, after = weights(checkpoints / "steps_2"), weights(checkpoints / "steps_3")
    moved = {name.split("/")[0] for name in before if not torch.equal(before[name], after[name])}
    assert moved == {"reasoner", "critic", "value_head.safetensors"}  # iteration 2 trained agent 0 alone (and the critic)
    assert states[3]["next_agents"] == [1]


def test_resuming_a_finished_run_says_nothing_is_left_to_train(trained_run, tmp_path, capsys):
    """A checkpoint at the last iteration with the same --num_env_steps: a clear error, not a run of 0 steps."""
    run = copy_run(trained_run, tmp_path)
    assert main(["--load_path", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nothing is left to train" in err[0] and f"--num_env_steps {E * (N + 1)}" in err[0], err
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name != "best") == [f"steps_{i}" for i in range(1, N + 1)]


def test_keep_checkpoints_keeps_the_newest(random_model_dir, tmp_path):
    run = tmp_path / "run"
    assert main(flags(random_model_dir, 3, run, "--save_interval", "1", "--keep_checkpoints", "2")) == 0
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name != "best") == ["steps_2", "steps_3"]


# ---------------------------------------------------------------------- kill -9 while saving
CHILD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import marft.runner.shared.checkpoint as checkpoint
    from marft.cli.train import main

    marker, argv = Path(sys.argv[1]), sys.argv[2:]
    write_value_head = checkpoint.save_file

    def stall_in_second_save(tensors, filename, *args, **kwargs):
        if ".steps_2.tmp-" in str(filename):  # adapters are written, the rest is not
            marker.write_text("saving")
            time.sleep(600)
        return write_value_head(tensors, filename, *args, **kwargs)

    checkpoint.save_file = stall_in_second_save
    sys.exit(main(argv))
    """
)


@pytest.mark.slow
def test_kill_9_during_save_keeps_the_previous_checkpoint(random_model_dir, tmp_path):
    run, marker, script = tmp_path / "run", tmp_path / "saving", tmp_path / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen(
        [sys.executable, str(script), str(marker), *flags(random_model_dir, 3, run, "--save_interval", "1", "--keep_checkpoints", "0", env="relay_sum")],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 240
        while not marker.exists():
            assert child.poll() is None, child.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the child never reached the second save"
            time.sleep(0.1)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    checkpoints = run / "checkpoints"
    partial = checkpoints / f".steps_2.tmp-{child.pid}"
    assert partial.is_dir() and any(partial.iterdir()), "the kill did not land mid-save"
    assert not (checkpoints / "steps_2").exists()
    assert find_checkpoint(run) == checkpoints / "steps_1"

    assert main(["--load_path", str(run)]) == 0  # continues from steps_1 in the same run directory
    assert not partial.exists(), "the partial checkpoint was not cleaned up"
    assert sorted(p.name for p in checkpoints.iterdir() if p.name != "best") == ["steps_1", "steps_2", "steps_3"]
    assert json.loads((run / "summary.json").read_text())["iterations"] == 3


# ---------------------------------------------------------------------- safe, verified loading
@pytest.fixture(scope="module")
def team_and_trainer(random_model_dir):
    from marft.agents.team import AgentTeam
    from marft.algorithms import make_trainer
    from marft.config import AlgoConfig, ModelConfig
    from marft.envs.profile import load_profile
    from marft.models.loading import load_base_model

    config = ModelConfig(model_name_or_path=random_model_dir, max_new_tokens=6, context_window=128)
    model, tokenizer = load_base_model(config)
    team = AgentTeam(model, tokenizer, load_profile(config.profile_path, n_agents=config.n_agents), config)
    return team, make_trainer(team, AlgoConfig(), steps_per_iteration=1)


def corrupt(file: Path, how: str) -> None:
    data = file.read_bytes()
    if how == "truncated":
        file.write_bytes(data[: len(data) // 2])
    else:  # one flipped byte in the middle
        middle = len(data) // 2
        file.write_bytes(data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1 :])


FILES = ["reasoner/adapter_model.safetensors", "critic/adapter_model.safetensors", "value_head.safetensors", "optimizers.pt", "trainer_state.json", "config.json"]


@pytest.mark.parametrize("with_manifest", [True, False])
@pytest.mark.parametrize("name", FILES)
def test_a_corrupted_file_gives_an_error_naming_it(trained_run, tmp_path, team_and_trainer, name, with_manifest):
    team, trainer = team_and_trainer
    checkpoint = Path(shutil.copytree(trained_run / "checkpoints" / "steps_1", tmp_path / "steps_1"))
    if not with_manifest:
        (checkpoint / "manifest.json").unlink()
    corrupt(checkpoint / name, "truncated")
    with pytest.raises(CheckpointError, match=str(checkpoint / name).replace(".", r"\.")):
        load_checkpoint(checkpoint, team, trainer)


def test_a_flipped_byte_is_caught_by_the_manifest(trained_run, tmp_path, team_and_trainer):
    team, trainer = team_and_trainer
    checkpoint = Path(shutil.copytree(trained_run / "checkpoints" / "steps_1", tmp_path / "steps_1"))
    corrupt(checkpoint / "actor" / "adapter_model.safetensors", "flipped")
    with pytest.raises(CheckpointError, match="actor/adapter_model.safetensors is corrupted"):
        load_checkpoint(checkpoint, team, trainer)


class Exploit:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_loading_never_unpickles_arbitrary_objects(trained_run, tmp_path, team_and_trainer, monkeypatch):
    team, trainer = team_and_trainer
    checkpoint = Path(shutil.copytree(trained_run / "checkpoints" / "steps_1", tmp_path / "steps_1"))
    (checkpoint / "manifest.json").unlink()
    torch.save({"policy_optimizers": Exploit()}, checkpoint / "optimizers.pt")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match="optimizers.pt"):
        load_checkpoint(checkpoint, team, trainer)
    assert not (tmp_path / "pwned").exists()


def test_a_checkpoint_is_never_written_with_nan_weights(team_and_trainer, tmp_path):
    team, trainer = team_and_trainer
    param = team.adapter_parameters(team.policy_adapters[0])[0]
    saved = param.detach().clone()
    with torch.no_grad():
        param[0, 0] = float("nan")
    try:
        with pytest.raises(CheckpointError, match="non-finite weights"):
            save_checkpoint(tmp_path / "checkpoints", 1, team, trainer, {"iteration": 1, "env_steps": 2}, "{}")
    finally:
        with torch.no_grad():
            param.copy_(saved)
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())


# ---------------------------------------------------------------------- env states
@pytest.mark.parametrize("name", ["math", "relay_sum"])
def test_env_state_round_trips_through_json(name):
    from marft.envs import make

    class WrongGrader:
        def grade(self, response, ground_truth):
            return False

    def build():
        return make(name, horizon=3, grader=WrongGrader()) if name == "math" else make(name, split="train", horizon=3)

    env = build()
    env.reset(seed=3)
    env.step(["1 + 2 = 3", "\\boxed{-1}"])  # wrong: the episode goes on with judge feedback
    state = json.loads(json.dumps(env.state_dict()))
    other = build()
    other.reset(seed=99)
    other.load_state_dict(state)
    assert other.episode == env.episode and type(other.episode) is type(env.episode)
    assert other.private_observations() == env.private_observations()
    assert np.array_equal(other.np_random.integers(1 << 30, size=8), env.np_random.integers(1 << 30, size=8))
    assert other.reset()[0] == env.reset()[0]
