"""CodeEnv: conformance, team rewards from hidden tests, test feedback, profiles, loaders, parallel grading."""

import json
import warnings
from dataclasses import replace

import gymnasium
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from marft import envs
from marft.envs.code import CodeEnv, grade_many
from marft.envs.code.data import load_code_problems, read_code_file
from marft.envs.code.env import NO_CODE_FEEDBACK
from marft.envs.code.generated import generate_tasks
from marft.envs.code.problem import CodeProblem, last_python_block
from marft.envs.profile import list_profiles, load_profile
from marft.envs.vector import TextVectorEnv
from marft.prompting import JUDGE_ROLE

pytestmark = pytest.mark.filterwarnings("ignore:.*reward returned by `step\\(\\)` must be a float.*")

CODE_PROFILES = ["reasoner_actor_code", "planner_coder", "planner_coder_debugger", "planner_coder_reviewer_debugger"]
ADD_TESTS = [{"input": "2 3\n", "output": "5\n"}, {"input": "1 1\n", "output": "2\n"}, {"input": "0 7\n", "output": "7\n"}]
ADD = CodeProblem(task_id="add", text="Read two integers and print their sum.", tests=ADD_TESTS)


def fenced(code):
    return f"Here it is:\n```python\n{code}```\n"


def solved_reply(env):
    return fenced(env.problems[env.episode.problem_index].solution)


@pytest.mark.parametrize("horizon", [1, 2])
def test_check_env(horizon):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_env(CodeEnv(horizon=horizon), skip_render_check=True)
        check_env(CodeEnv(profile="planner_coder_debugger", horizon=horizon), skip_render_check=True)


def test_registered_and_gymnasium_make():
    env = envs.make("code", split="test", profile="planner_coder", horizon=2)
    assert isinstance(env, CodeEnv) and "code" in envs.registered() and env.roles == ("Planner", "Coder")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        obs, _ = gymnasium.make("marft/Code-v0").reset(seed=3)
    assert obs == CodeEnv().reset(seed=3)[0]


@pytest.mark.parametrize("name", CODE_PROFILES)
def test_code_profiles_and_anonymous_twins(name):
    named = load_profile(name)
    anonymous = load_profile(f"{name}_anonymous", n_agents=len(named))
    assert f"{name}_anonymous" in list_profiles() and len(named) == {"planner_coder_debugger": 3, "planner_coder_reviewer_debugger": 4}.get(name, 2)
    assert [s.role for s in anonymous] == [f"Agent {i + 1}" for i in range(len(named))] and all(s.prompt == "" for s in anonymous)
    assert [s.with_answer for s in anonymous] == [s.with_answer for s in named]
    assert "```python" in named[-1].prompt and named[-1].with_answer  # the last agent writes the graded program


def test_last_python_block():
    assert last_python_block("```python\na = 1\n```\ntext\n```py\nb = 2\n```") == "b = 2\n"
    assert last_python_block("```PYTHON3\nc = 3\n```") == "c = 3\n"
    assert last_python_block("no code") is None and last_python_block("```\nx = 1\n```") is None


def test_reward_is_the_share_of_tests_passed_for_every_agent():
    env = CodeEnv(problems=[ADD], profile="planner_coder_debugger")
    env.reset(seed=0)
    half = "a, b = map(int, input().split())\nprint(a + b if a else 0)\n"
    _, rewards, terminated, _, info = env.step(("plan", fenced("print(5)"), fenced(half)))  # the Debugger's program counts
    assert rewards.tolist() == pytest.approx([2 / 3] * 3) and terminated and not info["correct"]
    assert info["statuses"] == ["passed", "passed", "failed"] and (info["passed"], info["total"]) == (2, 3)
    env.reset(seed=0)
    _, rewards, _, _, info = env.step(("plan", "", fenced("print(sum(map(int, input().split())))\n")))
    assert rewards.tolist() == [1.0] * 3 and info["correct"]


def test_missing_code_block_is_zero_and_counted():
    env = CodeEnv(problems=[ADD], horizon=2)
    env.reset(seed=0)
    obs, rewards, terminated, _, info = env.step(("think", "print(5) without a fence"))
    assert rewards.tolist() == [0.0, 0.0] and not terminated and info["missing_code"] and env.missing_code_blocks == 1
    assert obs.endswith(f"{JUDGE_ROLE}: {NO_CODE_FEEDBACK}\n")
    assert env.state_dict()["counters"]["missing_code_blocks"] == 1


def test_feedback_names_failed_tests_and_stderr_but_not_hidden_outputs():
    env = CodeEnv(problems=[ADD], horizon=3)
    env.reset(seed=0)
    program = "a, b = map(int, input().split())\nprint(a // (b - 1))\n"
    obs, rewards, terminated, _, _ = env.step(("", fenced(program)))
    feedback = obs.split(f"{JUDGE_ROLE}: ")[-1]
    assert not terminated and rewards[0] == pytest.approx(0.0)
    assert feedback.startswith("Passed 0 of 3 tests. Not passed: test 1 (wrong answer), test 2 (runtime error), test 3 (wrong answer).")
    assert "stderr (end):" in feedback and "ZeroDivisionError" in feedback and "2 3" not in feedback  # no hidden input
    *_, terminated, _, info = env.step(("", fenced("print(sum(map(int, input().split())))\n")))
    assert terminated and info["correct"] and info["step"] == 2


def test_generated_tasks_split_and_solutions():
    train, test = generate_tasks("train"), generate_tasks("test")
    assert len(train) == 24 and len(test) == 6 and not {p.task_id for p in train} & {p.task_id for p in test}
    assert all(p.n_tests == 5 for p in train + test) and train[0].text.startswith("Write a Python function f(x) that returns x ")
    reports = grade_many([{"program": p.solution, "tests": p.tests} for p in train + test])
    assert all(r.all_passed for r in reports)
    wrong = grade_many([{"program": "def f(x):\n    return x\n", "tests": p.tests} for p in test])
    assert sum(r.all_passed for r in wrong) <= 2  # only x + 0, x - 0, x * 1 can pass with identity


def test_deepcoder_loader_skips_and_counts_malformed_rows(tmp_path, caplog):
    rows = [
        {"problem": "Sum two numbers.", "tests": json.dumps(ADD_TESTS), "test_type": "stdin"},
        {"question": "Add.", "starter_code": "class Solution:\n    def add(self, a, b):\n        pass\n",
         "tests": [{"input": "2\n3", "output": "5", "testtype": "functional"}], "metadata": {"func_name": "add"}},
        {"problem": "Twice.", "tests": [{"input": "[1, 2]", "output": "[2, 4]", "testtype": "functional", "metadata": {"func_name": "twice"}}]},
        {"question": "TACO style", "input_output": {"inputs": ["4\n"], "outputs": ["16\n"]}},
        {"problem": "No tests."},
        {"tests": ADD_TESTS},
        {"problem": "Functional without a name.", "tests": [{"input": "1", "output": "1", "testtype": "functional"}]},
    ]
    path = tmp_path / "deepcoder.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\nnot json\n")
    loaded = read_code_file(path)
    assert [p.task_id for p in loaded.problems] == ["line 1", "line 2", "line 3", "line 4"]
    assert loaded.skipped == ["line 5 (no tests)", "line 6 (no problem)", "line 7 (functional test without func_name)", "line 8 (invalid JSON)"]
    assert "skipped 4 unusable rows" in caplog.text
    assert loaded.problems[1].tests == [{"call": "Solution().add(2, 3)", "expected": "5"}] and "Starter code" in loaded.problems[1].text
    assert loaded.problems[2].tests == [{"call": "twice([1, 2])", "expected": "[2, 4]"}]
    solutions = ["print(sum(map(int, input().split())))", "class Solution:\n    def add(self, a, b):\n        return a + b\n",
                 "def twice(xs):\n    return [2 * x for x in xs]\n", "print(int(input()) ** 2)"]
    assert all(r.all_passed for r in grade_many([{"program": s, "tests": p.tests} for s, p in zip(solutions, loaded.problems)]))
    with pytest.raises(ValueError, match="line 5"):
        read_code_file(path, strict=True)
    assert load_code_problems(path).source == str(path)


def test_transition_is_pure_and_resume_restores_the_episode():
    env = CodeEnv(horizon=3)
    env.reset(seed=4)
    state = env.episode
    snapshot = replace(state)
    first, second = env.transition(state, ["", "```python\nprint(\n```"]), env.transition(state, ["", "```python\nprint(\n```"])
    assert state == snapshot and first == second and first.problem_index == state.problem_index
    env.step(("", "no code"))
    saved = json.loads(json.dumps(env.state_dict()))
    other = CodeEnv(horizon=3)
    other.reset(seed=99)
    other.load_state_dict(saved)
    assert other.episode == env.episode and other.missing_code_blocks == 1
    replies = ("", solved_reply(env))
    (_, mine, done, *_), (_, theirs, other_done, *_) = other.step(replies), env.step(replies)
    assert mine.tolist() == theirs.tolist() == [1.0, 1.0] and done and other_done
    assert other.reset()[0] == env.reset()[0]  # the random generator was restored too


def test_vector_env_grades_the_step_in_parallel_with_the_same_results():
    make = lambda: CodeEnv(split="train")  # noqa: E731
    vector, plain = TextVectorEnv([make] * 4), [make() for _ in range(4)]
    vector.reset(seed=10)
    for k, env in enumerate(plain):
        env.reset(seed=10 + k)
    actions = [("", solved_reply(env) if k % 2 else fenced("def f(x):\n    return x\n")) for k, env in enumerate(vector.envs)]
    expected = [env.step(a)[1] for env, a in zip(plain, actions)]
    rewards = vector.step(actions)[1]
    assert np.allclose(rewards, np.stack(expected)) and rewards[1].tolist() == rewards[3].tolist() == [1.0, 1.0]
    assert all(not env._pending for env in vector.envs)  # every pregraded report was used
