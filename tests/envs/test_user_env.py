"""A user's own environment, end to end: the guides' code (docs/environments.md, docs/warm-start.md) and the README's runs as written, ``--env_name`` finds envs by import
path and entry point, bad envs stop before the model loads, and equal rewards do not move the policy."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import marft.envs
from marft.cli.train import main
from marft.envs import StepOutcome
from marft.envs.relay_sum.env import RelaySumEnv

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.usefixtures("one_thread")


GUIDE = ROOT / "docs" / "environments.md"
WARM_START = ROOT / "docs" / "warm-start.md"
"""The warm start guide: it trains the environment guide's env, and its ParityDigitEnv subclasses it."""
TURN_BY_TURN = ROOT / "docs" / "workflows.md"
"""The workflows page, whose "Driving an env turn by turn" block drives a graph team by hand."""


def python_blocks(page: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", page.read_text(), flags=re.S | re.M)


def readme_python_blocks() -> list[str]:
    """The ```python blocks of the environment guide (docs/environments.md), in order."""
    return python_blocks(GUIDE)


def small_run(model_dir, output_dir, *extra) -> list[str]:
    return ["--model_name_or_path", model_dir, "--max_new_tokens", "6", "--context_window", "128", "--n_rollout_threads", "2",
            "--episode_length", "1", "--num_env_steps", "4", "--eval_episodes", "2", "--n_eval_threads", "2",
            "--output_dir", str(output_dir), *extra]


def test_the_readme_python_code_runs_as_written(tmp_path, monkeypatch, clean_registry):
    """Every ```python block of the environment guide, in order, in one namespace (as a reader would paste them), then
    the warm start guide's (its ParityDigitEnv builds on the guide's env) and the workflows page's turn-by-turn block."""
    monkeypatch.chdir(tmp_path)  # the API example writes its run directory under results/
    blocks = readme_python_blocks()
    assert len(blocks) >= 3 and any("class AgreeDigitEnv" in b for b in blocks)
    later = [(page, block) for page in (WARM_START, TURN_BY_TURN) for block in python_blocks(page)]
    assert any("class ParityDigitEnv" in b for _, b in later) and any("graph_env.take_turn" in b for _, b in later)
    namespace: dict = {"__name__": "readme"}
    for page, block in [(GUIDE, b) for b in blocks] + later:
        exec(compile(block, str(page), "exec"), namespace)  # noqa: S102 - the guides' own code
    assert namespace["rewards"].tolist() == [1.0, 1.0] and namespace["info"]["correct"]
    assert namespace["returns"] == {"Agent 1": 1.0, "Agent 2": 1.0}  # through PettingZoo's API
    assert Path(namespace["summary"]["run_dir"], "summary.json").is_file()
    assert namespace["ParityDigitEnv"](split="test").num_tasks == 40
    assert len(namespace["step_rewards"]) == 3  # the graph team: two solvers and the verifier


@pytest.fixture
def user_package(tmp_path, monkeypatch):
    """The guide's environment saved as ``my_envs/agree.py`` in a folder on ``sys.path`` (as PYTHONPATH=. does)."""
    package = tmp_path / "userland" / "my_envs"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "agree.py").write_text(next(b for b in readme_python_blocks() if "class AgreeDigitEnv" in b))
    monkeypatch.syspath_prepend(str(package.parent))
    yield package.parent
    for name in [m for m in sys.modules if m.startswith("my_envs")]:
        del sys.modules[name]


def test_env_name_takes_an_import_path(random_model_dir, tmp_path, user_package):
    run = tmp_path / "run"
    assert main(small_run(random_model_dir, run, "--env_name", "my_envs.agree:AgreeDigitEnv")) == 0
    assert json.loads((run / "summary.json").read_text())["iterations"] == 2


def test_the_readme_environment_trains_by_its_import_path(random_model_dir, tmp_path, monkeypatch):
    """The README's short env, saved as ``my_envs/same.py`` as the README says, passes gymnasium's checker,
    judges as its docstring says, and trains through ``--env_name my_envs.same:SameWordEnv``."""
    import warnings

    from gymnasium.utils.env_checker import check_env

    [block] = python_blocks(ROOT / "README.md")
    package = tmp_path / "userland" / "my_envs"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "same.py").write_text(block)
    monkeypatch.syspath_prepend(str(package.parent))
    try:
        from my_envs.same import SameWordEnv

        env = SameWordEnv()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "reward is not a float": one reward per agent, on purpose
            check_env(env)
        env.reset(seed=0)
        assert env.step(("apple", " apple "))[1].tolist() == [1.0, 1.0]
        env.reset(seed=0)
        assert env.step(("apple", "pear"))[1].tolist() == [0.0, 0.0]
        run = tmp_path / "run"
        assert main(small_run(random_model_dir, run, "--env_name", "my_envs.same:SameWordEnv")) == 0
        assert json.loads((run / "summary.json").read_text())["iterations"] == 2
    finally:
        for name in [m for m in sys.modules if m.startswith("my_envs")]:
            del sys.modules[name]


def test_env_name_finds_an_installed_packages_entry_point(tmp_path, user_package, monkeypatch):
    """A package that declares ``[project.entry-points."marft.envs"]`` is found by its name once installed."""
    dist = user_package / "my_envs-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-envs\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[marft.envs]\nagree_digit = my_envs.agree:AgreeDigitEnv\n")
    env = marft.envs.make("agree_digit", split="test")
    assert type(env).__name__ == "AgreeDigitEnv" and env.roles == ("Agent 1", "Agent 2")


def fail_on_model_load(monkeypatch):
    import marft.models.loading

    def refuse(config):
        raise AssertionError("the model was loaded before the bad input was reported")

    monkeypatch.setattr(marft.models.loading, "load_base_model", refuse)


def test_an_unknown_env_name_is_one_line_before_the_model_loads(tmp_path, monkeypatch, capsys):
    fail_on_model_load(monkeypatch)
    assert main(["--env_name", "agree_wrd", "--output_dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "unknown environment 'agree_wrd'" in err
    assert "math" in err and "relay_sum" in err and "my_package.my_module:MyEnv" in err
    assert main(["--env_name", "no_such_module:Env", "--output_dir", str(tmp_path / "run")]) == 2
    assert "cannot import" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


class WrongRewardCount(RelaySumEnv):
    def evaluate(self, state, actions):
        return StepOutcome(rewards=(1.0,), solved=True, info={"correct": True})


class BrokenReset(RelaySumEnv):
    def sample_task(self, options):
        raise KeyError("task_table")


@pytest.mark.parametrize("env_class,message", [(WrongRewardCount, "returned 1 rewards for 2 agents"), (BrokenReset, "KeyError")])
def test_an_env_that_fails_its_first_step_stops_before_the_model_loads(tmp_path, monkeypatch, capsys, clean_registry, env_class, message):
    fail_on_model_load(monkeypatch)
    marft.envs.register("broken", env_class)
    assert main(["--env_name", "broken", "--output_dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert message in err and "--env_name broken" in err
    assert not (tmp_path / "run").exists()  # no half-made run folder


# ---------------------------------------------------------------------- equal rewards: no drift
class ConstantReward(RelaySumEnv):
    """Every reply earns the same reward: the rollout says nothing about which replies are better."""

    reward = 0.0

    def evaluate(self, state, actions):
        return StepOutcome(rewards=(self.reward,) * self.n_agents, solved=True, info={"correct": False})


@pytest.mark.parametrize("reward", [0.0, 1.0])
@pytest.mark.parametrize("algorithm", ["APPO", "TPPO"])
def test_equal_rewards_leave_the_policy_where_it_was(random_model_dir, tmp_path, monkeypatch, clean_registry, reward, algorithm):
    """Constant rewards for 6 iterations: the agents' adapters stay exactly at their start (KL to the starting
    policy 0; before, critic noise blown up by advantage normalisation moved them by a KL of 0.3-1.4 in 40
    iterations), the critic still learns, and the skipped batches are counted."""
    monkeypatch.setattr(ConstantReward, "reward", reward)
    marft.envs.register("constant_reward", ConstantReward)
    run = tmp_path / "run"
    assert main(small_run(random_model_dir, run, "--env_name", "constant_reward", "--algorithm_name", algorithm,
                          "--num_env_steps", "12")) == 0
    checkpoint = run / "checkpoints" / "steps_6"
    for agent in ("reasoner", "actor"):
        weights = load_file(checkpoint / agent / "adapter_model.safetensors")
        assert all(torch.count_nonzero(w) == 0 for name, w in weights.items() if "lora_B" in name), agent  # B starts at 0
    critic = load_file(checkpoint / "critic" / "adapter_model.safetensors")
    assert any(torch.count_nonzero(w) > 0 for name, w in critic.items() if "lora_B" in name)
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["counters"]["constant_reward_batches"] == 6


# ---------------------------------------------------------------------- supervised warm start
def test_transcript_turns_are_prompted_exactly_as_the_team_prompts_them(random_model_dir, tmp_path):
    """Each agent turn of a transcript becomes (the team's own prompt at that moment, reply + EOS): private
    observations, earlier replies of the step and judge lines included; malformed lines are skipped and counted."""
    from test_team import make_team

    from marft.sft import load_transcripts, turn_examples

    team = make_team(random_model_dir, context_window=256, max_new_tokens=16)
    good = {"problem": "What is x + 50?", "private": {"Reasoner": "x = 7"},
            "turns": [{"role": "Reasoner", "text": "7 + 50 = 57"}, {"role": "Actor", "text": "\\boxed{56}"},
                      {"role": "Judge", "text": "Try again."},
                      {"role": "Reasoner", "text": "x is 7"}, {"role": "Actor", "text": "\\boxed{57}"}]}
    path = tmp_path / "t.jsonl"
    bad_heads = {**good, "kept_heads": {"Reasoner": 7}}
    path.write_text(json.dumps(good) + "\n{not json\n" + json.dumps({"problem": "p", "turns": []}) + "\n" + json.dumps(bad_heads) + "\n")
    transcripts, skipped = load_transcripts(path)
    assert len(transcripts) == 1 and skipped == 3
    examples = turn_examples(team.prompts, transcripts, eos_id=team.eos_id, max_reply_tokens=16)
    assert [e.agent for e in examples] == [0, 1, 0, 1]
    step2 = "Problem: What is x + 50?\nReasoner: 7 + 50 = 57\nActor: \\boxed{56}\nJudge: Try again.\n"
    ids, mask = team.encode_prompts(1, [step2], [[("Reasoner", "x is 7")]], [""])
    assert examples[3].prompt_ids == ids[0][mask[0].bool()].tolist()
    ids, mask = team.encode_prompts(0, [step2], [[]], ["x = 7"])
    assert examples[2].prompt_ids == ids[0][mask[0].bool()].tolist()
    assert examples[3].reply_ids == team.tokenizer(" \\boxed{57}", add_special_tokens=False).input_ids + [team.eos_id]
    with pytest.raises(ValueError, match="Planner"):
        turn_examples(team.prompts, [{"problem": "p", "turns": [{"role": "Planner", "text": "x"}]}], eos_id=team.eos_id)


def test_warm_start_moves_only_the_agents_adapters_and_lowers_the_reply_loss(random_model_dir):
    from test_team import make_team

    from marft.sft import SFTConfig, TurnExample, reply_nll, warm_start

    torch.manual_seed(0)

    team = make_team(random_model_dir, context_window=256, max_new_tokens=16)
    before = {n: p.detach().clone() for n, p in team.model.named_parameters()}
    examples = [TurnExample(a, team.encode_prompts(a, ["Problem: What is 3 + 4?\n"], [[]])[0][0].tolist(),
                            team.tokenizer(" \\boxed{7}", add_special_tokens=False).input_ids + [team.eos_id]) for a in (0, 1)]
    with torch.no_grad():
        start = [float(reply_nll(team, team.agent_adapters[e.agent], [e])) for e in examples]
    losses = warm_start(team, examples, SFTConfig(sft_steps=40, sft_batch_size=4, sft_lr=1e-2))
    with torch.no_grad():
        end = [float(reply_nll(team, team.agent_adapters[e.agent], [e])) for e in examples]
    assert all(b < a - 0.8 for a, b in zip(start, end)) and losses[-1] < losses[0], (start, end)  # nats per token (a random model plateaus near 5.2)
    moved = {n.split("lora_")[1].split(".")[1] if "lora_" in n else "base" for n, p in team.model.named_parameters() if not torch.equal(p, before[n])}
    assert moved == {"reasoner", "actor"}


def test_the_training_reply_loss_is_the_token_weighted_mean_over_an_even_spread_of_turns(random_model_dir):
    """Against a plain reference: every chosen turn scored alone, its tokens' losses summed, divided by their count."""
    from test_team import make_team

    from marft.sft import TurnExample, reply_nll, training_reply_loss

    team = make_team(random_model_dir, context_window=256, max_new_tokens=16)
    replies = [" \\boxed{7}", " 7", " the answer is 7", " \\boxed{12}", " 3 + 4 = 7"]
    examples = [TurnExample(k % 2, team.encode_prompts(k % 2, [f"Problem: What is {k} + 4?\n"], [[]])[0][0].tolist(),
                            team.tokenizer(replies[k % 5], add_special_tokens=False).input_ids + [team.eos_id]) for k in range(10)]

    def reference(chosen):
        with torch.no_grad():
            nll = [float(reply_nll(team, team.agent_adapters[e.agent], [e])) * len(e.reply_ids) for e in chosen]
        return sum(nll) / sum(len(e.reply_ids) for e in chosen)

    assert training_reply_loss(team, examples, batch_size=3) == pytest.approx(reference(examples), rel=1e-5)
    assert training_reply_loss(team, examples, most=4) == pytest.approx(reference(examples[::3]), rel=1e-5)  # 4 of 10: every third
    assert training_reply_loss(team, examples, most=5) == pytest.approx(reference(examples[::2]), rel=1e-5)
    with pytest.raises(ValueError, match="no transcript turn"):
        training_reply_loss(team, [])


@pytest.mark.slow
def test_a_new_format_is_learned_through_sft_then_rl_from_the_command_line(tmp_path, user_package):
    """The guide's walkthrough, shortened: the embedded model never writes ``{d}``; the warm start on the env's
    demonstrations teaches the format (agreement at chance), RL then finds a convention on held-out rounds."""
    from marft.cli.sft import main as sft_main

    common = ["--env_name", "my_envs.agree:AgreeDigitEnv", "--profile_path", "reasoner_actor_anonymous",
              "--n_rollout_threads", "32", "--episode_length", "1", "--eval_episodes", "100"]
    sft, rl = tmp_path / "sft", tmp_path / "rl"
    assert sft_main([*common, "--sft_steps", "120", "--output_dir", str(sft)]) == 0
    warm = json.loads((sft / "sft_summary.json").read_text())
    assert warm["last_loss"] < warm["first_loss"] / 4 and warm["train_loss"] < warm["first_loss"] / 4
    assert main(["--load_path", str(sft / "checkpoints" / "steps_0"), "--num_env_steps", str(32 * 60), "--output_dir", str(rl)]) == 0
    summary = json.loads((rl / "summary.json").read_text())
    assert summary["accuracy_before"] <= 0.3 and summary["accuracy_after"] >= 0.7, summary


PARITY_SEEDS = (0, 1, 2)
"""Seeds of the guide's ParityDigitEnv recipe; at least ``PARITY_SEEDS_LEARNING`` of them must learn the condition."""
PARITY_SEEDS_LEARNING = 2
PARITY_TIMEOUT_S = 75 * 60
"""How long the three concurrent seeds may take in all, well above what they take on a slow 2-core machine: a hung
run fails the test instead of running into CI's time limit."""


def parity_recipe_commands(seed: int, folder: Path) -> list[list[str]]:
    """The guide's three commands for one seed, as a user types them: the format-only warm start, RL from it with 64
    episodes per iteration for 600 iterations, and the trained team on the training rounds (``marft eval --split train``)."""
    marft = [sys.executable, "-m", "marft"]
    sft, rl = folder / "sft", folder / "rl"
    return [
        [*marft, "sft", "--env_name", "my_envs.agree:ParityDigitEnv", "--profile_path", "reasoner_actor_anonymous", "--n_rollout_threads", "32",
         "--episode_length", "1", "--sft_steps", "200", "--output_dir", str(sft), "--seed", str(seed)],
        [sys.executable, str(ROOT / "scripts" / "train_math.py"), "--load_path", str(sft / "checkpoints" / "steps_0"), "--n_rollout_threads", "64",
         "--num_env_steps", "38400", "--output_dir", str(rl), "--seed", str(seed)],
        [*marft, "eval", "--load_path", str(rl), "--split", "train", "--output_dir", str(folder / "eval_train")],
    ]


def start_parity_seed(seed: int, folder: Path, user_package: Path) -> subprocess.Popen:
    """One seed's commands in a process of its own, one intra-op thread (the three seeds share the machine's cores)."""
    folder.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(user_package), str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    script = " && ".join(shlex.join(command) for command in parity_recipe_commands(seed, folder))
    with (folder / "log.txt").open("w") as log:  # the child keeps its own copy of the file
        return subprocess.Popen(["bash", "-c", script], env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=folder,
                                start_new_session=True)  # its own process group: a timeout stops the commands, not only bash


@pytest.mark.slow
def test_a_condition_in_the_prompt_is_learned_with_the_documented_recipe(tmp_path, user_package):
    """The guide's ParityDigitEnv (the round asks for an even or an odd digit; a team that ignores the condition and
    agrees on one digit scores 0.5), trained exactly as the guide says: format-only demonstrations, then RL from the
    warm start with --n_rollout_threads 64 --num_env_steps 38400 (600 iterations of 64 episodes), ``--seed S`` on
    both. The team must read the condition: well above the 0.5 of a team that ignores it, on the training rounds and
    on the held-out ones (issue 29: it stalled at 0.5 when the recipe stopped at 6400 steps, without the KL, or, on
    some random streams, with 32 episodes per iteration). How long the plateau lasts is a draw with a long tail, and
    each CPU's rounding draws its own, so the check asks it of two of three seeds. The seeds run at once, each in a
    process with one thread, so the test costs about one seed's time per core rather than three."""
    agree = next(b for b in readme_python_blocks() if "class AgreeDigitEnv" in b)
    parity = next(b for b in python_blocks(WARM_START) if "class ParityDigitEnv" in b)
    (user_package / "my_envs" / "agree.py").write_text(agree + "\n\n" + parity)
    runs = {seed: start_parity_seed(seed, tmp_path / f"parity_{seed}", user_package) for seed in PARITY_SEEDS}
    deadline = time.monotonic() + PARITY_TIMEOUT_S
    try:
        for seed, run in runs.items():
            returncode = run.wait(timeout=max(1.0, deadline - time.monotonic()))
            log = (tmp_path / f"parity_{seed}" / "log.txt").read_text()
            assert returncode == 0, f"seed {seed}'s commands failed ({returncode}):\n{log[-3000:]}"
    except subprocess.TimeoutExpired:
        pytest.fail(f"the recipe's seeds did not finish within {PARITY_TIMEOUT_S} s")
    finally:
        for run in runs.values():
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
            run.wait()
    results = {}
    for seed in PARITY_SEEDS:
        folder = tmp_path / f"parity_{seed}"
        summary = json.loads((folder / "rl" / "summary.json").read_text())
        assert summary["accuracy_before"] <= 0.2, summary  # the warm start teaches the format only
        trained = json.loads((folder / "eval_train" / "summary.json").read_text())
        results[seed] = (summary["accuracy_after"], trained["accuracy"])
    learned = [seed for seed, (held_out, train) in results.items() if held_out >= 0.7 and train >= 0.8]
    assert len(learned) >= PARITY_SEEDS_LEARNING, (
        f"fewer than {PARITY_SEEDS_LEARNING} of seeds {PARITY_SEEDS} learned the condition "
        f"(held-out >= 0.7 and training rounds >= 0.8; held-out, training by seed): {results}")
