"""``scripts/team_game_benchmark.py``: the team-game recipe as its commands, and the trained side's figures."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import team_game_benchmark  # noqa: E402

pytest.importorskip("textarena", reason="textarena is not installed (pip install -r requirements-dev.txt)")


def test_side_wins_weighs_each_side_by_its_games():
    games = {"role": "Villager", "side_Village": {"win": 0.25, "games": 4}, "invalid_move_rate": 0.5}
    assert team_game_benchmark.side_wins(games) == pytest.approx(0.25)


def test_the_steps_are_the_guides_commands_with_the_training_flags_on_marft_train_only():
    args, extra = team_game_benchmark.parse_args(["--seed", "2", "--output_dir", "out", "--invalid_move_penalty", "1"])
    steps = team_game_benchmark.commands(args, extra)
    assert list(steps) == ["sft", "before_vs_frozen", "before_vs_random", "train", "after_vs_frozen", "after_vs_random"]
    assert "--invalid_move_penalty" in steps["train"] and not any("--invalid_move_penalty" in s for n, s in steps.items() if n != "train")
    assert steps["sft"][steps["sft"].index("--seed") + 1] == "2" == steps["train"][steps["train"].index("--seed") + 1]
    assert steps["train"][steps["train"].index("--frozen_roles") + 1] == "Mafia"
    assert steps["after_vs_random"][steps["after_vs_random"].index("--versus_random") + 1] == "Mafia"
    assert "--versus_random" not in steps["after_vs_frozen"]
    guide = " ".join((ROOT / "docs" / "games.md").read_text().replace("\\\n", " ").split())
    assert " ".join(team_game_benchmark.TEAM_FLAGS.split()) in guide, "the script's flags are the guide's $TEAM"


def test_the_random_baseline_plays_random_legal_moves_for_every_player(capsys):
    result = team_game_benchmark.main(["--random_baseline", "--episodes", "6"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    assert result["role"] == "Villager" and 0 <= result["win"] <= 1 and result["mean_moves"] > 4
    again = team_game_benchmark.random_baseline("textarena:SecretMafia-v0", "secret_mafia", 6)
    assert again == result  # seeded by the game


def test_the_vote_count_replays_each_game_and_judges_every_vote_by_the_voters_side(tmp_path, capsys):
    from marft.envs import make

    env = make("textarena:SecretMafia-v0", split="test", profile="secret_mafia")
    env.reset(options={"task_index": 1})
    votes, judged = 0, {"own_side": 0, "other_side": 0, "no_living_player": 0}
    while not env.episode.done:
        state, (agent,) = env.episode, env.speakers()
        game = env._game(state.game_seed, state.moves)
        roles, phase = game.base.player_roles, game.base.phase.value
        move = "[7]" if len(state.moves) % 5 == 0 else state.legal[len(state.moves) % len(state.legal)]  # [7]: nobody
        if phase in ("Night-Mafia", "Day-Voting"):
            votes += 1
            target = int(move[1:-1])
            mafia_voter = roles[game.current_player] == "Mafia"
            alive = game.base.state.game_state["alive_players"]
            judged["no_living_player" if target not in alive else "own_side" if (roles[target] == "Mafia") == mafia_voter
                   else "other_side"] += 1
        env.take_turn(agent, move)
        *_, info = env.step(env.turn_actions())
    path = tmp_path / "transcripts.jsonl"
    path.write_text(json.dumps({"task": 1, "game_moves": info["game_moves"]}) + "\n")
    result = team_game_benchmark.main(["--votes", str(path)])
    counts = {k: v for k, v in result.items() if "/" in k}
    assert sum(counts.values()) == votes > 0
    for verdict, n in judged.items():
        assert sum(v for k, v in counts.items() if k.endswith("/" + verdict)) == n


@pytest.mark.slow
def test_the_json_line_holds_the_trained_sides_win_rates_from_its_evaluation_games(random_model_dir, tmp_path, capsys):
    out = tmp_path / "team"
    result = team_game_benchmark.main(["--model_name_or_path", random_model_dir, "--sft_steps", "2", "--n_demonstrations", "16",
                                       "--n_rollout_threads", "2", "--num_env_steps", "128", "--episodes", "4", "--output_dir", str(out),
                                       "--eval_episodes", "2", "--n_eval_threads", "2"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    for name in ("before_vs_frozen", "before_vs_random", "after_vs_frozen", "after_vs_random"):
        games = [json.loads(line) for line in (out / "eval" / name / "transcripts.jsonl").read_text().splitlines()]
        assert len(games) == 4 and all(g["side_by_role"]["Villager"] == "Village" for g in games)
        assert result[name] == pytest.approx(sum(g["outcome_by_role"]["Villager"] == "win" for g in games) / 4, abs=1e-4)
    assert json.loads((out / "rl" / "config.json").read_text())["algo"]["frozen_roles"] == "Mafia"
