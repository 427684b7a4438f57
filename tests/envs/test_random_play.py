"""scripts/random_play.py: the random-against-random baseline of a two-player game, from its legal moves only."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("textarena", reason="textarena is not installed (pip install -r requirements-dev.txt)")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import random_play  # noqa: E402


@pytest.mark.parametrize("game", ["ConnectFour-v0", "Nim-v0", "TicTacToe-v0"])
def test_random_play_finishes_every_game_with_legal_moves_only(game):
    """Every game ends with a winner or a draw, the rates add up, and a game replays the same from its seed."""
    result = random_play.main(["--game", game, "--games", "12"])
    assert result["first_player_wins"] + result["second_player_wins"] + result["draws"] == pytest.approx(1.0)
    assert result["over_both_seats"] == pytest.approx((result["first_player_wins"] + result["second_player_wins"]) / 2)
    assert random_play.main(["--game", game, "--games", "12"]) == result
    for seed in range(3):
        assert set(random_play.play(game, seed)) == {0, 1}


def test_a_game_whose_moves_cannot_be_known_is_refused():
    with pytest.raises(SystemExit, match="no legal moves known"):
        random_play.play("SimpleNegotiation-v0", 0)
