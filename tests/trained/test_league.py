"""``marft eval --league``: a round robin of a self-play run's checkpoints and the random player, rated with openskill."""

import json

import pytest

pytest.importorskip("textarena", reason="textarena is not installed (pip install -r requirements-dev.txt)")
pytest.importorskip("openskill", reason="openskill is not installed (pip install -r requirements-dev.txt)")

from marft.cli.main import main as marft  # noqa: E402
from marft.cli.train import main as train  # noqa: E402
from marft.trained.league import RANDOM, Record, interleaved, league_members, rate, tally  # noqa: E402


def test_ratings_order_members_by_their_results():
    """A beats B and C, B beats C: the ratings order A > B > C; every game counts once (draws tie)."""
    names = ["a", "b", "c"]
    records = {("a", "b"): Record(wins=8, draws=1, losses=1), ("a", "c"): Record(wins=9, losses=1), ("b", "c"): Record(wins=7, draws=3)}
    ratings = rate(names, records)
    assert ratings["a"]["mu"] > ratings["b"]["mu"] > ratings["c"]["mu"]
    assert rate(names, records) == ratings  # the same games, the same ratings
    even = rate(["x", "y"], {("x", "y"): Record(wins=5, losses=5)})
    assert abs(even["x"]["mu"] - even["y"]["mu"]) < even["x"]["sigma"] / 2  # even results: equal within the uncertainty


def test_members_and_their_refusals(tmp_path):
    with pytest.raises(ValueError, match="at least two"):
        league_members([RANDOM])
    with pytest.raises(ValueError, match="twice"):
        league_members([RANDOM, RANDOM])
    with pytest.raises(FileNotFoundError):
        league_members([RANDOM, str(tmp_path / "nothing")])


def league_of_a_run(model_dir: str, tmp_path, env_name: str, profile: str, horizon: int):
    """A short self-play run (APPO, a checkpoint every iteration), then the league of its checkpoints and the random
    player, 2 games per pairing: ``(league.json, the league's folder)``."""
    run = tmp_path / "run"
    code = train(["--model_name_or_path", model_dir, "--env_name", env_name, "--profile_path", profile,
                  "--algorithm_name", "APPO", "--credit_assignment", "own_turns", "--critic_mode", "per_agent",
                  "--max_new_tokens", "4", "--context_window", "1024", "--n_rollout_threads", "2", "--horizon", str(horizon),
                  "--episode_length", str(horizon), "--num_env_steps", "12", "--save_interval", "1", "--eval_episodes", "2",
                  "--n_eval_threads", "2", "--output_dir", str(run)])
    assert code == 0
    out = tmp_path / "league"
    assert marft(["eval", "--league", str(run), RANDOM, "--episodes", "2", "--output_dir", str(out)]) == 0
    return json.loads((out / "league.json").read_text()), out


@pytest.mark.slow
def test_a_league_of_a_self_play_runs_checkpoints_and_the_random_player(random_model_dir, tmp_path):
    result, out = league_of_a_run(random_model_dir, tmp_path, "textarena:TicTacToe-v0", "game_seats", horizon=3)
    checkpoints = [f"run/steps_{i}" for i in (1, 2)]
    assert result["members"] == checkpoints + [RANDOM] and set(result["ratings"]) == set(result["members"])
    for a in result["members"]:
        for b in result["members"]:
            if a == b:
                continue
            mine, theirs = result["matrix"][f"{a} vs {b}"], result["matrix"][f"{b} vs {a}"]
            assert mine["wins"] + mine["draws"] + mine["losses"] == 4  # 2 games per pairing of roles, 2 pairings
            assert (mine["wins"], mine["draws"], mine["losses"]) == (theirs["losses"], theirs["draws"], theirs["wins"])
    assert result["invalid_move_rate"][RANDOM] is None
    # every game an invalid move ended is charged to the member that made it: the transcripts' count, member by member
    # (the random model's replies are rarely legal, so some games end so)
    ended_by_invalid = sum(json.loads(line)["invalid_move"] for path in (out / "pairs").glob("*/*/transcripts.jsonl")
                           for line in path.read_text().splitlines())
    charged = sum(r["invalid"] for r in result["matrix"].values())
    assert charged == ended_by_invalid > 0
    assert (out / "league.png").stat().st_size > 0
    with pytest.raises(SystemExit):  # argparse: --league wants members
        marft(["eval", "--league"])


@pytest.mark.slow
def test_a_team_games_league_pairs_sides(random_model_dir, tmp_path):
    """SecretMafia: each pair plays one member's Village against the other's Mafia and the reverse; the second member's
    adapters play its side (loaded from its checkpoint), and the games are charged by side."""
    result, out = league_of_a_run(random_model_dir, tmp_path, "textarena:SecretMafia-v0", "secret_mafia", horizon=6)
    run = tmp_path / "run"
    assert result["members"] == ["run/steps_1", RANDOM]
    mine, theirs = result["matrix"][f"run/steps_1 vs {RANDOM}"], result["matrix"][f"{RANDOM} vs run/steps_1"]
    assert mine["wins"] + mine["draws"] + mine["losses"] == 4 and (mine["wins"], mine["losses"]) == (theirs["losses"], theirs["wins"])
    village, mafia = ["Villager", "Doctor", "Detective"], ["Mafia"]
    for index, own_first in enumerate(["Villager", "Mafia"]):  # sides in sorted order: the random player plays the Mafia first
        summary = json.loads((out / "pairs" / "0-1" / str(index) / "summary.json").read_text())
        assert summary["games"]["role"] == own_first  # the member's side is the one the random player does not play
        games = [json.loads(line) for line in (out / "pairs" / "0-1" / str(index) / "transcripts.jsonl").read_text().splitlines()]
        assert all(set(g["outcome_by_role"]) == set(village + mafia) and "invalid_roles" in g for g in games)
    from marft.trained.evaluate import evaluate
    with pytest.raises(ValueError, match="not all"):
        evaluate(run, episodes=1, output_dir=tmp_path / "bad", progress=False, versus_checkpoint=run,
                 versus_role="Villager,Doctor,Detective,Mafia")


def test_outcomes_are_spread_over_the_games():
    assert interleaved({"win": 2, "draw": 0, "loss": 2}) == ["win", "loss", "win", "loss"]
    spread = interleaved({"win": 6, "draw": 2, "loss": 2})
    assert sorted(spread) == sorted(["win"] * 6 + ["draw"] * 2 + ["loss"] * 2) and spread[-3:] != ["loss", "loss", "draw"]


def test_a_tally_counts_each_sides_outcomes_and_its_own_invalid_losses():
    games = [{"outcome_by_role": {"A": "win", "B": "loss"}, "invalid_by": "B", "invalid_roles": ["B"]},
             {"outcome_by_role": {"A": "draw", "B": "draw"}, "invalid_by": "", "invalid_roles": []},
             {"outcome_by_role": {"A": "unfinished", "B": "unfinished"}, "invalid_by": "", "invalid_roles": []},
             {"outcome_by_role": {"A": "loss", "B": "win"}, "invalid_by": "A", "invalid_roles": ["A"]}]
    a, b = Record(), Record()
    tally(games, ["A"], a)
    tally(games, ["B"], b)
    assert (a.wins, a.draws, a.losses, a.invalid) == (1, 2, 1, 1)
    assert (b.wins, b.draws, b.losses, b.invalid) == (1, 2, 1, 1) and a.games == b.games == 4


def test_a_team_games_tally_is_by_side_and_counts_any_of_its_roles_invalid_moves():
    """A side of several roles shares its outcome; a game in which any of its roles had a player eliminated for an
    invalid move counts once, whichever role ``invalid_by`` (the first in profile order) names."""
    village, mafia = ["Villager", "Doctor", "Detective"], ["Mafia"]
    games = [{"outcome_by_role": {**dict.fromkeys(village, "win"), "Mafia": "loss"}, "invalid_by": "Villager", "invalid_roles": ["Villager", "Mafia"]},
             {"outcome_by_role": {**dict.fromkeys(village, "loss"), "Mafia": "win"}, "invalid_by": "Doctor", "invalid_roles": ["Doctor", "Detective"]},
             {"outcome_by_role": {**dict.fromkeys(village, "loss"), "Mafia": "win"}, "invalid_by": "", "invalid_roles": []}]
    v, m = Record(), Record()
    tally(games, village, v)
    tally(games, mafia, m)
    assert (v.wins, v.losses, v.invalid) == (1, 2, 2) and (m.wins, m.losses, m.invalid) == (2, 1, 1)
