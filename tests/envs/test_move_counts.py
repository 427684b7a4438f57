"""scripts/move_counts.py: what a trained game player replies, counted from an evaluation's transcripts."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import move_counts  # noqa: E402


def game(replies, invalid=False):
    """A one-agent game's transcript record: one reply per step; an invalid game ends on its last reply."""
    return {"steps": [[{"role": "Player", "text": r}] for r in replies], "game_moves": list(replies), "invalid_move": invalid}


GAMES = [game(["[2 1]", "[2 1]]]", "[0 3]"]), game(["[1 1]", " [c"], invalid=True), game(["[2 1]", "[c"], invalid=True)]


def test_the_counts_and_the_share_of_replies_that_start_with_the_pattern():
    result = move_counts.move_counts(GAMES, pattern=r"\[\d 1\]", top=2)
    assert result["games"] == 3 and result["replies"] == 7
    assert result["most_common"] == [("[2 1]", 2), ("[c", 2)]  # replies are stripped: " [c" is "[c"
    assert result["pattern_share"] == round(4 / 7, 3)  # [2 1], [2 1]]] (a stray tail), [1 1], [2 1]; not [0 3] or [c
    assert result["ended_by_invalid_move"] == 2 and result["invalid_last_moves"] == [("[c", 2)]
    assert "pattern_share" not in move_counts.move_counts(GAMES)


def test_a_run_directory_reads_the_asked_or_the_last_evaluation(tmp_path, capsys):
    (tmp_path / "transcripts").mkdir()
    for iteration, games in ((0, GAMES[:1]), (100, GAMES), (25, GAMES[1:])):
        (tmp_path / "transcripts" / f"eval_{iteration}.jsonl").write_text("".join(json.dumps(g) + "\n" for g in games))
    assert move_counts.main([str(tmp_path)])["games"] == 3  # iteration 100, the last, not the last written
    assert move_counts.main([str(tmp_path), "--iteration", "0"])["games"] == 1
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["transcripts"].endswith("eval_0.jsonl")
    assert move_counts.main([str(tmp_path / "transcripts" / "eval_25.jsonl")])["games"] == 2
    with pytest.raises(FileNotFoundError, match=r"no evaluation at iteration 50 .*found iterations \[0, 25, 100\]"):
        move_counts.main([str(tmp_path), "--iteration", "50"])
