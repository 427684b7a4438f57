"""Environments: gymnasium conformance, determinism, pure transitions, multi-turn episodes,
team rewards, the vector env's autoreset, and clear errors on bad datasets."""

import json
import warnings
from dataclasses import replace

import gymnasium
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from marft import envs
from marft.envs.base import EpisodeState
from marft.envs.math import MathEnv, load_problems
from marft.envs.math.data import load_problem_set
from marft.envs.profile import load_profile
from marft.envs.relay_sum.env import RelaySumEnv
from marft.envs.vector import TextVectorEnv
from marft.prompting import JUDGE_ROLE, format_problem, format_turn

pytestmark = pytest.mark.filterwarnings("ignore:.*reward returned by `step\\(\\)` must be a float.*")

FEEDBACK = "Your answer is incorrect. Please check the reasoning and try again."


def boxed(answer):
    return f"so the answer is \\boxed{{{answer}}}"


@pytest.fixture
def tiny_jsonl(tmp_path):
    rows = [
        {"problem": "What is 2 + 2?", "answer": "4"},
        {"problem": "Half of one?", "final_answer": "\\frac{1}{2}"},
        {"problem": "Solve x + 1 = 3.", "solution": "Subtract: $x = \\boxed{2}$."},
    ]
    path = tmp_path / "tiny.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def run_check_env(env):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # per-agent (array) rewards; no render modes
        check_env(env, skip_render_check=True)


# ---------------------------------------------------------------- conformance


@pytest.mark.parametrize("horizon", [1, 2, 3])
def test_check_env_arithmetic(horizon):
    run_check_env(MathEnv("arithmetic", horizon=horizon))


def test_check_env_tiny_jsonl(tiny_jsonl):
    env = MathEnv(tiny_jsonl, profile="planner_solver_verifier", horizon=2)
    run_check_env(env)
    assert [row["answer"] for row in env.problems] == ["4", "\\frac{1}{2}", "2"]


def test_registry_and_gymnasium_make():
    env = envs.make("math", dataset_path="arithmetic", horizon=2)
    assert isinstance(env, MathEnv) and "math" in envs.registered()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gym_env = gymnasium.make("marft/Math-v0", horizon=2, n_agents=3)
        obs, _ = gym_env.reset(seed=3)
        assert obs == env.reset(seed=3)[0]
        _, rewards, *_ = gym_env.step(("a", "b", "c"))
    assert rewards.shape == (3,)
    with pytest.raises(ValueError, match="unknown environment 'nope'; registered: code, (dense_relay_sum, )?(dense_route, )?math, relay_sum, route"):
        envs.make("nope")


def test_spaces_accept_real_text():
    env = MathEnv("arithmetic")
    text = "Problem: $\\frac{1}{2}$ {x}\n  é π ∑ 中文 \\boxed{5}\n"
    assert env.observation_space.contains(text) and env.observation_space.contains("")
    assert env.action_space.contains((text, ""))
    assert env.observation_space is not MathEnv("arithmetic").observation_space


# ---------------------------------------------------------------- determinism and purity


def test_same_seed_same_problems():
    def problems(seed):
        env = MathEnv("arithmetic")
        first = env.reset(seed=seed)[0]
        return [first] + [env.reset()[0] for _ in range(5)]

    assert problems(7) == problems(7)
    assert problems(7) != problems(8)


def test_transition_is_pure():
    env = MathEnv("arithmetic", horizon=3)
    env.reset(seed=0)
    state = env.episode
    snapshot = replace(state)
    actions = ["thinking", "\\boxed{-1000}"]
    first = env.transition(state, actions)
    second = env.transition(state, actions)
    assert state == snapshot and env.episode is state  # neither input nor env changed
    assert first == second and first is not state
    assert (first.step, first.terminated, first.truncated) == (1, False, False)
    right = env.transition(state, ["", boxed(state.answer)])
    assert right.terminated and right.outcome.rewards == (1.0, 1.0)


def test_step_requires_reset_and_valid_actions():
    env = MathEnv("arithmetic")
    with pytest.raises(RuntimeError, match="call reset"):
        env.step(("a", "b"))
    env.reset(seed=0)
    with pytest.raises(ValueError, match="expected 2 replies"):
        env.step(("a",))
    with pytest.raises(TypeError, match="must be a str"):
        env.step(("a", 5))
    env.step(("a", "b"))  # wrong at horizon 1: terminated (no attempts left)
    with pytest.raises(RuntimeError, match="episode is over"):
        env.step(("a", "b"))


# ---------------------------------------------------------------- episodes and rewards


def test_multi_turn_with_judge_feedback():
    env = MathEnv("arithmetic", horizon=3)
    obs, info = env.reset(seed=1, options={"task_index": 4})
    problem, answer = env.problems[4]["problem"], env.problems[4]["answer"]
    assert obs == format_problem(problem) and info["answer"] == answer and info["task_index"] == 4
    expected = format_problem(problem)
    for step in (1, 2):
        replies = (f"idea {step}", "\\boxed{-1000}")
        obs, rewards, terminated, truncated, info = env.step(replies)
        expected += format_turn("Reasoner", replies[0]) + format_turn("Actor", replies[1])
        expected += format_turn(JUDGE_ROLE, FEEDBACK)
        assert obs == expected and env.state() == expected
        assert rewards.tolist() == [0.0, 0.0] and not terminated and not truncated
        assert info == {"step": step, "answer": answer, "predicted": "-1000", "correct": False, "private_observations": ("", "")}
    obs, rewards, terminated, truncated, info = env.step(("idea 3", boxed(answer)))
    assert obs == expected + format_turn("Reasoner", "idea 3") + format_turn("Actor", boxed(answer))
    assert rewards.dtype == np.float32 and rewards.tolist() == [1.0, 1.0]
    assert terminated and not truncated and info["correct"] and info["step"] == 3


def test_wrong_until_horizon_terminates_without_feedback():
    env = MathEnv("arithmetic", horizon=2)
    env.reset(seed=0)
    env.step(("", ""))  # empty replies are graded (wrong), not crashed on
    obs, rewards, terminated, truncated, info = env.step(("", ""))
    assert terminated and not truncated and rewards.tolist() == [0.0, 0.0] and not info["correct"]
    assert obs.count(f"{JUDGE_ROLE}:") == 1 and info["step"] == 2 and info["predicted"] is None


def test_team_reward_goes_to_every_agent_and_last_answerer_is_graded():
    env = MathEnv("arithmetic", profile="planner_solver_verifier")
    _, info = env.reset(seed=0)
    right, wrong = boxed(info["answer"]), "\\boxed{-1000}"
    _, rewards, terminated, _, _ = env.step(("plan", wrong, right))
    assert rewards.shape == (3,) and rewards.tolist() == [1.0, 1.0, 1.0] and terminated
    env.reset(seed=0)
    _, rewards, terminated, truncated, _ = env.step(("plan", right, wrong))  # the Verifier's answer counts
    assert rewards.tolist() == [0.0, 0.0, 0.0] and terminated and not truncated


def test_grader_failure_gives_zero_reward(caplog):
    class BrokenGrader:
        def grade(self, response, ground_truth):
            raise TimeoutError("stuck")

    env = MathEnv("arithmetic", grader=BrokenGrader(), horizon=2)
    env.reset(seed=0)
    _, rewards, terminated, truncated, info = env.step(("a", "\\boxed{1}"))
    assert rewards.tolist() == [0.0, 0.0] and not terminated and not truncated
    assert env.grading_failures == 1 and "TimeoutError" in info["grading_error"]
    assert "grading failed" in caplog.text


def test_profile_and_n_agents_must_agree():
    with pytest.raises(ValueError, match="has 2 agents but --n_agents is 3"):
        MathEnv("arithmetic", profile="reasoner_actor", n_agents=3)
    assert MathEnv("arithmetic", n_agents=4).roles == tuple(s.role for s in load_profile(None, 4))
    assert MathEnv("arithmetic", profile="planner_solver_anonymous").roles == ("Agent 1", "Agent 2")


# ---------------------------------------------------------------- vector env


def test_vector_env_seeds_and_autoreset():
    """gymnasium's vector API with same-step autoreset: a 5-tuple, per-env info arrays with ``_key`` masks,
    ``final_obs`` / ``final_info`` for the envs that finished."""
    make = lambda: MathEnv("arithmetic", horizon=2)  # noqa: E731
    vec = TextVectorEnv([make] * 3)
    assert isinstance(vec, gymnasium.vector.VectorEnv) and vec.metadata["autoreset_mode"] == gymnasium.vector.AutoresetMode.SAME_STEP
    obs, infos = vec.reset(seed=10)
    singles = [make().reset(seed=10 + k) for k in range(3)]
    assert list(obs) == [o for o, _ in singles]
    answers = [info["answer"] for _, info in singles]
    assert list(infos["answer"]) == answers and infos["_answer"].all()

    # env 0 solves it, env 1 and 2 are wrong (first of two steps).
    actions = [["r", boxed(answers[0])], ["r", "\\boxed{-1000}"], ["r", "\\boxed{-1000}"]]
    obs, rewards, terminated, truncated, infos = vec.step(actions)
    assert rewards.shape == (3, 2) and rewards.dtype == np.float32
    assert rewards.tolist() == [[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]]
    assert terminated.tolist() == [True, False, False] and truncated.tolist() == [False] * 3
    assert obs[0] == format_problem(vec.envs[0].episode.problem)  # env 0 already restarted
    assert infos["_final_obs"].tolist() == [True, False, False]
    assert infos["final_obs"][0].endswith(format_turn("Actor", boxed(answers[0])))
    assert infos["final_info"]["correct"][0] and infos["final_info"]["_correct"].tolist() == [True, False, False]
    assert infos["step"].tolist() == [0, 1, 1]  # env 0: its new episode's reset info
    assert obs[1].endswith(format_turn(JUDGE_ROLE, FEEDBACK))

    # env 1 and 2 wrong again: out of attempts (terminated, the attempts are the task) and reset.
    obs, rewards, terminated, truncated, infos = vec.step([["r", ""], ["r", ""], ["r", ""]])
    assert terminated.tolist() == [False, True, True] and not truncated.any()
    assert all(obs[k].count("\n") == 1 for k in (1, 2))  # fresh episodes
    assert infos["final_obs"][2].count(f"{JUDGE_ROLE}:") == 1
    with pytest.raises(ValueError, match="actions for 3 envs"):
        vec.step([["a", "b"]])


def test_vector_env_keeps_truncation_apart_and_works_with_gymnasium_wrappers():
    """A ``TimeLimit``-wrapped env truncates (not terminates); the vector env passes ``truncated`` on, puts the
    final observation and its private observations in ``final_info``, and reads roles through the wrapper."""
    from gymnasium.wrappers import TimeLimit

    vec = TextVectorEnv([lambda: TimeLimit(RelaySumEnv(horizon=5), max_episode_steps=2)] * 2)
    obs, infos = vec.reset(seed=0)
    keys = [texts[0] for texts in infos["private_observations"]]
    assert all(key.startswith("x = ") for key in keys) and vec.private_observations == list(infos["private_observations"])
    for _step in (1, 2):
        obs, rewards, terminated, truncated, infos = vec.step([["no idea", "\\boxed{-1}"]] * 2)
    assert truncated.tolist() == [True, True] and not terminated.any()
    assert [texts[0] for texts in infos["final_info"]["private_observations"]] == keys  # the finished episodes' keys
    assert all(final.count("Judge:") == 2 for final in infos["final_obs"])  # 2 wrong attempts of 5: feedback after each


# ---------------------------------------------------------------- datasets


def test_arithmetic_matches_generator():
    from marft.envs.math.arithmetic import generate_arithmetic

    assert load_problems("arithmetic", split="test", max_operand=5) == generate_arithmetic("test", max_operand=5)
    assert MathEnv("arithmetic", split="test", max_operand=5).problems == generate_arithmetic("test", max_operand=5)


def test_missing_and_empty_datasets(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found; pass a JSON/JSONL file"):
        load_problems(tmp_path / "missing.jsonl")
    with pytest.raises(FileNotFoundError, match="not found"):
        MathEnv(tmp_path / "missing.json")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="has no usable problems \\(0 rows skipped\\)"):
        load_problems(empty)
    empty_list = tmp_path / "empty.json"
    empty_list.write_text("[]")
    with pytest.raises(ValueError, match="no usable problems"):
        MathEnv(empty_list)
    not_a_list = tmp_path / "dict.json"
    not_a_list.write_text('{"problem": "x", "answer": "1"}')
    with pytest.raises(ValueError, match="holds a JSON dict; expected a list"):
        load_problems(not_a_list)
    with pytest.raises(ValueError, match="problems is empty"):
        MathEnv(problems=[])


def test_malformed_rows_are_skipped_and_counted(tmp_path, caplog):
    lines = [
        json.dumps({"problem": "ok 1", "answer": 3}),  # numeric answers become strings
        "{not json",
        json.dumps({"problem": "no answer"}),
        "",
        json.dumps({"answer": "5"}),
        json.dumps({"problem": "boxless", "solution": "it is 5"}),
        json.dumps({"problem": "ok 2", "solution": "so \\boxed{\\frac{1}{2}}"}),
    ]
    path = tmp_path / "messy.jsonl"
    path.write_text("\n".join(lines) + "\n")
    problems = load_problem_set(path)
    assert problems.rows == [{"problem": "ok 1", "answer": "3"}, {"problem": "ok 2", "answer": "\\frac{1}{2}"}]
    assert problems.skipped == ["line 2 (invalid JSON)", "line 3 (no answer)", "line 5 (no problem)", "line 6 (no answer)"]
    assert "skipped 4 unusable rows: line 2" in caplog.text
    assert MathEnv(path).skipped_rows == problems.skipped
    with pytest.raises(ValueError, match="messy.jsonl: line 2: invalid JSON"):
        load_problems(path, strict=True)
    listed = tmp_path / "messy.json"
    listed.write_text(json.dumps([{"problem": "a", "final_answer": "1"}, {"problem": "b"}]))
    with pytest.raises(ValueError, match="entry 2: no answer"):
        MathEnv(listed, strict=True)


def test_dataset_folder_by_split(tmp_path, tiny_jsonl):
    (tmp_path / "test.jsonl").write_text(tiny_jsonl.read_text())
    assert len(load_problems(tmp_path, split="test")) == 3
    with pytest.raises(FileNotFoundError, match="no train.jsonl or train.json"):
        load_problems(tmp_path, split="train")


def test_episode_state_is_frozen():
    state = EpisodeState(problem="p", answer="1", history="Problem: p\n")
    with pytest.raises(AttributeError):
        state.step = 3


def test_vector_env_spaces_have_gymnasiums_batched_layout():
    """The batched spaces are what gymnasium's ``batch_space`` builds (a Tuple of n observations; per agent a Tuple
    of n actions) and accept a batch of real text, without ``batch_space``'s deep copy per env."""
    from gymnasium.vector.utils import batch_space

    vec = TextVectorEnv([lambda: MathEnv("arithmetic")] * 3)
    single = vec.single_action_space
    assert vec.observation_space == batch_space(vec.single_observation_space, 3)
    assert vec.action_space == batch_space(single, 3)
    obs, _ = vec.reset(seed=0)
    assert vec.observation_space.contains(tuple(obs))
    assert vec.action_space.contains(tuple(("12",) * 3 for _ in single.spaces))
