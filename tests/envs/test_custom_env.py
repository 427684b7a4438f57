"""The specification's CustomEnv: the guide's env (docs/custom-env.md) runs and trains as written, its state is
checkpointed and continues exactly, a folder under marft/envs/ is found by its name, and a CustomEnv that breaks
the contract stops before the model loads."""

import json
import re
import sys
from pathlib import Path

import pytest

import marft.envs
from marft.cli.train import main
from marft.envs.base import CustomEnv, EpisodeState
from marft.runner.shared.checkpoint import read_trainer_state

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "custom-env.md"

pytestmark = pytest.mark.usefixtures("one_thread")


def guide_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", GUIDE.read_text(), flags=re.S | re.M)


@pytest.fixture
def guess_module(tmp_path, monkeypatch):
    """The guide's env saved as ``my_envs/guess.py`` in a folder on ``sys.path`` (as PYTHONPATH=. does)."""
    package = tmp_path / "userland" / "my_envs"
    package.mkdir(parents=True)
    (package / "guess.py").write_text(next(b for b in guide_blocks() if "class GuessDigitEnv" in b))
    monkeypatch.syspath_prepend(str(package.parent))
    yield package.parent
    for name in [m for m in sys.modules if m.startswith("my_envs")]:
        del sys.modules[name]


def test_the_guides_code_runs_as_written(guess_module, capsys):
    blocks = guide_blocks()
    assert len(blocks) == 2
    namespace: dict = {"__name__": "guide"}
    exec(compile(blocks[1], str(GUIDE), "exec"), namespace)  # noqa: S102 - the guide's own code
    env = namespace["env"]
    assert isinstance(env, CustomEnv) and not isinstance(env, marft.envs.MultiAgentTextEnv)
    digit = int(env.episode.answer)
    expected = "higher" if digit > 5 else "lower"
    if digit == 5:
        assert namespace["terminated"] and namespace["rewards"].tolist() == [1.0, 1.0]
    else:
        assert f"Judge: Not 5: {expected}." in capsys.readouterr().out
        assert not namespace["terminated"] and namespace["rewards"].tolist() == [0.0, 0.0]
    assert env.episode.guesses == (5,) and env.episode.step == 1


def test_the_state_is_pure_checkpointed_and_continues_exactly(guess_module):
    from my_envs.guess import GuessDigitEnv, GuessState

    env = GuessDigitEnv(horizon=3)
    env.reset(seed=4)
    state = env.episode
    after = env.transition(state, ("", "{0}"))
    assert env.episode is state and state.guesses == () and after.guesses == (0,)  # transition changed nothing
    env.step(("a", "no digit"))
    assert env.episode.guesses == (-1,) and "Give a digit in braces." in env.episode.history
    saved = json.loads(json.dumps(env.state_dict()))  # JSON-safe, as checkpoints hold it
    assert saved["episode"]["type"] == "GuessState"
    twin = GuessDigitEnv(horizon=3)
    twin.reset(seed=99)
    twin.load_state_dict(saved)
    assert isinstance(twin.episode, GuessState) and twin.episode == env.episode
    for replies in (("x", "{3}"), ("y", "{7}")):
        assert [str(v) for v in twin.step(replies)] == [str(v) for v in env.step(replies)]
    assert env.episode.terminated and env.episode.step == 3  # the horizon's last try ends it
    assert [str(v) for v in twin.reset()] == [str(v) for v in env.reset()]  # the same random stream on


def test_the_guides_env_trains_checkpoints_its_state_and_resumes(random_model_dir, tmp_path, guess_module):
    run = tmp_path / "run"
    flags = ["--model_name_or_path", random_model_dir, "--env_name", "my_envs.guess:GuessDigitEnv", "--horizon", "3",
             "--max_new_tokens", "6", "--context_window", "160", "--n_rollout_threads", "2", "--episode_length", "2",
             "--eval_episodes", "2", "--n_eval_threads", "2", "--save_interval", "1", "--output_dir", str(run)]
    assert main([*flags, "--num_env_steps", "8"]) == 0
    state = read_trainer_state(run / "checkpoints" / "steps_2")
    episodes = [env["episode"] for env in state["envs"] if env["episode"] is not None]
    assert episodes and all(e["type"] == "GuessState" and len(e["guesses"]) == e["step"] for e in episodes)
    assert main([*flags, "--num_env_steps", "12", "--load_path", str(run)]) == 0
    assert json.loads((run / "summary.json").read_text())["iterations"] == 3


@pytest.fixture
def envs_folder(tmp_path, monkeypatch):
    """A folder standing in for marft/envs/ (added to the package's path), where a test writes ``<name>/env.py``."""
    folder = tmp_path / "envs_extra"
    folder.mkdir()
    monkeypatch.setattr(marft.envs, "__path__", [*marft.envs.__path__, str(folder)])
    yield folder
    for name in [m for m in sys.modules if m.startswith("marft.envs.guess") or m.startswith("marft.envs.twoenvs")]:
        del sys.modules[name]


def test_a_folder_under_marft_envs_is_found_by_its_name(envs_folder):
    (envs_folder / "guess").mkdir()
    (envs_folder / "guess" / "env.py").write_text(next(b for b in guide_blocks() if "class GuessDigitEnv" in b))
    env_class = marft.envs.resolve("guess")
    assert env_class.__name__ == "GuessDigitEnv" and env_class.__module__ == "marft.envs.guess.env"
    env = marft.envs.make("guess", split="test", horizon=2)
    assert env.reset(seed=1)[0].startswith("Problem: Find the digit")
    assert marft.envs.resolve("relay_sum").__name__ == "RelaySumEnv"  # the registry comes first


def test_a_folder_with_two_envs_needs_its_choice(envs_folder):
    folder = envs_folder / "twoenvs"
    folder.mkdir()
    code = next(b for b in guide_blocks() if "class GuessDigitEnv" in b) + "\n\nclass OtherEnv(GuessDigitEnv):\n    pass\n"
    (folder / "env.py").write_text(code)
    with pytest.raises(ValueError, match=r"must define exactly one CustomEnv subclass \(found GuessDigitEnv, OtherEnv\)"):
        marft.envs.resolve("twoenvs")
    (folder / "__init__.py").write_text("from marft.envs.twoenvs.env import OtherEnv as ENV\n")
    sys.modules.pop("marft.envs.twoenvs", None)
    assert marft.envs.resolve("twoenvs").__name__ == "OtherEnv"


class ForgetsToStart(CustomEnv):
    """A reset that does not return ``self.start(state)``."""

    def __init__(self, split="train", profile=None, horizon=1):
        super().__init__([spec.role for spec in profile], horizon=horizon)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.episode = EpisodeState(problem="p", answer="a", history="Problem: p\n")


class NoTransition(ForgetsToStart):
    """A CustomEnv without its transition."""

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self.start(EpisodeState(problem="p", answer="a", history="Problem: p\n"))


@pytest.mark.parametrize("env_class, message", [
    (ForgetsToStart, "reset returned NoneType, not (observation, info): a CustomEnv's reset ends with return self.start(state)"),
    (NoTransition, "failed its first reset/step: NotImplementedError: NoTransition must write transition(state, actions, turns=None)"),
])
def test_a_custom_env_that_breaks_the_contract_stops_before_the_model_loads(tmp_path, monkeypatch, capsys, clean_registry,
                                                                          env_class, message):
    def refuse(*args, **kwargs):
        pytest.fail("the model loaded")

    monkeypatch.setattr("marft.launch.build_team", refuse)
    marft.envs.register("broken_custom", env_class)
    assert main(["--env_name", "broken_custom", "--output_dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: --env_name broken_custom (train)") and message in err[-1], err
    assert not (tmp_path / "run").exists()


def test_the_guides_demonstrations_replay_as_the_env_judges_them(guess_module):
    """Each demonstration is a played episode: its judge lines are what the env says to those replies, and it ends
    when the guess is right or the horizon is used up."""
    from my_envs.guess import GuessDigitEnv

    env = GuessDigitEnv(horizon=3)
    env.reset(seed=2)
    episodes = env.demonstrations(20)
    assert len(episodes) == 20
    for episode in episodes:
        steps = list(_steps(episode["turns"]))
        assert 1 <= len(steps) <= 3
        assert all(t["text"][0] == "{" and t["text"][-1] == "}" for replies, _ in steps for t in replies)
        for index, (_, judge) in enumerate(steps):
            last = index == len(steps) - 1
            assert (judge is None) == last  # a judge line after every step but the last
            if judge is not None:
                assert judge.startswith("Not ") and judge.endswith(("higher.", "lower."))


def _steps(turns):
    """A demonstration's turns as (the step's replies, the judge line after it or None)."""
    replies = []
    for turn in turns:
        if turn["role"] == "Judge":
            yield replies, turn["text"]
            replies = []
        else:
            replies.append(turn)
    if replies:
        yield replies, None
