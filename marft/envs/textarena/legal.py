"""The legal moves of a TextArena position: listed by the game, or read from the game's own state (issue 76).

Some games list the moves in their observation (Tic-Tac-Toe's ``Available Moves: '[0]', '[4]'``): those are read
from the text (:func:`listed_moves`). For games that do not, a small registry (:data:`READERS`) reads them from the
game object's state, keyed by the class name of TextArena's game (``ConnectFourEnv``), so every id of a game
(``ConnectFour-v0``, ``-v0-blind`` ...) has them. Each reader mirrors its game's own validation; a test plays random
games and checks, position by position, that every listed move is accepted and every other candidate refused by the
game itself (tests/envs/test_textarena_legal.py).

A game without either has no known legal moves: the random opponent is refused for it before any model loads
(:func:`marft.envs.textarena.env.TextArenaEnv`), naming self-play as what works.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from typing import Any

LISTED_MOVE = re.compile(r"'(\[[^\]\n]+\])'")
"""A move as the listing games quote it: ``'[4]'``, ``'[check]'``."""


def listed_moves(messages: str) -> list[str]:
    """The legal moves the latest line that lists them names (``'[4]'`` → ``[4]``), or [] if no line does."""
    for line in reversed(messages.splitlines()):
        if "available" in line.lower():
            found = LISTED_MOVE.findall(line)
            if found:
                return found
    return []


def _connect_four(game, player: int) -> list[str]:
    board = game.state.game_state["board"]
    return [f"[col {c}]" for c in range(game.num_cols) if board[0][c] == "."]


def _nim(game, player: int) -> list[str]:
    return [f"[{pile} {take}]" for pile, left in enumerate(game.state.game_state["piles"]) for take in range(1, left + 1)]


def _simple_tak(game, player: int) -> list[str]:
    board = game.state.game_state["board"]
    return [f"[{cell}]" for cell, (r, c) in sorted(game.cell_mapping.items()) if board[r][c] == ""]


def _wild_tic_tac_toe(game, player: int) -> list[str]:
    board = game.state.game_state["board"]
    return [f"[{mark} {3 * r + c}]" for r in range(3) for c in range(3) if board[r][c] == "" for mark in ("X", "O")]


def _othello(game, player: int) -> list[str]:
    valid = game._valid_moves("B" if player == 0 else "W")  # the game's own pure helper
    return [f"[{r}, {c}]" for r, c in valid] or ["[pass]"]  # no move: the game skips the turn whatever is said


def _ultimate_tic_tac_toe(game, player: int) -> list[str]:
    state = game.state.game_state
    forced = state["next_micro_board"]
    boards = range(9) if forced is None else (forced,)
    return [f"[{micro} {3 * r + c}]" for micro in boards if state["macro_board"][micro // 3][micro % 3] == " "
            for r in range(3) for c in range(3) if state["board"][micro][r][c] == " "]


def _breakthrough(game, player: int) -> list[str]:
    board, n = game.state.game_state["board"], game.board_size
    own, other, forward = ("W", "B", 1) if player == 0 else ("B", "W", -1)
    moves = []
    for r in range(n):
        for c in range(n):
            if board[r][c] != own or not 0 <= r + forward < n:
                continue
            for dc in (-1, 0, 1):
                if 0 <= c + dc < n and board[r + forward][c + dc] == ("" if dc == 0 else other):
                    moves.append(f"[{chr(97 + c)}{r + 1}{chr(97 + c + dc)}{r + forward + 1}]")
    return moves


def _guess_the_number(game, player: int) -> list[str]:
    return [f"[{k}]" for k in range(game.min_number, game.max_number + 1) if k not in game.guessed_numbers]


def _mastermind(game, player: int) -> list[str]:
    state = game.state.game_state
    digits, length = range(1, state["num_numbers"] + 1), state["code_length"]
    codes = itertools.product(digits, repeat=length) if state["duplicate_numbers"] else itertools.permutations(digits, length)
    guessed = [entry["guess"] for entry in state["history"]]
    return [f"[{' '.join(map(str, code))}]" for code in codes if list(code) not in guessed]


def _tower_of_hanoi(game, player: int) -> list[str]:
    towers = game.state.game_state["towers"]
    return [f"[{a} {b}]" for a in sorted(towers) for b in sorted(towers)
            if towers[a] and (not towers[b] or towers[b][-1] >= towers[a][-1])]  # [A A] too: the game takes a no-op


def _frozen_lake(game, player: int) -> list[str]:
    (r, c), n = game.state.game_state["player_pos"], game.size
    return [f"[{name}]" for name, (dr, dc) in game.actions.items() if 0 <= r + dr < n and 0 <= c + dc < n]


def _secret_mafia(game, player: int) -> list[str]:
    # every phase takes a living player's number: a vote, a night's target (the game accepts any living player, the
    # player itself and a fellow Mafia too), or in the discussion a suspicion (where the game takes any text)
    return [f"[{p}]" for p in game.state.game_state["alive_players"]]


def _fixed(*moves: str) -> Callable[[Any, int], list[str]]:
    return lambda game, player: list(moves)


READERS: dict[str, Callable[[Any, int], list[str]]] = {
    "ConnectFourEnv": _connect_four,
    "NimEnv": _nim,
    "SimpleTakEnv": _simple_tak,
    "WildTicTacToeEnv": _wild_tic_tac_toe,
    "OthelloEnv": _othello,
    "UltimateTicTacToeEnv": _ultimate_tic_tac_toe,
    "BreakthroughEnv": _breakthrough,
    "IteratedRockPaperScissorsEnv": _fixed("[rock]", "[paper]", "[scissors]"),
    "IteratedMatchingPenniesEnv": _fixed("[heads]", "[tails]"),
    "GuessTheNumberEnv": _guess_the_number,
    "MastermindEnv": _mastermind,
    "TowerOfHanoiEnv": _tower_of_hanoi,
    "FrozenLakeEnv": _frozen_lake,
    "SecretMafiaEnv": _secret_mafia,
}
"""TextArena game class name → ``reader(game, player) -> legal moves`` of ``player`` (the one to move) now."""

RANDOM_OPPONENT_GAMES = ("TicTacToe-v0", "KuhnPoker-v0", "PigDice-v0", "ConnectFour-v0", "Nim-v0", "SimpleTak-v0", "WildTicTacToe-v0",
                         "Othello-v0", "UltimateTicTacToe-v0", "Breakthrough-v0", "IteratedRockPaperScissors-v0",
                         "IteratedMatchingPennies-v0")
"""Two-player games (TextArena 0.7.4) whose legal moves are known at every position: listed (the first three) or read
(the rest). A test checks each one's moves against the game's own verdicts."""

PUZZLES = ("GuessTheNumber-v0", "Mastermind-v0", "TowerOfHanoi-v0", "FrozenLake-v0")
"""One-player games (TextArena 0.7.4) whose legal moves are read, so a team's warm start has random legal play to
learn the move format from (``demonstrations``); other puzzles play too, warm-started from transcripts of your own."""


TEAM_GAMES_READ = ("SecretMafia-v0",)
"""Team games (:mod:`marft.envs.textarena.teams`) whose legal moves are read: their warm start has random legal play."""


def legal_moves(game, player: int, messages: str) -> list[str]:
    """``player``'s legal moves in ``game`` (TextArena's game object, under its wrappers): those the game's
    ``messages`` to the player list, else those its registered reader gives, else []."""
    listed = listed_moves(messages)
    if listed:
        return listed
    reader = READERS.get(type(game).__name__)
    return reader(game, player) if reader else []

