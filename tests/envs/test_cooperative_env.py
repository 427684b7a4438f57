"""The cooperative toy env ``relay_sum``: conformance, the optimum is reachable, guessing rarely works."""

import warnings
from dataclasses import replace

import gymnasium
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from marft import envs
from marft.envs.relay_sum.env import RelaySumEnv, relay_tasks
from marft.prompting import JUDGE_ROLE, format_problem, format_turn

pytestmark = pytest.mark.filterwarnings("ignore:.*reward returned by `step\\(\\)` must be a float.*")


def optimal_replies(env):
    """What a perfect team says: the keeper relays the key, the answerer boxes the sum."""
    key, number = env.episode.key, int(env.episode.problem.split("+")[1].rstrip("?"))
    return (f"{key} + {number} = {key + number}", f"\\boxed{{{key + number}}}")


@pytest.mark.parametrize("horizon", [1, 2, 3])
def test_check_env(horizon):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # per-agent (array) rewards; no render modes
        check_env(RelaySumEnv(horizon=horizon), skip_render_check=True)


def test_registered_and_gymnasium_make():
    assert isinstance(envs.make("relay_sum", split="test"), RelaySumEnv) and "relay_sum" in envs.registered()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        obs, _ = gymnasium.make("marft/RelaySum-v0").reset(seed=3)
    assert obs == RelaySumEnv().reset(seed=3)[0]


def test_only_the_keeper_sees_the_key():
    env = RelaySumEnv()
    obs, info = env.reset(seed=0)
    key = info["key"]
    assert obs == format_problem(f"What is x + {info['number']}?")
    assert env.private_observations() == [f"x = {key}", ""]
    assert env.state().startswith(f"x = {key}\n")  # the critic's global view holds it


def test_splits_are_disjoint_and_cover_every_pair():
    train, test = relay_tasks("train"), relay_tasks("test")
    assert not set(train) & set(test)
    assert sorted(train + test) == [(k, 10 * t) for k in range(10) for t in range(1, 10)]
    assert len(test) == 18
    assert {key for key, _ in test} != {0} and len({number for _, number in test}) > 1  # a real mix of pairs
    per_key = [sum(key == k for key, _ in test) for k in range(10)]
    assert sorted(per_key) == [1, 1] + [2] * 8  # stratified: every key keeps 7 or 8 of its 9 numbers in training


@pytest.mark.parametrize("kwargs", [{"n_keys": 1}, {"n_keys": 11}, {"n_tens": 0}])
def test_bad_task_sizes_are_refused(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        RelaySumEnv(**kwargs)


@pytest.mark.parametrize("horizon", [1, 3])
def test_optimum_is_reachable(horizon):
    env = RelaySumEnv(split="test", horizon=horizon)
    for seed in range(50):
        env.reset(seed=seed)
        _, rewards, terminated, truncated, info = env.step(optimal_replies(env))
        assert rewards.tolist() == [1.0, 1.0] and terminated and not truncated and info["correct"]


def test_reward_needs_the_exact_boxed_sum():
    env = RelaySumEnv()
    env.reset(seed=1, options={"task_index": 0})
    key, number = env.tasks[0]
    state = env.episode
    right = str(key + number)
    for reply, reward in [(f"\\boxed{{{right}}}", 1.0), (f"I think \\boxed{{{right}.0}}", 0.0), (right, 0.0),
                          (f"\\boxed{{{right}}} or \\boxed{{{key + number + 1}}}", 0.0), ("", 0.0)]:
        assert env.transition(state, ["", reply]).outcome.rewards == (reward, reward), reply


def test_wrong_answer_gets_feedback_until_the_horizon():
    env = RelaySumEnv(horizon=2)
    obs, _ = env.reset(seed=2)
    obs, rewards, terminated, _, info = env.step(("no idea", "\\boxed{-1}"))
    assert not terminated and rewards.tolist() == [0.0, 0.0] and not info["correct"]
    assert obs.endswith(format_turn(JUDGE_ROLE, "The answer is incorrect. Please try again."))
    assert env.private_observations()[0].startswith("x = ")  # the key stays for the next attempt
    *_, terminated, truncated, _ = env.step(optimal_replies(env))
    assert terminated and not truncated


def test_transition_is_pure():
    env = RelaySumEnv(horizon=2)
    env.reset(seed=0)
    state = env.episode
    snapshot = replace(state)
    first, second = env.transition(state, ["a", "b"]), env.transition(state, ["a", "b"])
    assert state == snapshot and first == second and first.key == state.key


def test_guessing_without_the_key_succeeds_rarely():
    """Random boxed numbers in the answer range, and the best answerer that never hears the key."""
    rng = np.random.default_rng(0)
    env = RelaySumEnv()
    random_hits, blind_hits, n = 0, 0, 2000
    for seed in range(n):
        env.reset(seed=seed)
        number = int(env.episode.problem.split("+")[1].rstrip("?"))
        random_hits += env.transition(env.episode, ["", f"\\boxed{{{rng.integers(10, 100)}}}"]).outcome.solved
        blind_hits += env.transition(env.episode, ["", f"\\boxed{{{number + rng.integers(0, 10)}}}"]).outcome.solved
    assert random_hits / n < 0.03 and blind_hits / n < 0.15  # expected 1/90 and 1/10; the optimum is 1.0


def test_answering_agent_must_not_be_the_keeper():
    from marft.envs.profile import AgentSpec

    with pytest.raises(ValueError, match="first agent"):
        RelaySumEnv(profile=[AgentSpec("Solo", "", True), AgentSpec("Helper", "", False)])
    with pytest.raises(ValueError, match="n_agents"):
        RelaySumEnv(n_agents=3)
