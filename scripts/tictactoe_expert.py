"""Tic-Tac-Toe's best player against the random-legal-move player, and demonstrations of it.

    python scripts/tictactoe_expert.py                                   # the best win rate per seat, and simple policies'
    python scripts/tictactoe_expert.py --demonstrations 6000 --out expert.jsonl
    marft sft --env_name textarena:TicTacToe-v0 --sft_data expert.jsonl ...   # can the model imitate it?
    python scripts/tictactoe_expert.py --grade runs/ttt_expert --sft_data expert.jsonl   # where does it go wrong?
    python scripts/tictactoe_expert.py --games runs/ttt_rl/eval/steps_200/test-n1/transcripts.jsonl   # in its own games?

The opponent of ``textarena:TicTacToe-v0`` plays uniformly random legal moves, so the best reply is the one that
maximises the probability of winning against it (expectimax over the opponent's moves, not minimax). The
demonstrations are that best player's moves (one of the best at random where several tie) in the games it plays
against the env's own random opponent, each prompted exactly as training prompts that move (rows for ``marft sft
--sft_data``): a warm start that shows the model the answer. What a model reaches when imitating them bounds what it
can represent of the game (docs/results/tictactoe-notes.md: "Is the model too small?").

``--grade CHECKPOINT`` scores a trained player position by position: on the positions the best player meets in fresh
games against the random player (``--grade_seed``, ``--positions``), how often the checkpoint's most likely move is one
of the best, the probability it gives the best moves, and the win probability its most likely move gives away; split
by seat and, with ``--sft_data``, into positions its warm-start rows showed (``seen``) and the others (``unseen``).
Each move's probability is that of its reply as the warm start scores it (:func:`marft.sft.reply_nll`), normalised
over the nine cells. A model that imitates well but misses unseen positions generalises poorly; one that misses the
positions it was trained on has not fitted them.

``--games TRANSCRIPTS`` scores the moves a player made in its own games (a ``transcripts.jsonl`` or
``greedy_transcripts.jsonl`` of ``marft eval`` on Tic-Tac-Toe, whose games list every move): per seat, ``takes_win``
(of the positions where a move completes its line, the share where it did), ``blocks`` (of the positions where it
could not win at once but the opponent could next, the share where it took the opponent's cell; ``best_blocks``, the
share where one of the best player's moves does), ``value_lost`` (the mean win probability its moves gave away
against the best move, over the moves the game took) and ``invalid_tries`` (its moves onto a taken cell or unreadable,
per game).

Prints ONE line of JSON: the best and simple policies' win rates per seat and over both seats (and, with
``--demonstrations``, the rows written; with ``--grade``, the checkpoint's figures; with ``--games``, the games').
"""

from __future__ import annotations

import argparse
import functools
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from marft.choices import GAME_VIEWS

if TYPE_CHECKING:
    import torch

LINES = ((0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6))
"""The eight lines of three cells."""

PREFERENCE = (4, 0, 2, 6, 8, 1, 3, 5, 7)
"""The fixed-order policy's cells: centre, corners, edges."""

Board = tuple[int, ...]
"""Nine cells: 0 empty, 1 + the id of the player whose mark it is (player 0 moves first)."""


def winner(board: Board) -> int:
    """1 + the id of the player with three in a row, else 0."""
    for a, b, c in LINES:
        if board[a] and board[a] == board[b] == board[c]:
            return board[a]
    return 0


def empty_cells(board: Board) -> list[int]:
    return [cell for cell in range(9) if not board[cell]]


def play(board: Board, cell: int, player: int) -> Board:
    return board[:cell] + (player + 1,) + board[cell + 1:]


@functools.cache
def win_probability(board: Board, to_move: int, me: int) -> float:
    """P(``me`` wins) from ``board`` with ``to_move`` to move, ``me`` playing its best, the other uniformly at random."""
    if winner(board):
        return float(winner(board) == me + 1)
    cells = empty_cells(board)
    if not cells:
        return 0.0
    values = [win_probability(play(board, cell, to_move), 1 - to_move, me) for cell in cells]
    return max(values) if to_move == me else sum(values) / len(values)


def best_cells(board: Board, me: int) -> list[int]:
    """The cells that maximise ``me``'s probability of winning (``me`` to move)."""
    values = {cell: win_probability(play(board, cell, me), 1 - me, me) for cell in empty_cells(board)}
    best = max(values.values())
    return [cell for cell, value in values.items() if value > best - 1e-12]


def completing(board: Board, player: int) -> list[int]:
    """Empty cells that complete a line of ``player``'s two marks."""
    cells = set()
    for line in LINES:
        marks = [board[c] for c in line]
        if marks.count(player + 1) == 2 and 0 in marks:
            cells.add(line[marks.index(0)])
    return sorted(cells)


def first_free(board: Board) -> list[int]:
    """The fixed order's move: the first empty cell of :data:`PREFERENCE`."""
    return [next(c for c in PREFERENCE if not board[c])]


SIMPLE_POLICIES = {
    "random": lambda board, me: empty_cells(board),
    "win when it can": lambda board, me: completing(board, me) or empty_cells(board),
    "win, else block": lambda board, me: completing(board, me) or completing(board, 1 - me) or empty_cells(board),
    "fixed order": lambda board, me: first_free(board),
    "win, else fixed order": lambda board, me: completing(board, me) or first_free(board),
    "win, else block, else fixed order": lambda board, me: completing(board, me) or completing(board, 1 - me) or first_free(board),
    "best": best_cells,
}
"""Policies by name: the cells among which each picks uniformly at random."""


def policy_win_rate(policy, me: int, board: Board = (0,) * 9, to_move: int = 0) -> float:
    """Exact P(``me`` wins) playing ``policy`` against the uniformly random player."""
    if winner(board):
        return float(winner(board) == me + 1)
    cells = empty_cells(board)
    if not cells:
        return 0.0
    options = policy(board, me) if to_move == me else cells
    return sum(policy_win_rate(policy, me, play(board, cell, to_move), 1 - to_move) for cell in options) / len(options)


def board_of(moves: tuple[str, ...]) -> Board:
    """The board after a game's moves (every one legal: player 0's first, then alternating)."""
    board = (0,) * 9
    for k, move in enumerate(moves):
        board = play(board, int(move.strip().strip("[]")), k % 2)
    return board


def board_in_prompt(problem: str) -> tuple[Board, int]:
    """``(board, seat)`` of the latest board a demonstration's prompt shows (digits are free cells, O is player 0's
    mark, X player 1's) and the seat it asks to move."""
    seat = int(re.search(r"You are Player (\d)", problem).group(1))
    latest = problem.rsplit("Current Board:", 1)[1].split("Available Moves:")[0]
    marks = [mark for line in re.findall(r"^ (\S) \| (\S) \| (\S) $", latest, flags=re.M) for mark in line]
    if len(marks) != 9:
        raise ValueError(f"no 3x3 board in the prompt's latest 'Current Board:' ({len(marks)} cells)")
    return tuple(0 if mark.isdigit() else {"O": 1, "X": 2}[mark] for mark in marks), seat


def demonstrations(n: int, seed: int = 0, view: str = "since_move") -> list[dict]:
    """``n`` one-move rows of the best player against ``textarena:TicTacToe-v0``'s random opponent (training split,
    both seats), each prompted as training prompts that move (with ``--game_view view``)."""
    from marft.envs.textarena.env import TextArenaEnv

    env, rng = TextArenaEnv("TicTacToe-v0", view=view), np.random.default_rng(seed)
    env.reset(seed=seed)

    def best_move(state) -> str:
        move = f"[{rng.choice(best_cells(board_of(state.moves), state.seat))}]"
        if move not in state.legal:
            raise AssertionError(f"the best player's {move} is not among the game's legal moves {state.legal}")
        return move

    return env.demonstrations(n, choose=best_move)


def move_value(board: Board, cell: int, me: int) -> float:
    """P(``me`` wins) after ``me`` plays ``cell`` (then the best player against random); an occupied cell loses."""
    return 0.0 if board[cell] else win_probability(play(board, cell, me), 1 - me, me)


def cell_log_probs(checkpoint: str, problems: list[str], batch_positions: int = 16, heads: dict[str, str] | None = None) -> torch.Tensor:
    """``(N, 9)``: log-probabilities of the replies ``[0]`` … ``[8]`` to each prompt under ``checkpoint``'s player,
    each reply scored as the warm start scores it (:func:`marft.sft.reply_nll`: its tokens as the team samples them,
    cut to ``--max_new_tokens``), normalised over the nine; ``heads``: per problem, its demonstration's
    ``kept_heads`` (the rules a cut prompt keeps)."""
    heads = heads or {}
    import torch

    from marft.sft import reply_nll, turn_examples
    from marft.trained.evaluate import checkpoint_config, load_team

    config, path = checkpoint_config(checkpoint)
    team, profile, _ = load_team(config, path)
    if len(profile) != 1:
        raise ValueError(f"--grade scores a one-agent player (--profile_path game_player); {checkpoint} is a team of {len(profile)}")
    role = profile[0].role
    rows = [{"problem": problem, "kept_heads": {role: heads.get(problem, "")}, "turns": [{"role": role, "text": f"[{cell}]"}]}
            for problem in problems for cell in range(9)]
    examples = turn_examples(team.prompts, rows, eos_id=team.eos_id, max_reply_tokens=config.model.max_new_tokens)
    adapter, scores = team.agent_adapters[0], []
    with torch.no_grad():
        for start in range(0, len(examples), 9 * batch_positions):
            batch = examples[start:start + 9 * batch_positions]
            per_token = reply_nll(team, adapter, batch, reduction="none").float().cpu()  # (sum of reply lengths,)
            reply_of_token = torch.repeat_interleave(torch.arange(len(batch)), torch.tensor([len(e.reply_ids) for e in batch]))
            per_reply = -torch.zeros(len(batch)).index_add_(0, reply_of_token, per_token)  # (B,): each reply's log-prob
            scores.append(per_reply.view(-1, 9))
    team.set_active(None)
    return torch.log_softmax(torch.cat(scores), dim=-1)  # (N, 9)


def grade(checkpoint: str, positions: int, seed: int, sft_data: str | None = None) -> dict:
    """The checkpoint's play on the positions the best player meets (``positions`` moves of fresh games, seed
    ``seed``, in the checkpoint's ``--game_view``), compared with the best moves: per group of positions (all, each
    seat, ``seen``/``unseen`` in ``sft_data``'s prompts), ``argmax_best`` (share where its most likely move is a
    best one), ``p_best`` (mean probability on the best moves), ``value_lost`` (mean win probability its most
    likely move gives away; an occupied cell loses the game) and ``p_taken`` (mean probability on occupied cells);
    ``takes_win``, the share of the ``win_positions`` (where a move completes its line) where its most likely move
    does, and ``blocks``, of the ``block_positions`` (where it cannot win at once but the opponent could next) where
    its most likely move takes the opponent's winning cell (None where a group has no such position)."""
    from marft.trained.evaluate import checkpoint_config

    config = checkpoint_config(checkpoint)[0]
    if config.env.env_name.removeprefix("textarena:").split("-")[0] != "TicTacToe":
        raise ValueError(f"--grade scores Tic-Tac-Toe players; {checkpoint} trained on {config.env.env_name}")
    view = config.env.game_view
    rows = demonstrations(positions, seed, view)
    heads = {row["problem"]: next(iter(row.get("kept_heads", {}).values()), "") for row in rows}
    problems = sorted(heads)
    seen = {json.loads(line)["problem"] for line in Path(sft_data).read_text().splitlines() if line.strip()} if sft_data else set()
    log_probs = cell_log_probs(checkpoint, problems, heads=heads)  # (N, 9)
    groups: dict[str, list[tuple]] = {}
    for problem, row in zip(problems, log_probs.exp()):
        board, seat = board_in_prompt(problem)
        best, chosen = best_cells(board, seat), int(row.argmax())
        figures = (float(chosen in best), float(row[best].sum()), move_value(board, best[0], seat) - move_value(board, chosen, seat),
                   float(sum(row[c] for c in range(9) if board[c])), *took_win_or_blocked(board, seat, chosen))
        names = ["all", f"seat_{seat}"] + ([("seen" if problem in seen else "unseen")] if sft_data else [])
        for name in names:
            groups.setdefault(name, []).append(figures)
    return {name: _grade_figures(rows) for name, rows in sorted(groups.items())}


def _grade_figures(rows: list[tuple]) -> dict:
    """A group's figures: the means over its positions, and ``takes_win`` / ``blocks`` over the positions they concern."""
    figures: dict = {"positions": len(rows)}
    for i, key in enumerate(("argmax_best", "p_best", "value_lost", "p_taken")):
        figures[key] = round(float(np.mean([r[i] for r in rows])), 4)
    for i, (count, key) in enumerate((("win_positions", "takes_win"), ("block_positions", "blocks")), start=4):
        concerned = [r[i] for r in rows if r[i] is not None]
        figures[count], figures[key] = len(concerned), round(float(np.mean(concerned)), 4) if concerned else None
    return figures


def took_win_or_blocked(board: Board, me: int, cell: int) -> tuple[float | None, float | None]:
    """``(took_win, blocked)`` of ``me`` playing ``cell``: 1.0 / 0.0 where the position offers a line to complete
    (``took_win``), or else the opponent has one to block (``blocked``); None where it does not concern the move."""
    wins, threats = completing(board, me), completing(board, 1 - me)
    return (float(cell in wins) if wins else None), (float(cell in threats) if threats and not wins else None)


def cell_of(move: str, board: Board) -> int | None:
    """The free cell a move names (``[4]``, read as TextArena's Tic-Tac-Toe reads it), or None: an invalid try (no
    ``[digits]``, off the board, or taken)."""
    found = re.search(r"\[\s*(\d+)\s*\]", move)
    cell = int(found.group(1)) if found else -1
    return cell if 0 <= cell < 9 and not board[cell] else None


def game_mistakes(path: str) -> dict:
    """Per seat, how the player of ``path``'s games (transcripts of ``marft eval``) played its own positions."""
    tally: dict[str, dict[str, list[float]]] = {}
    for line in Path(path).read_text().splitlines():
        game = json.loads(line) if line.strip() else None
        if game is None:
            continue
        if "game_moves" not in game:
            raise ValueError(f"{path}: a game without 'game_moves' (transcripts of marft eval on Tic-Tac-Toe, from a marft that records them)")
        seat, board, mover = game["seat"], (0,) * 9, 0
        figures = tally.setdefault(f"seat_{seat}", {"takes_win": [], "blocks": [], "best_blocks": [], "value_lost": [], "invalid_tries": []})
        tries = 0
        for move in game["game_moves"]:
            cell = cell_of(move, board)
            if mover == seat and cell is None:
                tries += 1
            elif mover == seat:  # a move the game took: scored against the position it was made in
                best = best_cells(board, seat)
                took_win, blocked = took_win_or_blocked(board, seat, cell)
                for key, value in (("takes_win", took_win), ("blocks", blocked)):
                    if value is not None:
                        figures[key].append(value)
                if blocked is not None:
                    figures["best_blocks"].append(float(bool(set(best) & set(completing(board, 1 - seat)))))
                figures["value_lost"].append(move_value(board, best[0], seat) - move_value(board, cell, seat))
            if cell is not None:
                board, mover = play(board, cell, mover), 1 - mover
        figures["invalid_tries"].append(float(tries))
    return {name: {"games": len(f["invalid_tries"]), "positions_to_win": len(f["takes_win"]), "positions_to_block": len(f["blocks"]),
                   **{key: round(float(np.mean(values)), 4) if values else None for key, values in f.items()}}
            for name, f in sorted(tally.items())}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--demonstrations", type=int, default=0, help="write this many rows of the best player's moves")
    p.add_argument("--out", default="tictactoe_expert.jsonl", help="where the rows go (JSONL, for marft sft --sft_data)")
    p.add_argument("--seed", type=int, default=0, help="games and the choice among tied best moves")
    p.add_argument("--game_view", default="since_move", choices=tuple(GAME_VIEWS),
                   help="the rows' prompts: as marft train --game_view prompts a move (train with the same)")
    p.add_argument("--grade", metavar="CHECKPOINT", help="score this checkpoint (or run directory) move by move against the best player")
    p.add_argument("--positions", type=int, default=2000, help="--grade: moves of the best player's games to draw positions from")
    p.add_argument("--grade_seed", type=int, default=1, help="--grade: the games' seed (the demonstrations' --seed is 0 by default, "
                   "so another seed gives positions partly unseen)")
    p.add_argument("--sft_data", help="--grade: the warm start's rows, to split the positions into seen and unseen")
    p.add_argument("--games", metavar="TRANSCRIPTS", help="score the moves of marft eval's games (its transcripts.jsonl) position by position")
    args = p.parse_args(argv)
    if args.positions < 1:
        p.error("--positions must be at least 1")
    games = {}
    if args.games:  # read first: a bad file stops before the exact win rates are computed
        try:
            games = {"games": {"transcripts": args.games, **game_mistakes(args.games)}}
        except (OSError, ValueError) as error:  # a missing file, transcripts without game_moves: one line, exit 2
            p.error(str(error))
    figures = {}
    for name, policy in SIMPLE_POLICIES.items():
        seats = [policy_win_rate(policy, me) for me in (0, 1)]
        figures[name] = {"seat_0": round(seats[0], 4), "seat_1": round(seats[1], 4), "both": round(sum(seats) / 2, 4)}
    result = {"win_rate_against_random": figures}
    if args.demonstrations:
        rows = demonstrations(args.demonstrations, args.seed, args.game_view)
        Path(args.out).write_text("".join(json.dumps(row) + "\n" for row in rows))
        result.update(demonstrations=len(rows), out=args.out)
    if args.grade:
        result["grade"] = {"checkpoint": args.grade, **grade(args.grade, args.positions, args.grade_seed, args.sft_data)}
    result.update(games)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
