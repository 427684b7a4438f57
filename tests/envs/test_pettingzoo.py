"""marft environments through PettingZoo's API: PettingZoo's own ``api_test`` / ``parallel_api_test`` on every
shipped env, every workflow and the docs' user envs; the AEC env plays exactly the env's turns and rewards; each
agent sees its own private observation only."""

import re
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pettingzoo", reason="pettingzoo is not installed (pip install -r requirements-dev.txt)")
from pettingzoo.test import api_test, parallel_api_test  # noqa: E402

from marft.envs import load_profile, make  # noqa: E402
from marft.envs.pettingzoo.env import PETTINGZOO_MISSING, TextSpace, aec_env, parallel_env  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

SHIPPED = {
    "math (arithmetic)": ("math", {"dataset_path": "arithmetic", "split": "test"}),
    "math, a DAG": ("math", {"dataset_path": "arithmetic", "profile": "solvers_verifier_graph"}),
    "math, orchestrated": ("math", {"dataset_path": "arithmetic", "profile": "planner_solver_verifier_orchestrated"}),
    "math, 2 attempts": ("math", {"dataset_path": "arithmetic", "horizon": 2}),
    "relay_sum": ("relay_sum", {"split": "test"}),
    "route (orchestrated)": ("route", {"split": "test"}),
    "code": ("code", {"split": "test"}),
    "TextArena Tic-Tac-Toe, self-play": ("textarena:TicTacToe-v0", {"split": "test", "profile": "game_seats"}),
    "TextArena Kuhn Poker, against the random player": ("textarena:KuhnPoker-v0", {"split": "test", "profile": "game_player"}),
    "TextArena SecretMafia, a team game": ("textarena:SecretMafia-v0", {"split": "test", "profile": "secret_mafia"}),
}


@pytest.mark.parametrize("label", list(SHIPPED))
def test_every_shipped_env_passes_pettingzoos_api_test(label):
    name, kwargs = SHIPPED[label]
    if name.startswith("textarena:"):
        pytest.importorskip("textarena", reason="textarena is not installed (pip install -r requirements-dev.txt)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PettingZoo's advice for numeric envs (Box spaces, player_0 names)
        api_test(aec_env(name, max_reply_chars=48, **kwargs), num_cycles=20)


def user_env(page: Path, class_name: str):
    """The env class of a docs page's ```python blocks, as a reader would paste them."""
    namespace: dict = {"__name__": f"user_{class_name}"}
    from test_user_env import python_blocks

    for block in python_blocks(page):
        if f"class {class_name}" in block:
            exec(compile(block, str(page), "exec"), namespace)  # noqa: S102 - the docs' own code
            return namespace[class_name]
    raise AssertionError(f"{page} has no class {class_name}")


@pytest.mark.parametrize("page, class_name", [("README.md", "SameWordEnv"), ("docs/environments.md", "AgreeDigitEnv")])
def test_the_docs_user_envs_pass_pettingzoos_api_test(page, class_name):
    env_class = user_env(ROOT / page, class_name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        api_test(aec_env(env_class(), max_reply_chars=48), num_cycles=20)


def test_an_env_whose_agents_act_at_once_passes_the_parallel_api_test():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        parallel_api_test(parallel_env("math", dataset_path="arithmetic", max_reply_chars=48), num_cycles=20)


def test_the_parallel_api_refuses_a_workflow_with_turns():
    with pytest.raises(ValueError, match="one after another.*aec_env"):
        parallel_env("math", dataset_path="arithmetic", workflow="sequential")


def test_the_aec_env_plays_the_envs_own_turns_and_rewards():
    """Driving the AEC env and the plain env with the same replies gives the same speakers, rewards and history."""
    profile = load_profile("planner_solver_verifier_orchestrated")
    wrapped = aec_env("math", dataset_path="arithmetic", profile=profile)
    plain = make("math", dataset_path="arithmetic", profile=profile)
    from marft.envs.workflows import workflow_for

    plain.set_workflow(workflow_for(profile))
    wrapped.reset(seed=3)
    plain.reset(seed=3)
    replies = iter(["<call>Solver</call>", "\\boxed{3}", "<call>Verifier</call>", "fine", "<done/>"] * 4)
    order, rewards = [], {}
    for agent in wrapped.agent_iter():
        _, reward, terminated, truncated, _ = wrapped.last()
        rewards[agent] = rewards.get(agent, 0.0) + reward
        if terminated or truncated:
            wrapped.step(None)
            continue
        speaker = plain.speakers()[0]
        assert agent == plain.roles[speaker]
        reply = next(replies)
        order.append(agent)
        wrapped.step(reply)
        plain.take_turn(speaker, reply)
        if not plain.speakers():
            _, plain_rewards, *_ = plain.step(plain.turn_actions())
    assert order[0] == "Orchestrator" and "Solver" in order
    assert rewards == {role: float(r) for role, r in zip(plain.roles, plain_rewards)}
    assert wrapped.env.episode.history == plain.episode.history


def test_each_agent_sees_its_own_private_observation_only():
    env = aec_env("relay_sum", split="test")
    env.reset(seed=0)
    key = env.env.private_observations()[0]
    assert key.startswith("x = ")
    first, second = env.possible_agents
    assert env.observe(first).startswith(key) and key not in env.observe(second)
    assert isinstance(env.observe(first), str) and env.observation_space(first).contains(env.observe(first))


def test_the_text_space_dtype_matches_texts_of_any_length():
    space = TextSpace(100)
    assert space.dtype == np.str_("abc").dtype and space.dtype == np.str_("a" * 50).dtype and space.dtype == space.dtype
    assert space.dtype != np.dtype("float32") and space.dtype != "not a dtype"


def test_without_pettingzoo_the_error_says_how_to_install_it(monkeypatch):
    import marft.envs.pettingzoo.env as module

    module._aec_class.cache_clear()
    monkeypatch.setitem(sys.modules, "pettingzoo", None)
    try:
        with pytest.raises(ImportError, match=re.escape(PETTINGZOO_MISSING)):
            aec_env("relay_sum")
    finally:
        module._aec_class.cache_clear()


def test_a_live_agents_action_must_be_a_reply_and_an_ended_game_says_reset():
    env = aec_env("relay_sum", split="test")
    env.reset(seed=0)
    with pytest.raises(TypeError, match="must be its reply"):
        env.step(None)
    for _agent in env.agent_iter():
        _, _, terminated, truncated, _ = env.last()
        env.step(None if terminated or truncated else "\\boxed{1}")
    with pytest.raises(RuntimeError, match="call reset"):
        env.step("late")
