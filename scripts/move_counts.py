"""What a trained game player replies: counts over the held-out games of one evaluation of a run.

    python scripts/move_counts.py RUN_DIR --iteration 100 --pattern '\\[\\d 1\\]'

Reads ``RUN_DIR/transcripts/eval_<iteration>.jsonl`` (the games a training run evaluates at that iteration; the last
one by default) or, given a file, that transcript file (``marft eval``'s ``transcripts.jsonl``). Prints one line of
JSON: the replies, the share of them that start with a match of ``--pattern`` (a regular expression, as a game reads a
move: ``[2 1]]]`` starts with ``[2 1]``), the most common replies, and the last move of each game ended by an invalid
move, most common first.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path


def transcript_file(path: Path, iteration: int | None) -> Path:
    """``path`` itself if it is a file, else a run's ``transcripts/eval_<iteration>.jsonl`` (the latest by default).

    Raises:
        FileNotFoundError: no such evaluation."""
    if path.is_file():
        return path
    evaluations = {int(p.stem.split("_")[1]): p for p in (path / "transcripts").glob("eval_*.jsonl")}
    if not evaluations or (iteration is not None and iteration not in evaluations):
        raise FileNotFoundError(f"{path}: no evaluation {'at iteration ' + str(iteration) if iteration is not None else ''} in "
                                f"transcripts/ (found iterations {sorted(evaluations)})")
    return evaluations[max(evaluations) if iteration is None else iteration]


def move_counts(games: list[dict], pattern: str | None = None, top: int = 5) -> dict:
    """The counts the script prints (see its docstring) over ``games``, transcript records of one evaluation."""
    replies = [turn["text"].strip() for game in games for step in game["steps"] for turn in step]
    ended = Counter(game["game_moves"][-1].strip() for game in games if game.get("invalid_move"))
    result = {"games": len(games), "replies": len(replies), "most_common": Counter(replies).most_common(top),
              "ended_by_invalid_move": sum(ended.values()), "invalid_last_moves": ended.most_common(top)}
    if pattern is not None:
        matched = sum(bool(re.match(pattern, reply)) for reply in replies)
        result["pattern"], result["pattern_share"] = pattern, round(matched / len(replies), 3) if replies else None
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, help="a run directory, or a transcripts file")
    parser.add_argument("--iteration", type=int, help="the evaluation at this iteration (a run directory; default: the last)")
    parser.add_argument("--pattern", help="a regular expression: the share of replies that start with a match")
    parser.add_argument("--top", type=int, default=5, help="how many of the most common replies and last moves to list")
    args = parser.parse_args(argv)
    path = transcript_file(args.path, args.iteration)
    games = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    result = {"transcripts": str(path), **move_counts(games, args.pattern, args.top)}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
