"""Profiles: shipped files load and agree with their anonymous twins; bad files fail with one clear line."""

import json

import pytest

from marft.envs.profile import (
    DEFAULT_PROFILES,
    AgentSpec,
    answer_agent_index,
    list_profiles,
    load_profile,
)

NAMED = ["reasoner_actor", "planner_solver", "planner_solver_verifier", "planner_solver_reflector_verifier",
         "reasoner_actor_code", "planner_coder", "planner_coder_debugger", "planner_coder_reviewer_debugger",
         "planner_solver_verifier_orchestrated", "solvers_verifier_graph", "route_orchestrated", "game_player", "game_seats",
         "secret_mafia"]


def write(tmp_path, entries, name="p.json"):
    path = tmp_path / name
    path.write_text(json.dumps(entries))
    return path


def test_shipped_profiles_are_all_present():
    assert set(list_profiles()) == set(NAMED) | {f"{n}_anonymous" for n in NAMED}


@pytest.mark.parametrize("name", NAMED)
def test_named_profile_and_anonymous_twin(name):
    named = load_profile(name)
    anonymous = load_profile(f"{name}_anonymous", n_agents=len(named))
    assert [s.role for s in anonymous] == [f"Agent {i + 1}" for i in range(len(named))]
    assert all(s.prompt == "" for s in anonymous if not s.orchestrator)  # an orchestrator's prompt lists the specialists
    assert [s.after for s in anonymous] == [tuple(f"Agent {[t.role for t in named].index(p) + 1}" for p in s.after) for s in named]
    assert [s.orchestrator for s in anonymous] == [s.orchestrator for s in named]
    assert [s.with_answer for s in anonymous] == [s.with_answer for s in named]
    assert all(s.prompt.strip() for s in named)
    answer_format = "```python" if "code" in name else "[4]" if "game" in name or "mafia" in name else "\\boxed{"  # a program; a game move
    assert answer_format in named[answer_agent_index(named)].prompt


def test_reasoner_actor_contents():
    profile = load_profile("reasoner_actor")
    assert [(s.role, s.with_answer) for s in profile] == [("Reasoner", False), ("Actor", True)]
    assert answer_agent_index(profile) == 1
    assert answer_agent_index(load_profile("planner_solver_verifier")) == 2


def test_load_by_path_and_defaults(tmp_path):
    path = write(tmp_path, [{"role": "A", "prompt": "p"}, {"role": "B", "with_answer": True}])
    assert load_profile(path) == [AgentSpec("A", "p", False), AgentSpec("B", "", True)]
    assert load_profile(str(path), n_agents=2)[1].with_answer
    for n, name in DEFAULT_PROFILES.items():
        assert load_profile(None, n_agents=n) == load_profile(name)


@pytest.mark.parametrize(
    "entries, message",
    [
        ({"role": "A"}, "non-empty JSON list"),
        ([], "non-empty JSON list"),
        ([{"prompt": "x", "with_answer": True}], "entry 0 has no 'role'"),
        ([{"role": "A", "with_answer": True}, {"role": "A"}], "duplicate roles ['A']"),
        ([{"role": "A"}, {"role": "B"}], "no entry has \"with_answer\": true"),
        ([{"role": "A", "with_answer": "yes"}], "use true or false"),
        ([{"role": "Judge", "with_answer": True}], "reserved role"),
        (["A"], "entry 0 is not an object"),
    ],
)
def test_bad_profiles(tmp_path, entries, message):
    with pytest.raises(ValueError) as err:
        load_profile(write(tmp_path, entries))
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_missing_file_and_count_mismatch(tmp_path):
    with pytest.raises(ValueError, match="not found; pass a JSON file path or one of: .*reasoner_actor"):
        load_profile(tmp_path / "nope.json")
    with pytest.raises(ValueError, match="not found"):
        load_profile("no_such_profile")
    with pytest.raises(ValueError, match="profile planner_solver_verifier has 3 agents but --n_agents is 2; "):
        load_profile("planner_solver_verifier", n_agents=2)
    with pytest.raises(ValueError, match="no default profile for n_agents=7"):
        load_profile(None, n_agents=7)
    bad = tmp_path / "bad.json"
    bad.write_text("[{")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_profile(bad)
