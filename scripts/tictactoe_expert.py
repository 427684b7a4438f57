"""Tic-Tac-Toe's best player against the random-legal-move player, and demonstrations of it.

    python scripts/tictactoe_expert.py                                   # the best win rate per seat, and simple policies'
    python scripts/tictactoe_expert.py --demonstrations 6000 --out expert.jsonl
    marft sft --env_name textarena:TicTacToe-v0 --sft_data expert.jsonl ...   # can the model imitate it?

The opponent of ``textarena:TicTacToe-v0`` plays uniformly random legal moves, so the best reply is the one that
maximises the probability of winning against it (expectimax over the opponent's moves, not minimax). The
demonstrations are that best player's moves (one of the best at random where several tie) in the games it plays
against the env's own random opponent, each prompted exactly as training prompts that move (rows for ``marft sft
--sft_data``): a warm start that shows the model the answer. What a model reaches when imitating them bounds what it
can represent of the game (docs/games.md: "Is the model too small?").

Prints ONE line of JSON: the best and simple policies' win rates per seat and over both seats (and, with
``--demonstrations``, the rows written).
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import numpy as np

from marft.choices import GAME_VIEWS

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


SIMPLE_POLICIES = {
    "random": lambda board, me: empty_cells(board),
    "win when it can": lambda board, me: completing(board, me) or empty_cells(board),
    "win, else block": lambda board, me: completing(board, me) or completing(board, 1 - me) or empty_cells(board),
    "fixed order": lambda board, me: [next(c for c in PREFERENCE if not board[c])],
    "win, else block, else fixed order": lambda board, me: (completing(board, me) or completing(board, 1 - me)
                                                             or [next(c for c in PREFERENCE if not board[c])]),
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


def demonstrations(n: int, seed: int = 0, view: str = "since_move") -> list[dict]:
    """``n`` one-move rows of the best player against ``textarena:TicTacToe-v0``'s random opponent (training split,
    both seats), each prompted as training prompts that move (with ``--game_view view``)."""
    from marft.envs.textarena_env import TextArenaEnv

    env, rng = TextArenaEnv("TicTacToe-v0", view=view), np.random.default_rng(seed)
    env.reset(seed=seed)

    def best_move(state) -> str:
        move = f"[{rng.choice(best_cells(board_of(state.moves), state.seat))}]"
        if move not in state.legal:
            raise AssertionError(f"the best player's {move} is not among the game's legal moves {state.legal}")
        return move

    return env.demonstrations(n, choose=best_move)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--demonstrations", type=int, default=0, help="write this many rows of the best player's moves")
    p.add_argument("--out", default="tictactoe_expert.jsonl", help="where the rows go (JSONL, for marft sft --sft_data)")
    p.add_argument("--seed", type=int, default=0, help="games and the choice among tied best moves")
    p.add_argument("--game_view", default="since_move", choices=tuple(GAME_VIEWS),
                   help="the rows' prompts: as marft train --game_view prompts a move (train with the same)")
    args = p.parse_args(argv)
    figures = {}
    for name, policy in SIMPLE_POLICIES.items():
        seats = [policy_win_rate(policy, me) for me in (0, 1)]
        figures[name] = {"seat_0": round(seats[0], 4), "seat_1": round(seats[1], 4), "both": round(sum(seats) / 2, 4)}
    result = {"win_rate_against_random": figures}
    if args.demonstrations:
        rows = demonstrations(args.demonstrations, args.seed, args.game_view)
        Path(args.out).write_text("".join(json.dumps(row) + "\n" for row in rows))
        result.update(demonstrations=len(rows), out=args.out)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
