"""Runs stopped from outside: SIGTERM/SIGINT at any point of an iteration (rollout, update, a save, an
evaluation) end in one checkpoint and exit code 75, and ``--load_path <run dir>`` continues exactly; a second
Ctrl-C exits at once (130); periodic saves by time change nothing but the saves; a full disk (ENOSPC/EDQUOT
injected into the writers, no real disk needed) or a broken log writer stops cleanly (74) with one line naming
the checkpoint, the free space and the last complete one, and no partial folder, or warns with
``--continue_on_save_error``.

The signals are sent by the run to itself from inside the phase under test (a patched function), so every
trial lands where it should; ``scripts/fault_trials.py`` sends them from outside at random moments.
Runs: a tiny random model on ``dense_relay_sum``, 2 envs, 2 team steps per iteration, horizon 3 (episodes cross
iterations, so env states and running returns matter), as in ``test_checkpoint.py``.
"""

import errno
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from test_checkpoint import weights

import marft.runner.shared.checkpoint as checkpoint_module
import marft.runner.shared.collector as collector_module
import marft.runner.shared.evaluation as evaluation_module
import marft.runner.shared.run_log as run_log_module
import marft.runner.shared.runner as runner_module
from marft.algorithms.appo_trainer import APPOTrainer
from marft.cli.train import main
from marft.distributed import SINGLE
from marft.faults import ExitCode
from marft.runner.shared.checkpoint import find_checkpoint
from marft.runner.shared.preemption import Preemption

ROOT = Path(__file__).resolve().parents[2]
E, T = 2, 2  # envs, team steps per iteration
ITERATIONS = 4

pytestmark = pytest.mark.usefixtures("one_thread")


def flags(model_dir, run_dir, *extra: str, iterations: int = ITERATIONS, env: str = "dense_relay_sum") -> list[str]:
    return [
        "--model_name_or_path", model_dir, "--env_name", env, "--horizon", "3",
        "--max_new_tokens", "6", "--context_window", "128", "--n_rollout_threads", str(E), "--episode_length", str(T),
        "--eval_episodes", "1", "--n_eval_threads", "1", "--num_env_steps", str(E * T * iterations),
        "--output_dir", str(run_dir), *extra,
    ]


@pytest.fixture(scope="module")
def reference(random_model_dir, tmp_path_factory):
    """The run in one go, no saves along the way (--save_every_minutes 0): the final checkpoint to match."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    run = tmp_path_factory.mktemp("reference") / "run"
    assert main(flags(random_model_dir, run, "--save_every_minutes", "0")) == 0
    yield run / "checkpoints" / f"steps_{ITERATIONS}"
    torch.set_num_threads(threads)


def assert_same_final_checkpoint(expected: Path, got: Path) -> None:
    want, have = weights(expected), weights(got)
    assert want.keys() == have.keys() and len(want) > 4
    for name in want:
        torch.testing.assert_close(have[name], want[name], rtol=0, atol=0, msg=name)  # bit for bit
    want_state = json.loads((expected / "trainer_state.json").read_text())
    have_state = json.loads((got / "trainer_state.json").read_text())
    for key in ("iteration", "env_steps", "next_agents", "counters", "episode_returns", "envs", "rng"):
        assert have_state[key] == want_state[key], key


def signal_at(monkeypatch, phase: str, call: int, signum: int = signal.SIGTERM) -> dict:
    """Send ``signum`` to this process during the ``call``-th (1-based) call of ``phase``'s function:
    ``rollout`` a training team step, ``eval`` an evaluation team step, ``update`` a trainer update (before it
    starts its epochs), ``save`` a checkpoint's value-head file (adapters written, the rest not)."""
    calls = {"n": 0, "sent": False}

    def fire():
        calls["n"] += 1
        if calls["n"] == call:
            os.kill(os.getpid(), signum)
            calls["sent"] = True

    if phase in ("rollout", "eval"):
        module = collector_module if phase == "rollout" else evaluation_module
        original = module.play_team_step

        def play(*args, **kwargs):
            fire()
            return original(*args, **kwargs)

        monkeypatch.setattr(module, "play_team_step", play)
    elif phase == "update":
        original = APPOTrainer.update

        def update(self, buffer, iteration):
            fire()
            return original(self, buffer, iteration)

        monkeypatch.setattr(APPOTrainer, "update", update)
    elif phase == "save":
        original = checkpoint_module.save_file

        def save_file(*args, **kwargs):
            fire()
            return original(*args, **kwargs)

        monkeypatch.setattr(checkpoint_module, "save_file", save_file)
    else:
        raise ValueError(phase)
    return calls


def expected_stop(phase: str, call: int, save_interval: int) -> int:
    """The iteration whose checkpoint a stop in ``call`` of ``phase`` leaves."""
    if phase == "rollout":  # abandoned at the next team step: the checkpoint the rollout started from; in its
        return call // T  # last team step, the iteration finishes (update included) and is the one saved
    if phase == "update":  # finished: the checkpoint after it
        return call
    if phase == "save":  # that save finishes, and is the one
        return call * save_interval
    return 0  # the evaluation before training: nothing trained yet


TRIALS = [("rollout", 1, signal.SIGTERM), ("rollout", 4, signal.SIGINT), ("update", 2, signal.SIGTERM),
          ("update", 3, signal.SIGINT), ("save", 1, signal.SIGTERM), ("eval", 1, signal.SIGINT)]
RANDOM_TRIALS = [(str(p), int(c), int(s)) for p, c, s in zip(
    np.random.default_rng(38).choice(["rollout", "update", "save"], 4),
    np.random.default_rng(39).integers(1, 4, 4),
    np.random.default_rng(40).choice([int(signal.SIGTERM), int(signal.SIGINT)], 4),
)]


@pytest.mark.parametrize("phase, call, signum", TRIALS + RANDOM_TRIALS)
def test_a_signal_saves_once_and_the_run_continues_exactly(random_model_dir, reference, tmp_path, monkeypatch, capfd,
                                                           phase, call, signum):
    run = tmp_path / "run"
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    calls = signal_at(monkeypatch, phase, call, signum)
    assert main(flags(random_model_dir, run, "--save_interval", "1", "--keep_checkpoints", "0")) == ExitCode.PREEMPTED
    assert calls["sent"]
    stopped_at = expected_stop(phase, call, 1)
    err = capfd.readouterr().err  # the notice is written to fd 2 by the signal handler
    name = signal.Signals(signum).name
    assert f"{name} received: finishing the current phase" in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"stopped: {name}: stopped after iteration {stopped_at} of {ITERATIONS}") and f"--load_path {run}" in last, last
    assert find_checkpoint(run) == run / "checkpoints" / f"steps_{stopped_at}"
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name != "best") == [f"steps_{i}" for i in range(0 if stopped_at == 0 else 1, stopped_at + 1)]
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == handlers  # put back after the run

    monkeypatch.undo()
    assert main(["--load_path", str(run)]) == 0
    assert_same_final_checkpoint(reference, run / "checkpoints" / f"steps_{ITERATIONS}")


def test_a_signal_without_periodic_saves_writes_the_one_checkpoint(random_model_dir, reference, tmp_path, monkeypatch):
    """No --save_interval, no time-based save yet: the stop itself writes the checkpoint (mid-rollout: rewound)."""
    run = tmp_path / "run"
    signal_at(monkeypatch, "rollout", 2 * T + 1)  # the first team step of iteration 3: abandoned at the second
    assert main(flags(random_model_dir, run)) == ExitCode.PREEMPTED
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name != "best") == ["steps_2"]
    monkeypatch.undo()
    assert main(["--load_path", str(run)]) == 0
    assert_same_final_checkpoint(reference, run / "checkpoints" / f"steps_{ITERATIONS}")


def test_periodic_saves_by_time_change_nothing_but_the_saves(random_model_dir, reference, tmp_path):
    """Saving after every iteration (a tiny --save_every_minutes) gives the same final checkpoint as no saves."""
    run = tmp_path / "run"
    assert main(flags(random_model_dir, run, "--save_every_minutes", "1e-9", "--keep_checkpoints", "0")) == 0
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name != "best") == [f"steps_{i}" for i in range(1, ITERATIONS + 1)]
    assert_same_final_checkpoint(reference, run / "checkpoints" / f"steps_{ITERATIONS}")


def test_the_save_clock(monkeypatch):
    """--save_every_minutes counts from the last save (or the start); --save_interval by iterations; both at once."""
    now = {"t": 0.0}
    monkeypatch.setattr("marft.runner.shared.preemption.time.monotonic", lambda: now["t"])
    preemption = Preemption(save_interval=3, save_every_minutes=10, dist=SINGLE)
    with preemption:
        decisions = []
        for iteration, minutes in enumerate([4, 8, 11, 12, 22, 23, 33], start=1):
            now["t"] = 60 * minutes
            decisions.append(preemption.after_iteration(iteration))
    saves = [i for i, (save, stop) in enumerate(decisions, start=1) if save]
    assert saves == [3, 5, 6, 7], saves  # 3, 6: the interval; 5: 11 minutes after 3's save; 7: 10 after 6's
    assert not any(stop for _, stop in decisions)


def test_the_save_clock_by_time_alone(monkeypatch):
    now = {"t": 0.0}
    monkeypatch.setattr("marft.runner.shared.preemption.time.monotonic", lambda: now["t"])
    preemption = Preemption(save_interval=0, save_every_minutes=10, dist=SINGLE)
    with preemption:
        saves = []
        for iteration, minutes in enumerate([4, 9.9, 10, 15, 19.9, 20, 31], start=1):
            now["t"] = 60 * minutes
            if preemption.after_iteration(iteration)[0]:
                saves.append(iteration)
    assert saves == [3, 6, 7]  # at 10 (10 since the start), 20 (10 since 10), 31 (11 since 20)


def test_keep_checkpoints_by_default_keeps_two_and_never_the_only_one(random_model_dir, tmp_path):
    run = tmp_path / "run"
    assert main(flags(random_model_dir, run, "--save_interval", "1", iterations=3)) == 0
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name != "best") == ["steps_2", "steps_3"]
    from marft.runner.shared.checkpoint import prune_checkpoints

    assert prune_checkpoints(run / "checkpoints", 1) == [run / "checkpoints" / "steps_2"]
    assert prune_checkpoints(run / "checkpoints", 1) == []  # the only complete checkpoint stays
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name != "best") == ["steps_3"]


# ---------------------------------------------------------------------- a second Ctrl-C, and signals from outside
CHILD = textwrap.dedent(
    """
    import os, signal, sys, time
    import marft.runner.shared.collector as collector_module
    from marft.cli.train import main

    mode, argv = sys.argv[1], sys.argv[2:]
    original = collector_module.play_team_step
    calls = {"n": 0}

    def play(*args, **kwargs):
        if "with_values" in kwargs:
            calls["n"] += 1
            if calls["n"] == 3:
                os.kill(os.getpid(), signal.SIGINT)
                if mode == "twice":
                    time.sleep(1.2)
                    os.kill(os.getpid(), signal.SIGINT)
                    time.sleep(5)
        return original(*args, **kwargs)

    collector_module.play_team_step = play
    sys.exit(main(argv))
    """
)


def run_child(tmp_path, mode: str, argv: list[str]) -> subprocess.CompletedProcess:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(script), mode, *argv], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_second_ctrl_c_exits_at_once(random_model_dir, tmp_path):
    run = tmp_path / "run"
    result = run_child(tmp_path, "twice", flags(random_model_dir, run, "--save_interval", "1", env="relay_sum"))
    assert result.returncode == ExitCode.INTERRUPTED, result.stderr[-2000:]
    assert "second SIGINT: exiting at once without saving" in result.stderr and "Traceback" not in result.stderr
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name != "best") == ["steps_1"]  # the one before: intact
    assert find_checkpoint(run) == run / "checkpoints" / "steps_1"


@pytest.mark.slow
def test_ctrl_c_forwarded_within_a_second_counts_once(random_model_dir, tmp_path):
    """One Ctrl-C in a subprocess: exit code 75, one line on stderr after the notice, no traceback."""
    run = tmp_path / "run"
    result = run_child(tmp_path, "once", flags(random_model_dir, run, env="relay_sum"))
    assert result.returncode == ExitCode.PREEMPTED, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("stopped: SIGINT: stopped after iteration 1 of 4")
    assert find_checkpoint(run) == run / "checkpoints" / "steps_1"


# ---------------------------------------------------------------------- a full disk
def error_lines(capsys) -> list[str]:
    """The ``error:`` lines on stderr (the model loader's progress bars aside); no traceback anywhere."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    return [line for line in err.splitlines() if line.startswith("error:")]


def no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def torch_full_disk(obj, f, *args, **kwargs):
    Path(f).write_bytes(b"\x00" * 100)  # part of the file, as a full disk leaves it
    raise RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 64 vs 0 (basic_ios::clear: iostream error)")


def quota_exceeded(self, *args, **kwargs):
    raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))


def fail_the_second_save(monkeypatch, how: str) -> None:
    """Inject a write error into the second checkpoint's writer."""
    saves = {"n": 0}
    original_save = checkpoint_module.save_checkpoint

    def counting(*args, **kwargs):
        saves["n"] += 1
        return original_save(*args, **kwargs)

    monkeypatch.setattr(runner_module, "save_checkpoint", counting)

    def second(fail, original):
        def write(*args, **kwargs):
            return fail(*args, **kwargs) if saves["n"] == 2 else original(*args, **kwargs)
        return write

    if how == "ENOSPC in safetensors":
        monkeypatch.setattr(checkpoint_module, "save_file", second(no_space, checkpoint_module.save_file))
    elif how == "torch.save on a full disk":
        monkeypatch.setattr(checkpoint_module.torch, "save", second(torch_full_disk, torch.save))
    else:  # EDQUOT writing the trainer state
        original_write_text = Path.write_text

        def write_text(self, *args, **kwargs):
            if self.name == "trainer_state.json" and saves["n"] == 2:
                return quota_exceeded(self)
            return original_write_text(self, *args, **kwargs)

        monkeypatch.setattr(Path, "write_text", write_text)


FULL_DISK = ["ENOSPC in safetensors", "torch.save on a full disk", "EDQUOT writing the trainer state"]


@pytest.mark.parametrize("how", FULL_DISK)
def test_a_full_disk_stops_cleanly_naming_the_checkpoint_the_space_and_the_last_one(random_model_dir, tmp_path, monkeypatch, capsys, how):
    run = tmp_path / "run"
    fail_the_second_save(monkeypatch, how)
    assert main(flags(random_model_dir, run, "--save_interval", "1", iterations=3)) == ExitCode.SAVE_FAILED
    err = error_lines(capsys)
    assert len(err) == 1, err
    line = err[0]
    assert line.startswith("error: could not write checkpoint steps_2 (") and " free there" in line, line
    assert f"the last complete checkpoint is {run / 'checkpoints' / 'steps_1'}" in line and f"--load_path {run}" in line, line
    assert {"ENOSPC in safetensors": "No space left on device", "torch.save on a full disk": "usually a full disk",
            "EDQUOT writing the trainer state": "Disk quota exceeded"}[how] in line, line
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name != "best") == ["steps_1"]  # no partial folder
    monkeypatch.undo()
    assert main(["--load_path", str(run)]) == 0  # space is back: continue
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name != "best") == ["steps_2", "steps_3"]


def test_continue_on_save_error_warns_and_trains_on(random_model_dir, tmp_path, monkeypatch, caplog):
    run = tmp_path / "run"
    fail_the_second_save(monkeypatch, FULL_DISK[0])
    with caplog.at_level(logging.WARNING):
        assert main(flags(random_model_dir, run, "--save_interval", "1", "--continue_on_save_error", iterations=3)) == 0
    assert "could not write checkpoint steps_2" in caplog.text and "training goes on (--continue_on_save_error)" in caplog.text
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name != "best") == ["steps_1", "steps_3"]


@pytest.mark.parametrize("continue_on_error", [False, True])
def test_a_full_disk_under_the_tensorboard_writer(random_model_dir, tmp_path, monkeypatch, capsys, caplog, continue_on_error):
    from torch.utils.tensorboard import SummaryWriter

    original = SummaryWriter.add_scalar

    def add_scalar(self, tag, value, step=None, *args, **kwargs):
        if step == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return original(self, tag, value, step, *args, **kwargs)

    monkeypatch.setattr(SummaryWriter, "add_scalar", add_scalar)
    run = tmp_path / "run"
    extra = ["--save_interval", "1"] + (["--continue_on_save_error"] if continue_on_error else [])
    with caplog.at_level(logging.WARNING):
        code = main(flags(random_model_dir, run, *extra, iterations=3))
    if continue_on_error:
        assert code == 0
        assert caplog.text.count(f"could not write TensorBoard logs in {run / 'logs'}") == 1  # once, then logging is off
        assert (run / "checkpoints" / "steps_3").is_dir()
    else:
        assert code == ExitCode.SAVE_FAILED
        err = error_lines(capsys)
        assert len(err) == 1 and err[0].startswith(f"error: could not write TensorBoard logs in {run / 'logs'}: OSError: [Errno 28]"), err
        assert " free there" in err[0] and f"--load_path {run}" in err[0]
        assert find_checkpoint(run) == run / "checkpoints" / "steps_1"


def test_a_full_disk_under_the_transcripts(random_model_dir, tmp_path, monkeypatch, capsys):
    def write_transcripts(path, episodes):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(run_log_module, "write_transcripts", write_transcripts)
    run = tmp_path / "run"
    assert main(flags(random_model_dir, run, iterations=1)) == ExitCode.SAVE_FAILED
    err = error_lines(capsys)
    assert len(err) == 1 and f"could not write {run / 'transcripts' / 'eval_0.jsonl'}" in err[0] and "No space left" in err[0], err


def test_low_free_space_warns_before_training(random_model_dir, tmp_path, monkeypatch, caplog):
    from marft.runner.shared import storage

    monkeypatch.setattr(storage, "free_bytes", lambda path: 10_000)
    with caplog.at_level(logging.WARNING):
        assert main(flags(random_model_dir, tmp_path / "run", "--save_every_minutes", "0", "--continue_on_save_error", iterations=1)) == 0
    assert "only 9.8 KB free on the disk of" in caplog.text and "one checkpoint takes about" in caplog.text


# ---------------------------------------------------------------------- several processes
@pytest.mark.slow
def test_sigterm_to_one_of_two_processes_stops_both_with_one_checkpoint(random_model_dir, tmp_path):
    """torchrun, 2 processes: SIGTERM to rank 1 alone (rank 0 never sees it) stops both at the same boundary, both
    save their part of one checkpoint and exit with 75; the run then continues from it with 2 processes."""
    from test_distributed import ENV, TORCHRUN, WORKER, ranks
    from test_distributed import E as DIST_E
    from test_distributed import flags as dist_flags
    from test_distributed import train as dist_train

    run, out = tmp_path / "run", tmp_path / "out"
    out.mkdir()
    child = subprocess.Popen(
        [*TORCHRUN, str(WORKER), "train", str(out), "--", *dist_flags(random_model_dir, 200, run, "--save_interval", "2", "--dist_timeout_s", "60")],
        env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not (run / "checkpoints" / "steps_2").is_dir():
            assert child.poll() is None, child.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the run never saved its first checkpoint"
            time.sleep(0.2)
        os.kill(int((out / "pid1").read_text()), signal.SIGTERM)
        child.wait(timeout=120)
    finally:
        child.kill()
        child.wait()
    first, second = ranks(out)
    assert first["code"] == second["code"] == ExitCode.PREEMPTED, (first, second)
    assert first["hash"] == second["hash"]
    checkpoint = find_checkpoint(run)
    stopped_at = int(checkpoint.name.split("_")[1])
    assert stopped_at >= 2 and json.loads((checkpoint / "trainer_state.json").read_text())["world_size"] == 2
    done = dist_train(tmp_path / "resumed", ["--load_path", str(run), "--num_env_steps", str(DIST_E * (stopped_at + 1))])
    assert done.returncode == 0, done.stderr[-3000:]
    first, second = ranks(tmp_path / "resumed")
    assert first["code"] == second["code"] == 0 and first["hash"] == second["hash"]


# ---------------------------------------------------------------------- the math grader's worker
def test_the_grading_worker_is_out_of_reach_of_ctrl_c_and_ends_quietly_when_the_trainer_dies():
    """A Ctrl-C goes to the terminal's whole process group: the worker has its own session, so it keeps grading
    while the trainer finishes its phase. A trainer killed while the worker answers leaves no traceback."""
    from marft.envs.math.grader import MathGrader, default_worker_command

    grader = MathGrader()
    try:
        worker = grader._ensure_worker()
        assert os.getsid(worker.pid) != os.getsid(0)
    finally:
        grader.close()

    worker = subprocess.Popen(default_worker_command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert worker.stdout.readline().strip() == b'"ready"'
    worker.stdout.close()  # the trainer is gone: nobody reads the answers
    worker.stdin.write(json.dumps({"pairs": [["\\boxed{1}", "1"]] * 2000}).encode() + b"\n")
    worker.stdin.close()
    worker.wait(timeout=60)
    err = worker.stderr.read().decode()
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
