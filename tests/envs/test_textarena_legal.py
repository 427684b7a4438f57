"""marft.envs.textarena.legal: the legal moves of games that do not list them, judged by the games themselves.

At every position of random games, each listed move must be one the game accepts, and every other candidate of the
game's move format one it refuses (an invalid move in TextArena: counted as an error, or the game lost for it). A
reader that lists a move the game refuses would make the random opponent lose on an invalid move; one that leaves a
legal move out would make it weaker than random."""

import collections
import copy
import itertools

import numpy as np
import pytest

pytest.importorskip("textarena", reason="textarena is not installed (pip install -r requirements-dev.txt)")

from marft.envs import make  # noqa: E402
from marft.envs.textarena.env import Game  # noqa: E402
from marft.envs.textarena.legal import PUZZLES, RANDOM_OPPONENT_GAMES, READERS, TEAM_GAMES_READ  # noqa: E402
from marft.envs.textarena.teams import team_game  # noqa: E402

FILES = "abcdefgh"
CANDIDATES = {
    "ConnectFour-v0": [f"[col {c}]" for c in range(8)],
    "Nim-v0": [f"[{p} {q}]" for p in range(4) for q in range(0, 7)],
    "SimpleTak-v0": [f"[{i}]" for i in range(26)],
    "WildTicTacToe-v0": [f"[{m} {i}]" for m in "XO" for i in range(9)],
    "Othello-v0": [f"[{r}, {c}]" for r in range(8) for c in range(8)],
    "UltimateTicTacToe-v0": [f"[{m} {c}]" for m in range(9) for c in range(9)],
    "Breakthrough-v0": [f"[{FILES[c]}{r + 1}{FILES[c + dc]}{r + dr + 1}]" for r in range(8) for c in range(8)
                        for dr in (-1, 0, 1) for dc in (-1, 0, 1) if 0 <= c + dc < 8 and 0 <= r + dr < 8 and (dr, dc) != (0, 0)],
    "IteratedRockPaperScissors-v0": ["[rock]", "[paper]", "[scissors]", "[lizard]"],
    "IteratedMatchingPennies-v0": ["[heads]", "[tails]", "[edge]"],
    "GuessTheNumber-v0": [f"[{k}]" for k in range(0, 22)],
    "Mastermind-v0": [f"[{' '.join(map(str, code))}]" for code in itertools.permutations(range(1, 7), 4)]
                     + ["[1 1 2 3]", "[0 1 2 3]", "[1 2 3 7]", "[1 2 3]", "[1 2 3 4 5]"],
    "TowerOfHanoi-v0": [f"[{a} {b}]" for a in "ABCD" for b in "ABCD"],
    "FrozenLake-v0": ["[up]", "[down]", "[left]", "[right]", "[north]"],
}
"""Per game with a reader: moves in its format, legal or not (a superset of every position's legal moves)."""


def accepted(game: Game, move: str) -> bool:
    """Whether the game takes ``move`` from the player to move (on a copy): no error counted, not lost for it."""
    trial = copy.deepcopy(game)
    player, errors = trial.current_player, trial.base.state.error_count
    trial.move(move)
    state = trial.base.state
    return state.error_count <= errors and not state.game_info.get(player, {}).get("invalid_move")


def positions(game_id: str, games: int, max_moves: int):
    """Positions of ``games`` random games (random legal moves, seeded), each as a live :class:`Game`."""
    for seed in range(games):
        game, rng = Game(game_id, seed, 1 if game_id in PUZZLES else 2), np.random.default_rng(seed)
        for _ in range(max_moves):
            if game.done:
                break
            yield game
            moves = game.legal_moves()
            game.move(moves[int(rng.integers(len(moves)))])


def test_every_game_with_a_reader_is_a_random_opponent_game_with_candidates():
    read = {type(Game(g, 0, 1 if g in PUZZLES else 2).base).__name__ for g in CANDIDATES}
    read |= {type(Game(g, 0, team_game(g).players).base).__name__ for g in TEAM_GAMES_READ}
    assert read == set(READERS)
    assert set(CANDIDATES) <= set(RANDOM_OPPONENT_GAMES) | set(PUZZLES)


@pytest.mark.parametrize("game_id", sorted(CANDIDATES))
def test_the_read_moves_are_exactly_those_the_game_accepts(game_id):
    seen = 0
    games, max_moves = (3, 10) if game_id == "Mastermind-v0" else (6, 25)  # 365 candidates a position
    for game in positions(game_id, games=games, max_moves=max_moves):
        legal = game.legal_moves()
        assert legal and len(set(legal)) == len(legal), (game_id, legal)
        verdicts = {move: accepted(game, move) for move in CANDIDATES[game_id]}
        if legal == ["[pass]"]:  # Othello: no move, the game skips the turn whatever the player says
            assert game_id == "Othello-v0" and accepted(game, "[pass]")
            continue
        assert set(legal) == {move for move, ok in verdicts.items() if ok}, (game_id, game.base.state.game_state)
        seen += 1
    assert seen >= 20


@pytest.mark.parametrize("game_id", sorted(set(RANDOM_OPPONENT_GAMES) - set(CANDIDATES)))
def test_the_listed_moves_are_accepted(game_id):
    for game in positions(game_id, games=3, max_moves=30):
        legal = game.legal_moves()
        assert legal and all(accepted(game, move) for move in legal), (game_id, legal)


@pytest.mark.parametrize("game_id", ["ConnectFour-v0", "Nim-v0", "Othello-v0"])
def test_the_random_opponent_plays_games_that_do_not_list_their_moves_to_the_end(game_id):
    """A one-agent team against the random opponent, from both seats; the agent plays its first legal move. Every
    game ends by the rules (win, draw or loss), never on an invalid move."""
    env = make(f"textarena:{game_id}", split="test", profile="game_player")
    outcomes = []
    for task in range(4):
        env.reset(options={"task_index": task})
        done = False
        while not done:
            assert env.episode.legal
            _, _, terminated, truncated, info = env.step((env.episode.legal[0],))
            done = terminated or truncated
        assert info["outcome"] in ("win", "draw", "loss") and not info["invalid_move"], info
        outcomes.append(info["outcome"])
    assert len(outcomes) == 4


def test_secret_mafia_reads_a_living_players_number_in_every_phase():
    """A vote or a night's target: exactly the numbers the game accepts (any living player); in the discussion, where
    the game takes any text, each listed number is taken too."""
    seen = collections.Counter()
    for seed in range(6):
        game, rng = Game("SecretMafia-v0", seed, 6), np.random.default_rng(seed)
        while not game.done:
            legal, phase = game.legal_moves(), game.base.phase.value
            verdicts = {move: accepted(game, move) for move in (f"[{p}]" for p in range(8))}
            if phase == "Day-Discussion":
                assert all(verdicts[move] for move in legal)
            else:
                assert set(legal) == {move for move, ok in verdicts.items() if ok}, (phase, game.base.state.game_state)
            seen[phase] += 1
            game.move(legal[int(rng.integers(len(legal)))])
    assert set(seen) == {"Night-Mafia", "Night-Doctor", "Night-Detective", "Day-Discussion", "Day-Voting"}
