"""TextArena's team games (marft.envs.textarena.teams): SecretMafia played by a team of one agent per role the game
deals, each agent moving for every player dealt its role and paid its side's reward; seats replay exactly; one side
trains while the other is frozen."""

import collections
import json

import numpy as np
import pytest
import torch

pytest.importorskip("textarena", reason="textarena is not installed (pip install -r requirements-dev.txt)")

from marft.envs import make  # noqa: E402
from marft.envs.textarena.env import GameState  # noqa: E402

MAFIA = "textarena:SecretMafia-v0"


def random_legal(env, rng):
    """The agent to move and a random legal move of its player."""
    (agent,) = env.speakers()
    legal = env.episode.legal
    return agent, legal[int(rng.integers(len(legal)))]


def play(env, task_index, seed=0):
    """One game of random legal moves; returns (movers with the player each moved for, the final rewards, info)."""
    env.reset(options={"task_index": task_index})
    rng, movers = np.random.default_rng(seed), []
    while True:
        agent, move = random_legal(env, rng)
        movers.append((agent, env.episode.to_move))
        env.take_turn(agent, move)
        _, rewards, terminated, truncated, info = env.step(env.turn_actions())
        if terminated or truncated:
            return movers, rewards.tolist(), info


def test_each_agent_moves_for_the_players_dealt_its_role_and_is_paid_its_sides_reward():
    env = make(MAFIA, split="test", profile="secret_mafia")
    assert env.team is not None and env.self_play and env.competitive and env.n_players == 6
    assert env.roles == ("Villager", "Doctor", "Detective", "Mafia") and env.num_tasks == 1000
    outcomes = collections.Counter()
    for task in range(8):
        movers, rewards, info = play(env, task)
        dealt = env._game(env.episode.game_seed, ()).base.player_roles  # the game's own deal
        assert sorted(dealt.values()) == ["Detective", "Doctor", "Mafia", "Mafia", "Villager", "Villager"]
        assert all(env.roles[agent] == dealt[player] for agent, player in movers)  # the agent of the player's role moves
        assert movers[0][0] == 3  # the night opens with the Mafia's vote
        village = 1.0 if info["outcome"] == "win" else -1.0
        assert rewards == [village, village, village, -village]  # per side, TextArena's 1 / -1
        assert info["correct"] == (village == 1.0) and info["seat"] == 0
        assert info["side_by_role"] == {"Villager": "Village", "Doctor": "Village", "Detective": "Village", "Mafia": "Mafia"}
        assert info["reward_by_role"] == dict(zip(env.roles, rewards))
        outcomes[info["outcome"]] += 1
    assert set(outcomes) == {"win", "loss"}  # random play: both sides win some


def test_each_agent_sees_the_game_as_the_player_it_moves_for():
    env = make(MAFIA, split="test", profile="secret_mafia")
    env.reset(options={"task_index": 5})
    rng = np.random.default_rng(1)
    for _ in range(12):
        state = env.episode
        (agent,) = env.speakers()
        view = env.private_observations()[agent]
        assert f"You are Player {state.to_move}." in view and f"Your role: {env.roles[agent]}" in view
        for other in range(env.n_agents):  # an agent not to move sees as its first player
            first = state.seat_agents.index(other)
            if other != agent:
                assert f"You are Player {first}." in env.private_observations()[other]
        assert env.kept_heads()[agent].startswith(f"Welcome to Secret Mafia! You are Player {state.to_move}.")
        env.take_turn(*random_legal(env, rng))
        env.step(env.turn_actions())


def mafia_first(tmp_path) -> str:
    """The secret_mafia agents with the Mafia first: a run that trains the Mafia follows their games."""
    from marft.envs.profile import PROFILE_DIR

    agents = json.loads((PROFILE_DIR / "secret_mafia.json").read_text())
    path = tmp_path / "mafia_first.json"
    path.write_text(json.dumps(agents[3:] + agents[:3]))
    return str(path)


def test_agents_play_the_roles_they_are_named_after_in_any_order(tmp_path):
    named, reordered = make(MAFIA, split="test", profile="secret_mafia"), make(MAFIA, split="test", profile=mafia_first(tmp_path))
    for env in (named, reordered):
        env.reset(options={"task_index": 2})
    assert reordered.roles == ("Mafia", "Villager", "Doctor", "Detective")
    assert [reordered.roles[a] for a in reordered.episode.seat_agents] == [named.roles[a] for a in named.episode.seat_agents]
    movers, rewards, info = play(reordered, 2)
    assert info["correct"] == (info["outcome_by_role"]["Mafia"] == "win") and info["side_by_role"]["Mafia"] == "Mafia"


def test_a_profile_named_otherwise_plays_the_roles_in_the_registrys_order_and_a_wrong_team_is_refused():
    named, anonymous = make(MAFIA, split="test", profile="secret_mafia"), make(MAFIA, split="test", profile="secret_mafia_anonymous")
    for env in (named, anonymous):
        env.reset(options={"task_index": 2})
    assert anonymous.game_roles == list(named.roles) and anonymous.episode.seat_agents == named.episode.seat_agents
    with pytest.raises(ValueError, match="team game: its profile has one agent per role the game deals.*not 2"):
        make(MAFIA, profile="game_seats")
    from marft.envs.profile import AgentSpec

    partly = [AgentSpec(role=role, prompt="Answer [4].", with_answer=True) for role in ("Mafia", "Villager", "Doctor", "Seer")]
    with pytest.raises(ValueError, match="named as the game's roles.*each once"):
        make(MAFIA, profile=partly)


def test_a_vote_written_with_the_players_name_reaches_every_view_as_the_game_counts_it():
    """SecretMafia counts "[Player 3]" as a vote for 3, but TextArena strips such tags from what others are shown: the
    env gives the game "[3]", so a vote cannot be hidden from the other players (nor a move differ from its record)."""
    env = make(MAFIA, split="test", profile="secret_mafia")
    env.reset(options={"task_index": 0})
    rng = np.random.default_rng(0)
    while env.episode.seat_agents[env.episode.to_move] != 3 or env.episode.to_move == -1:
        env.take_turn(*random_legal(env, rng))
        env.step(env.turn_actions())
    (agent,) = env.speakers()
    target = env.episode.legal[0][1:-1]
    env.take_turn(agent, f"I vote [Player {target}]")
    env.step(env.turn_actions())
    assert env.episode.moves[-1] == f"I vote [{target}]"
    mafia = [p for p, a in enumerate(env.episode.seat_agents) if a == 3]
    teammate_view = env._game(env.episode.game_seed, env.episode.moves).unread
    assert any(f"I vote [{target}]" in teammate_view[p] for p in mafia)


def test_a_player_moving_twice_in_a_row_by_the_rules_sees_only_what_followed_its_move():
    """In SecretMafia a player may move again at once without any retry (the day's last voter opens the night): its
    view then starts afresh, as after any move; only a forgiven invalid move keeps what the player saw."""
    env = make(MAFIA, split="test", profile="secret_mafia")
    repeats = 0
    for task in range(30):
        env.reset(options={"task_index": task})
        rng = np.random.default_rng(task)
        while not env.episode.done:
            state, (agent,) = env.episode, env.speakers()
            before = env.private_observations()[agent]
            env.take_turn(agent, state.legal[int(rng.integers(len(state.legal)))])
            env.step(env.turn_actions())
            after = env.episode
            if not after.done and after.to_move == state.to_move and after.retries == state.retries:
                repeats += 1
                assert not env.private_observations()[agent].startswith(before)
    assert repeats >= 5


def test_a_checkpointed_team_game_continues_exactly_and_transitions_are_pure():
    env = make(MAFIA, split="test", profile="secret_mafia")
    env.reset(options={"task_index": 4})
    rng = np.random.default_rng(3)
    for _ in range(7):
        env.take_turn(*random_legal(env, rng))
        env.step(env.turn_actions())
    saved = json.loads(json.dumps(env.state_dict()))
    resumed = make(MAFIA, split="test", profile="secret_mafia")
    resumed.reset(options={"task_index": 0})
    resumed.load_state_dict(saved)
    assert isinstance(resumed.episode, GameState) and resumed.episode == env.episode and resumed.speakers() == env.speakers()
    state = env.episode
    actions = tuple(state.legal[0] if a == env.speakers()[0] else "" for a in range(env.n_agents))
    assert env.transition(state, actions) == env.transition(state, actions) and env.episode == state
    for e in (env, resumed):
        e.take_turn(e.speakers()[0], state.legal[-1])
    assert resumed.step(resumed.turn_actions())[1].tolist() == env.step(env.turn_actions())[1].tolist()
    assert resumed.episode == env.episode


def test_the_random_player_moves_for_one_side_and_the_demonstrations_are_each_movers_own():
    env = make(MAFIA, split="test", profile="secret_mafia")
    env.play_randomly(["Mafia"])
    movers, _, info = play(env, 3)
    assert all(agent != 3 for agent, _ in movers) and info["outcome"] in ("win", "loss")
    assert len(info["game_moves"]) > len(movers)  # the Mafia's moves were made inside the steps
    rows = make(MAFIA, split="train", profile="secret_mafia").demonstrations(40)
    assert len(rows) == 40 and {row["turns"][0]["role"] for row in rows} == {"Villager", "Doctor", "Detective", "Mafia"}
    for row in rows:
        (turn,) = row["turns"]
        assert f"Your role: {turn['role']}" in row["private"][turn["role"]] and turn["text"].startswith("[")


@pytest.mark.slow
def test_one_side_trains_while_the_other_is_frozen(random_model_dir, tmp_path):
    """The team-game path through the trainer: MARFT-A with each agent's own turns and a critic per agent, the Village
    roles frozen (an untrained model's Mafia lose on invalid moves within the night, so the Mafia have the turns);
    only the Mafia's adapter changes."""
    from safetensors.torch import load_file

    from marft.cli.train import main

    run = tmp_path / "run"
    code = main(["--model_name_or_path", random_model_dir, "--env_name", MAFIA, "--profile_path", mafia_first(tmp_path),
                 "--algorithm_name", "APPO", "--credit_assignment", "own_turns", "--critic_mode", "per_agent",
                 "--frozen_roles", "Villager,Doctor,Detective", "--entropy_coef", "0.1", "--update_on_constant_rewards", "true",
                 "--max_new_tokens", "4", "--context_window", "1024", "--n_rollout_threads", "2", "--horizon", "8",
                 "--episode_length", "8", "--num_env_steps", "32", "--eval_episodes", "2", "--n_eval_threads", "2",
                 "--save_interval", "1", "--output_dir", str(run)])
    assert code == 0

    def adapter(step, name):
        return load_file(run / "checkpoints" / f"steps_{step}" / name / "adapter_model.safetensors")

    for name in ("villager", "doctor", "detective"):
        assert all(torch.equal(adapter(2, name)[k], adapter(1, name)[k]) for k in adapter(1, name))
    assert any(not torch.equal(adapter(2, "mafia")[k], adapter(1, "mafia")[k]) for k in adapter(1, "mafia"))
    rows = [json.loads(line) for path in (run / "transcripts").glob("eval_*.jsonl") for line in path.read_text().splitlines()]
    assert rows and all(row["side_by_role"]["Mafia"] == "Mafia" for row in rows)


@pytest.mark.parametrize("flags, message", [
    (("--profile_path", "game_seats"), "team game: its profile has one agent per role the game deals"),
    (("--opponent", "pool:2"), "a pool holds snapshots of the one trained role of a two-seat game"),
    (("--credit_assignment", "env"), "--credit_assignment own_turns"),
    (("--frozen_roles", "Villager,Doctor,Detective"), "freezes 'Villager', the profile's first role"),
])
def test_a_team_game_run_is_checked_before_the_model_loads(random_model_dir, tmp_path, capsys, monkeypatch, flags, message):
    from marft.cli.train import main

    base = {"--profile_path": "secret_mafia", "--algorithm_name": "APPO", "--credit_assignment": "own_turns",
            "--critic_mode": "per_agent", "--horizon": "64", "--episode_length": "64"}
    base.update(dict(zip(flags[::2], flags[1::2])))
    import marft.launch

    monkeypatch.setattr(marft.launch, "load_base_model", lambda *a, **k: pytest.fail("the model loaded"))
    argv = ["--model_name_or_path", random_model_dir, "--env_name", MAFIA, "--output_dir", str(tmp_path / "run"),
            *[item for pair in base.items() for item in pair]]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
