"""scripts/tictactoe_expert.py: the best player against the random-legal-move player, and its demonstrations."""

import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("tictactoe_expert", ROOT / "scripts" / "tictactoe_expert.py")
expert = importlib.util.module_from_spec(spec)
spec.loader.exec_module(expert)


def test_random_play_matches_the_known_exact_figures():
    """Random against random: the first player wins 737/1260 of games, the second 363/1260 (the classic count)."""
    random = expert.SIMPLE_POLICIES["random"]
    assert expert.policy_win_rate(random, 0) == pytest.approx(737 / 1260, abs=1e-12)
    assert expert.policy_win_rate(random, 1) == pytest.approx(363 / 1260, abs=1e-12)


def simulate(policy, me: int, games: int, rng) -> float:
    """A plain reference: play the games out, the opponent uniformly random."""
    wins = 0
    for _ in range(games):
        board, to_move = (0,) * 9, 0
        while not expert.winner(board) and expert.empty_cells(board):
            options = policy(board, me) if to_move == me else expert.empty_cells(board)
            board = expert.play(board, options[rng.integers(len(options))], to_move)
            to_move = 1 - to_move
        wins += expert.winner(board) == me + 1
    return wins / games


@pytest.mark.parametrize("name", ["fixed order", "win, else block", "best"])
def test_exact_win_rates_agree_with_played_out_games(name):
    policy, rng = expert.SIMPLE_POLICIES[name], np.random.default_rng(0)
    for me in (0, 1):
        exact = expert.policy_win_rate(policy, me)
        assert simulate(policy, me, 4000, rng) == pytest.approx(exact, abs=0.025)  # 4000 games: ~3.5 standard errors


def test_the_best_player_is_at_least_as_good_as_every_other_policy_from_every_position():
    best = expert.SIMPLE_POLICIES["best"]
    for me in (0, 1):
        assert expert.policy_win_rate(best, me) == pytest.approx(expert.win_probability((0,) * 9, 0, me))
        for name, policy in expert.SIMPLE_POLICIES.items():
            assert expert.policy_win_rate(policy, me) <= expert.policy_win_rate(best, me) + 1e-12, name
    # from a position where one move wins at once, that move is the only best one (seat 0: O on 0 and 1, X on 3 and 4)
    assert expert.best_cells((1, 1, 0, 2, 2, 0, 0, 0, 0), 0) == [2]


@pytest.mark.parametrize("view", ["since_move", "board"])
def test_demonstrations_are_the_best_move_of_the_position_the_prompt_shows(tmp_path, view):
    pytest.importorskip("textarena", reason="textarena is not installed (pip install -r requirements-dev.txt)")
    out = tmp_path / "expert.jsonl"
    result = expert.main(["--demonstrations", "40", "--out", str(out), "--game_view", view])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert result["demonstrations"] == len(rows) == 40
    boards_shown = {row["problem"].count("Current Board:") for row in rows}
    assert (boards_shown == {1}) if view == "board" else (2 in boards_shown)
    assert result["win_rate_against_random"]["best"]["both"] == pytest.approx(0.9667, abs=1e-4)
    for row in rows:
        problem, (turn,) = row["problem"], row["turns"]
        seat = int(re.search(r"You are Player (\d)", problem).group(1))
        latest = problem.rsplit("Current Board:", 1)[1].split("Available Moves:")[0]
        cells = re.findall(r"^ (\S) \| (\S) \| (\S) $", latest, flags=re.M)
        marks = [mark for line in cells for mark in line]  # the board as the prompt shows it: digits free, O player 0, X player 1
        board = tuple(0 if mark.isdigit() else {"O": 1, "X": 2}[mark] for mark in marks)
        assert len(board) == 9
        assert turn["role"] == "Player" and re.fullmatch(r"\[\d\]", turn["text"])
        assert int(turn["text"][1]) in expert.best_cells(board, seat)
        assert f"'{turn['text']}'" in problem.rsplit("Available Moves:", 1)[1]  # legal in the prompt's own list
