"""TextArena's games as marft environments: ``--env_name textarena:TicTacToe-v0`` (any TextArena env id).

A two-agent profile is self-play (one agent per seat, each paid its own seat's reward; see :class:`TextArenaEnv`).
A one-agent profile plays one seat of a two-player game against a fixed opponent that the environment moves itself:
``random``, a player of uniformly random legal moves (for games whose observation lists the legal moves, e.g.
Tic-Tac-Toe's ``Available Moves: '[0]', '[4]'`` or Kuhn Poker's ``available actions are: '[check]', '[bet]'``, and
games whose moves :mod:`marft.envs.textarena.legal` reads from their state: ConnectFour, Nim, Othello ...; for any
other game it is refused when the env is built, before a model loads).
Seats rotate over tasks (task ``i`` plays seat ``i % 2`` of game seed ``i // 2``), so both seats are trained and
evaluated, reproducibly by seed. One team step is one move of the agent; the opponent's replies follow inside the
step. The reward is TextArena's at the end of the game (win 1, draw 0, loss -1), ``correct`` is a win, and the
step's ``info`` says ``outcome`` (``win`` / ``draw`` / ``loss``), ``seat`` and ``invalid_move`` (the game ended
on this agent's invalid move, as TextArena rules it).

What the agent sees (``view``): the game's rules (its first message) and the messages since its previous move (the
opponent's move, the board, the legal moves: ``since_move``, the default), so the prompt stays short however long the
game; or the rules and the latest board only (``board``: the board message and what followed it, as TextArena's
``GameBoardObservationWrapper`` shows a game), so one position is one prompt however it was reached. A prompt cut
to the context window keeps the rules (:meth:`TextArenaEnv.kept_heads`) and drops the oldest messages after them.
The env's state is the seed and the moves so far, replayed when needed, so it is pure, checkpointable and exactly
resumable.

A one-player game (a puzzle: GuessTheNumber, Mastermind, TowerOfHanoi ...) is played by a team of any size: the
profile's workflow speaks in turn each team step and the answering agent's reply is the move; every agent is paid the
game's reward (TextArena's progress score, 1 when solved), ``correct`` means solved, and task ``i`` is game seed ``i``.

A team game (:mod:`marft.envs.textarena.teams`: SecretMafia, six players in two sides) is self-play by a team of one
agent per role the game deals: the agent of a player's role moves for that player (two Villagers: one agent, two
seats), sees the game as that player, and is paid its side's reward; ``correct`` is the first role's side winning,
and task ``i`` is game seed ``i``.

TextArena is optional: ``pip install "marft[games]"``.
"""

from __future__ import annotations

import contextlib
import random
import re
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from marft.choices import GAME_VIEWS
from marft.envs.base import EpisodeState, MultiAgentTextEnv, StepOutcome
from marft.envs.profile import AgentSpec, answer_agent_index, team_profile
from marft.envs.textarena import legal
from marft.envs.textarena.demonstrations import random_legal_demonstrations
from marft.envs.textarena.teams import team_game
from marft.envs.workflows import StepTurns, Workflow
from marft.prompting import format_problem

TEXTARENA_MISSING = 'TextArena is not installed: pip install "marft[games]" (or pip install textarena==0.7.4)'

OPPONENTS = ("random",)
DEFAULT_MAX_MOVES = 64
"""The most moves the agent makes in one game when ``--horizon`` is 1 (the default: the game's own end)."""
GAME_ID = -1
OUTCOMES = {1: "win", 0: "draw", -1: "loss"}


def _textarena():
    try:
        import textarena
    except ImportError as error:
        raise ImportError(TEXTARENA_MISSING) from error
    return textarena


@dataclass(frozen=True)
class GameState(EpisodeState):
    """An episode of a TextArena game: enough to replay it exactly (``game_seed``, every move so far)."""

    seat: int = 0
    """Agent 0's player id in the game (agent ``a`` plays seat ``(a + seat) % 2``)."""
    game_seed: int = 0
    """TextArena's seed for this game."""
    moves: tuple[str, ...] = ()
    """Every move of the game so far, both players', in order."""
    to_move: int = 0
    """The player id to move now (-1: the game is over)."""
    views: tuple[str, ...] = ()
    """Self-play: each agent's view of the game now (its seat's messages); empty against a fixed opponent."""
    legal: tuple[str, ...] = ()
    """The legal moves of the player to move, listed by the game or read from its state (:mod:`.legal`; empty: neither
    knows them, or the game is over)."""
    retries: tuple[int, ...] = ()
    """Per agent, its invalid moves TextArena forgave (the agent tried again); charged when the horizon cuts a game."""
    opponent_moves: int = 0
    """Moves the fixed opponent made: its k-th choice is drawn from a generator seeded by (game seed, k)."""
    rules: tuple[str, ...] = ()
    """Each player id's rules (the game's opening messages to it, stripped), which open its view: what a prompt cut
    to the context window keeps (:meth:`TextArenaEnv.kept_heads`; empty in checkpoints from before it)."""
    seat_agents: tuple[int, ...] = ()
    """A team game: per player id, the agent that moves for it (the agent named as the role the game dealt that
    player); empty in two-player games and puzzles (agent ``a`` plays seat ``(a + seat) % 2``)."""

    def __post_init__(self):
        object.__setattr__(self, "moves", tuple(self.moves))  # a checkpoint's JSON gives lists
        object.__setattr__(self, "views", tuple(self.views))
        object.__setattr__(self, "legal", tuple(self.legal))
        object.__setattr__(self, "retries", tuple(self.retries))
        object.__setattr__(self, "rules", tuple(self.rules))
        object.__setattr__(self, "seat_agents", tuple(self.seat_agents))


def missing_nltk_data(game_id: str, message: str) -> str:
    """One line for a word game whose NLTK data is missing (TextArena downloads it when the game's module is imported,
    which fails offline): which resource, and how to install it."""
    found = re.search(r"Resource '?([\w.]+)'? not found", message)
    resource = found.group(1) if found else "its corpora"
    return (f"{game_id} needs NLTK's {resource!r} data, which TextArena downloads on first use and cannot here (offline). On a "
            f"machine with internet: python -m nltk.downloader words averaged_perceptron_tagger_eng (TextArena's word games "
            f"use these two), then copy the nltk_data folder here or point NLTK_DATA at it (no pip package ships NLTK's data)")


class Game:
    """One live TextArena game: its messages to each player as text, and moves by either player.

    TextArena's games deal with Python's global ``random`` (seeded when a game starts, e.g. Kuhn Poker's later
    rounds), so each game keeps a stream of its own: every call into the game runs on the game's saved state of
    ``random`` and gives the process's back afterwards. A replay from (seed, moves) is then the same game whatever
    else used ``random`` meanwhile (other envs, another replay)."""

    def __init__(self, game_id: str, seed: int, players: int = 2):
        self._random = None
        self.players = tuple(range(players))
        """The game's player ids: (0, 1) for a two-player game, (0,) for a puzzle."""
        with self._own_random(seed):
            self.env = _textarena().make(game_id)
            self.env.reset(num_players=players, seed=seed)
        self.base = self.env
        while hasattr(self.base, "env"):  # the game itself under TextArena's wrappers (observations come from it)
            self.base = self.base.env
        self.rules = {pid: "" for pid in self.players}
        self.unread = {pid: "" for pid in self.players}
        self.from_game = {pid: "" for pid in self.players}  # the game's own messages among the unread: legal moves come from these
        self.since_board = {pid: "" for pid in self.players}  # the latest board message (TextArena's GAME_BOARD) and what followed
        self.before_board = {pid: "" for pid in self.players}  # the latest collection's lines before its first board message
        self.has_board = {pid: False for pid in self.players}
        self.done, self.result, self.forgiven = False, None, False
        self._collect()

    @contextlib.contextmanager
    def _own_random(self, seed: int | None = None):
        """Run the game on its own state of Python's ``random`` (``seed``: a fresh one), restoring the process's."""
        outer = random.getstate()
        if seed is not None:
            random.seed(seed)
        else:
            random.setstate(self._random)
        try:
            yield
        finally:
            self._random = random.getstate()
            random.setstate(outer)

    def _collect(self, mover: int | None = None) -> None:
        """Move the game's new messages for every player into ``rules`` (prompts) and ``unread`` (the rest). A
        player's message is put on one line after its name, so its text cannot pass for the game's own lines. Some
        games (TowerOfHanoi, Wordle, Briscola ...) echo a move under the game's own id: a ``PLAYER_ACTION`` is the
        ``mover``'s text whoever sent it, so a reply can neither list legal moves nor write game lines."""
        from textarena.core import ObservationType

        state = self.base.state
        for pid in self.players:
            self.before_board[pid], board_seen = "", False
            for sender, message, kind in state.observations.get(pid, []):
                if kind == ObservationType.PROMPT:
                    self.rules[pid] += message.strip() + "\n"
                    continue
                if kind == ObservationType.PLAYER_ACTION and sender == GAME_ID and mover is not None:
                    sender = mover
                if sender == GAME_ID:  # only the game lists legal moves
                    line = f"[GAME] {message.strip()}\n"
                    self.from_game[pid] += message.strip() + "\n"
                else:
                    name = state.role_mapping.get(sender, f"Player {sender}")
                    line = f"[{name}] {' '.join(message.split())}\n"
                self.unread[pid] += line
                if kind == ObservationType.GAME_BOARD and sender == GAME_ID:
                    self.since_board[pid], self.has_board[pid], board_seen = line, True, True
                else:
                    if not board_seen:
                        self.before_board[pid] += line
                    self.since_board[pid] += line
            state.observations[pid] = []

    @property
    def current_player(self) -> int:
        return int(self.base.state.current_player_id)

    def legal_moves(self) -> list[str]:
        """The current player's legal moves: listed by the game, else read from its state (:mod:`.legal`); [] if neither."""
        return legal.legal_moves(self.base, self.current_player, self.from_game[self.current_player])

    def move(self, action: str) -> None:
        """The current player makes ``action``; the game's messages are collected; at the end, its result. The
        player's view starts afresh after its move, unless it is to move again (a retry after an invalid move
        TextArena forgave): then it keeps what it saw (its card, the legal moves) and adds what followed. In the
        ``board`` view too: the board it moved on, then its rejected move and the game's reason (TextArena re-sends
        the unchanged board after them, which would make the retry's prompt the first try's again)."""
        player = self.current_player
        seen, seen_from_game, seen_board = self.unread[player], self.from_game[player], self.since_board[player]
        self.unread[player] = self.from_game[player] = ""
        with self._own_random():
            self.done, _ = self.env.step(action)
            if self.done:
                self.result = self.env.close()  # (rewards by player id, game info by player id)
        self._collect(mover=player)
        # the move was invalid and TextArena lets the player try again
        self.forgiven = not self.done and self.current_player == player and "invalid" in self.from_game[player].lower()
        # a team game's player may also move twice in a row by the rules (the day's last voter opens the Mafia's night):
        # there only a forgiven retry keeps what the player saw
        again = self.forgiven if len(self.players) > 2 else not self.done and self.current_player == player
        if again:
            self.unread[player] = seen + self.unread[player]
            self.from_game[player] = seen_from_game + self.from_game[player]
            self.since_board[player] = seen_board + self.before_board[player]

    def view(self, pid: int, kind: str = "since_move") -> str:
        """What player ``pid`` sees now: the rules, then the messages since its previous move (``since_move``) or
        the latest board and any messages after it (``board``)."""
        return (self.rules[pid] + "\n" + (self.since_board[pid] if kind == "board" else self.unread[pid])).strip()


def start_game(game_id: str) -> Game:
    """Game seed 0 of ``game_id``: a team game's (:mod:`.teams`) with its players, else a two-player game, else a
    one-player puzzle (``Game.players`` says which).

    Raises:
        ValueError: in one line, when TextArena starts it as none of those (an unknown id, a game for more players
            that is not a registered team game, an error in TextArena) or a word game's NLTK data is missing."""
    team = team_game(game_id)
    try:
        return Game(game_id, 0, players=team.players if team else 2)
    except Exception as error:  # noqa: BLE001 - TextArena raises assertion, key and value errors alike
        if isinstance(error, LookupError):  # NLTK's multi-line "Resource ... not found" banner
            raise ValueError(missing_nltk_data(game_id, str(error))) from error
        try:
            if team is None:
                return Game(game_id, 0, players=1)
        except Exception:  # noqa: BLE001 - not a puzzle either: report the two-player error
            pass
        hint = "; TextArena itself failed to load it" if isinstance(error, SyntaxError) else ""
        as_what = f"a {team.players}-player team game" if team else "a two-player game or a one-player puzzle"
        raise ValueError(f"TextArena could not start {game_id!r} as {as_what} (an unknown id, a game for more players that "
                         f"marft.envs.textarena.teams does not register, or an error in TextArena): {type(error).__name__}: {error}{hint}") from error


def _agent_of(player: int, seat: int, seat_agents: tuple[int, ...]) -> int:
    """The agent that moves for ``player``: a team game's by its deal (``seat_agents``), else by the seating (agent
    ``a`` plays seat ``(a + seat) % 2``)."""
    return seat_agents[player] if seat_agents else (player - seat) % 2


class MoveWorkflow(Workflow):
    """Self-play: one team step is one move, by the agent whose seat the game says is to move (the env sets
    ``turns.due`` at the start of every step; the profile's own workflow does not apply)."""

    name = "game"
    max_turns_per_step = 1

    @property
    def first_speaker(self) -> int:
        return 0  # who moves first depends on the game and the seats; critics, which would ask, are refused

    def start(self) -> StepTurns:
        return StepTurns()

    def take(self, turns: StepTurns, agent: int, reply: str) -> None:
        self._check(turns, agent)
        turns.entries.append((agent, reply))
        turns.due = []


class TextArenaEnv(MultiAgentTextEnv):
    """A TextArena two-player game, puzzle or team game (see the module's docstring).

    A one-agent profile plays against a fixed opponent (``opponent``) that the env moves itself. A two-agent profile
    is self-play: one agent (its own adapter) per seat, each paid its own seat's reward; one team step is one move,
    by the agent whose seat is to move. In both, agent ``a`` plays seat ``(a + task) % 2`` of task ``task``'s game.

    Args:
        game_id: a TextArena env id, e.g. ``TicTacToe-v0``, ``KuhnPoker-v0``.
        split: ``train`` (game seeds 0, 1, ...) or ``test`` (held-out seeds from 1,000,000 on).
        profile: one agent (default: ``Player``) against the opponent, or two agents for self-play.
        horizon: the most team steps (moves of the team) in one game (1, the default flag: up to ``DEFAULT_MAX_MOVES``).
        opponent: ``random`` (uniformly random legal moves): the fixed opponent of a one-agent team.
        n_games: games (seeds) per split (default: 5000 for ``train``; for ``test`` 500 of a two-player game, 1000 of
            a puzzle or a team game); a two-player game's tasks are ``2 * n_games`` (each game once with each seating):
            task ``i`` is seat ``i % 2`` of game seed ``offset + i // 2``, so the first ``2 * k`` tasks of a split are the
            same whatever its size (an evaluation of 200 episodes plays the test split's first 100 deals from both
            seats; ``marft eval`` with no ``--episodes`` all 1000 tasks). A puzzle's or team game's task ``i`` is game
            seed ``offset + i`` (the game deals the seats): 1000 held-out games too.
        view: what an agent sees besides the rules (:data:`marft.choices.GAME_VIEWS`): ``since_move`` (the default), the messages since
            its previous move; ``board``, the latest board and the messages after it (games whose board TextArena
            marks as such, e.g. Tic-Tac-Toe; others are refused).
        invalid_move_penalty: charged (as reward ``-invalid_move_penalty``, at that move's own step) to an agent for
            each invalid move TextArena forgives: the game lets the player try again (once per move), so under
            TextArena's own rule (0, the default) only a second invalid attempt in a row costs anything (the game
            ends, lost). A policy trained on that rule learns that a first try at a taken cell is free.
    """

    def __init__(self, game_id: str = "TicTacToe-v0", split: str = "train", profile=None, horizon: int = 1,
                 opponent: str = "random", n_games: int | None = None, n_agents: int | None = None,
                 invalid_move_penalty: float = 0.0, view: str = "since_move"):
        _textarena()
        if view not in GAME_VIEWS:
            raise ValueError(f"view must be one of {', '.join(GAME_VIEWS)}, got {view!r}")
        self.view = view
        if not (np.isfinite(invalid_move_penalty) and invalid_move_penalty >= 0):
            raise ValueError(f"invalid_move_penalty must be a finite number >= 0 (a charge), got {invalid_move_penalty!r}")
        self.invalid_move_penalty = float(invalid_move_penalty)
        if opponent not in OPPONENTS:
            raise ValueError(f"opponent must be one of {', '.join(OPPONENTS)}, got {opponent!r}")
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        self.profile = team_profile(profile or [AgentSpec(role="Player", prompt="", with_answer=True)], n_agents)
        probe = start_game(game_id)
        self.n_players = len(probe.players)
        """The game's players: 2, 1 for a puzzle, more for a team game."""
        self.puzzle = self.n_players == 1
        """A one-player game (GuessTheNumber, Mastermind, TowerOfHanoi ...), played by the whole team: the profile's
        workflow speaks in turn and the answering agent's reply is the move; every agent is paid the game's reward."""
        self.team = team_game(game_id) if self.n_players > 2 else None
        """A team game (:mod:`.teams`, e.g. SecretMafia): one agent per role the game deals, each paid its players' reward."""
        if self.team is not None:
            self.game_roles = self._game_roles(game_id)
            """Per agent, the game's role it plays: the role of its name, or (a profile whose names are none of the game's,
            e.g. an anonymous one) the game's roles in the order :mod:`.teams` lists them."""
        elif not self.puzzle and len(self.profile) not in (1, 2):
            raise ValueError(f"a two-player TextArena game is played by one agent (against a fixed opponent) or two "
                             f"(self-play); the profile has {len(self.profile)}: {[s.role for s in self.profile]}")
        super().__init__([spec.role for spec in self.profile], horizon=horizon if horizon > 1 else DEFAULT_MAX_MOVES)
        self.self_play = self.team is not None or (not self.puzzle and self.n_agents == 2)
        self.mover = answer_agent_index(self.profile) if self.puzzle else 0
        """Outside self-play, the agent whose reply is the move (a puzzle team's answering agent; else the one agent)."""
        self.competitive = self.self_play
        """Each agent is paid its own seat's reward in a zero-sum game (the launcher refuses a team-reward critic)."""
        if self.self_play:
            self.workflow = MoveWorkflow(self.roles, answer_agents=tuple(range(self.n_agents)))
            self.turns = self.workflow.start()
        self.game_id, self.split, self.opponent = game_id, split, opponent
        self.n_games = n_games or (5000 if split == "train" else 1000 if self.puzzle or self.team else 500)
        self.seed_offset = 0 if split == "train" else 1_000_000
        self._live: tuple[tuple, Game] | None = None  # the latest game played, keyed by (seed, moves): saves replays
        self.random_agents: frozenset[int] = frozenset()
        """Self-play: agents whose moves the random-legal-move player makes instead (:meth:`play_randomly`)."""
        if not self.self_play and not self.puzzle and not probe.legal_moves():
            raise ValueError(f"{game_id} neither lists its legal moves nor has a reader of them in marft.envs.textarena.legal, so the "
                             f"random opponent cannot play it; self-play can: a two-agent profile (--profile_path game_seats) with "
                             f"--algorithm_name APPO (or TPPO) --credit_assignment own_turns, or GRPO --credit_assignment per_step. Games the random opponent plays: "
                             f"{', '.join(legal.RANDOM_OPPONENT_GAMES)}")
        if view == "board" and not probe.has_board[probe.current_player]:
            raise ValueError(f"{game_id} shows no board at its start (a message TextArena marks GAME_BOARD), so the 'board' view "
                             f"would show the rules alone; use the 'since_move' view")

    def _game_roles(self, game_id: str) -> list[str]:
        """A team game's role per agent (:attr:`game_roles`).

        Raises:
            ValueError: a profile of another size, or whose names are some but not all of the game's roles."""
        roles = [spec.role for spec in self.profile]
        if len(roles) != len(self.team.roles):
            raise ValueError(f"{game_id} is a team game: its profile has one agent per role the game deals, {list(self.team.roles)} "
                             f"(--profile_path secret_mafia), not {len(roles)} ({', '.join(roles)})")
        named = [role for role in roles if role in self.team.roles]
        if named and sorted(roles) != sorted(self.team.roles):
            raise ValueError(f"{game_id} is a team game: its profile's agents are named as the game's roles, "
                             f"{list(self.team.roles)}, each once (or none is, and they play them in that order); got {roles}")
        return roles if named else list(self.team.roles)

    @property
    def num_tasks(self) -> int:
        return self.n_games if self.puzzle or self.team else 2 * self.n_games

    # ---- seats and turns

    def players_of(self, agent: int, state: GameState) -> list[int]:
        """The player ids agent ``agent`` moves for: its seat's, or in a team game every player dealt its role."""
        if self.puzzle:
            return [0]
        if state.seat_agents:
            return [pid for pid, a in enumerate(state.seat_agents) if a == agent]
        return [(agent + state.seat) % 2]

    def seat_of(self, agent: int, state: GameState) -> int:
        """The player id agent ``agent`` plays now: in a team game the one to move if it is one of the agent's, else
        the agent's first."""
        players = self.players_of(agent, state)
        return state.to_move if state.to_move in players else players[0]

    def agent_of(self, seat: int, state: GameState) -> int:
        return _agent_of(seat, state.seat, state.seat_agents)

    def _seat_agents(self, game: Game) -> tuple[int, ...]:
        """A team game: per player id, the agent of the role the game dealt it (every agent must get one); () otherwise.

        Raises:
            ValueError: a role of the profile that this game dealt to nobody."""
        if self.team is None:
            return ()
        dealt = self.team.seat_roles(game.base)
        seat_agents = tuple(self.game_roles.index(dealt[pid]) for pid in game.players)
        idle = [role for agent, role in enumerate(self.roles) if agent not in seat_agents]
        if idle:
            raise ValueError(f"{self.game_id} dealt no player the role(s) {idle}; each agent of a team game must play a seat")
        return seat_agents

    def _turns(self) -> StepTurns:
        """A fresh team step; in self-play, due: the agent whose seat is to move."""
        turns = self.workflow.start()
        if self.self_play and self.episode is not None and not self.episode.done:
            turns.due = [self.agent_of(self.episode.to_move, self.episode)]
        return turns

    def set_workflow(self, workflow: Workflow) -> None:
        """Self-play keeps its own workflow (the game decides who moves); a one-agent team plays the profile's."""
        if not self.self_play:
            return super().set_workflow(workflow)
        if tuple(workflow.roles) != self.roles:
            raise ValueError(f"the workflow's roles {list(workflow.roles)} are not the env's {list(self.roles)}")
        self.turns = self._turns()

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        result = super().reset(seed=seed, options=options)
        self.turns = self._turns()
        return result

    def step(self, actions):
        result = super().step(actions)
        self.turns = self._turns()
        return result

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.turns = self._turns()

    def private_observations(self) -> list[str]:
        """Self-play: each agent's own view of the game (its seat's messages); a one-agent team's view is its history."""
        if self.self_play and self.episode is not None:
            return list(self.episode.views)
        return [""] * self.n_agents

    def kept_heads(self) -> list[str]:
        """The rules of each agent's seat, which open its view (self-play: its private observation; against a fixed
        opponent: the history, ``format_problem`` of the view): a prompt cut to the context window keeps them and
        drops the oldest messages after them, so the latest board stays too."""
        state = self.episode
        if state is None:
            return [""] * self.n_agents
        # a checkpoint from before GameState.rules: agent 0's seat's rules are its problem, the other seat's unknown
        rules = state.rules or tuple(state.problem if pid == state.seat else "" for pid in (0, 1))
        if self.self_play:
            return [rules[self.seat_of(agent, state)] for agent in range(self.n_agents)]
        return [format_problem(rules[state.seat]) if rules[state.seat] else ""] * self.n_agents

    def play_randomly(self, roles) -> None:
        """Self-play: let the random-legal-move player move for ``roles`` (e.g. to evaluate each agent against it);
        takes effect at the next reset.

        Raises:
            ValueError: not self-play, an unknown role, or every role."""
        if not self.self_play:
            raise ValueError("play_randomly is for self-play teams; a one-agent team already plays the random player")
        unknown = [r for r in roles if r not in self.roles]
        if unknown or len(set(roles)) >= self.n_agents:
            raise ValueError(f"the random player can move for one of {list(self.roles)}, got {list(roles)}")
        self.random_agents = frozenset(self.roles.index(r) for r in roles)

    # ---- the game

    def _game(self, seed: int, moves: tuple[str, ...]) -> Game:
        """The game after ``moves`` from ``seed``: the live one if it is there, else replayed (the live one is used up)."""
        if self._live is not None and self._live[0] == (seed, moves):
            game, self._live = self._live[1], None
            return game
        game = Game(self.game_id, seed, self.n_players)
        for move in moves:
            game.move(move)
        return game

    def _opponent_moves(self, game: Game, seat: int, seed: int, moves: tuple[str, ...], made: int,
                        seat_agents: tuple[int, ...] = ()) -> tuple[tuple[str, ...], int]:
        """The fixed opponent moves until it is ``seat``'s turn or the game ends (in self-play: for the
        :attr:`random_agents`, while one of them is to move; ``seat``: agent 0's; ``seat_agents``: a team game's
        :attr:`GameState.seat_agents`); ``made``: its moves so far. Its k-th choice is drawn from a generator seeded
        by (game seed, k), so transitions are pure and the agent cannot re-draw the opponent's reply by wasting
        attempts. Returns (moves, the opponent's count)."""
        while not game.done and (game.current_player != seat if not self.self_play
                                 else _agent_of(game.current_player, seat, seat_agents) in self.random_agents):
            options = game.legal_moves()
            if not options:  # refused at __init__ for games whose moves are unknown; a position that lists none
                raise ValueError(f"the random opponent found no legal move in this position of {self.game_id}: "
                                 f"{game.unread[game.current_player][-300:]!r}")
            choice = options[int(np.random.default_rng([seed, made]).integers(len(options)))]
            game.move(choice)
            moves, made = moves + (choice,), made + 1
        return moves, made

    def _state(self, state: GameState | None, game: Game, seat: int, seed: int, moves: tuple[str, ...], made: int,
               seat_agents: tuple[int, ...] = ()) -> GameState:
        """The episode state after ``moves``; ``game`` is kept live for the next transition."""
        self._live = ((seed, moves), game)
        to_move = -1 if game.done else game.current_player
        legal = () if game.done else tuple(game.legal_moves())
        new = GameState(problem=game.rules[seat].strip(), answer="win", history="", seat=seat, game_seed=seed, to_move=to_move,
                        seat_agents=seat_agents) if state is None else replace(state, to_move=to_move)
        if self.self_play:  # each agent sees the game as the player it plays now
            views = tuple(game.view(self.seat_of(agent, new), self.view) for agent in range(self.n_agents))
            history = format_problem(self.game_id)
        else:
            views, history = (), format_problem(game.view(seat, self.view))
        if state is None:
            return replace(new, history=history, moves=moves, views=views, legal=legal, retries=(0,) * self.n_agents,
                           opponent_moves=made, rules=tuple(game.rules[pid].strip() for pid in game.players))
        return replace(new, history=history, moves=moves, views=views, legal=legal, opponent_moves=made)

    # ---- marft's hooks

    def sample_task(self, options: dict | None) -> dict:
        index = self.choose_task(options)
        if self.puzzle or self.team:  # the game deals the seats: task i is game seed i
            return {"problem": self.game_id, "answer": "win", "seat": 0, "game_seed": self.seed_offset + index}
        return {"problem": self.game_id, "answer": "win", "seat": index % 2, "game_seed": self.seed_offset + index // 2}

    def initial_state(self, task: dict) -> GameState:
        seat, seed = int(task["seat"]), int(task["game_seed"])
        game = Game(self.game_id, seed, self.n_players)
        seat_agents = self._seat_agents(game)
        return self._state(None, game, seat, seed, *self._opponent_moves(game, seat, seed, (), 0, seat_agents), seat_agents)

    def evaluate(self, state: EpisodeState, actions: tuple[str, ...]) -> StepOutcome:
        raise NotImplementedError("a TextArena game is judged by the game itself, in transition()")

    def transition(self, state: GameState, actions, turns=None) -> GameState:
        """The move of the agent to move; against a fixed opponent, the opponent's until the agent moves again."""
        actions = self._check_actions(actions)
        game = self._game(state.game_seed, state.moves)
        mover = self.agent_of(game.current_player, state) if self.self_play else self.mover
        move = self.team.canonical(actions[mover]) if self.team is not None else actions[mover]
        game.move(move)
        forgiven = game.forgiven  # read now: the opponent's moves below run on the same game
        retries = tuple(r + (a == mover and forgiven) for a, r in enumerate(state.retries))
        moves, made = self._opponent_moves(game, state.seat, state.game_seed, state.moves + (move,), state.opponent_moves,
                                           state.seat_agents)
        step = state.step + 1
        new = replace(self._state(state, game, state.seat, state.game_seed, moves, made), retries=retries, step=step)
        charged = tuple(self.invalid_move_penalty if a == mover and forgiven else 0.0 for a in range(self.n_agents))
        outcome = self._outcome(game, new, charged)
        return replace(new, terminated=game.done or step >= self.horizon, truncated=False, outcome=outcome)

    def _outcome(self, game: Game, state: GameState, charged: tuple[float, ...]) -> StepOutcome:
        """Every agent's reward (its seat's; 0 until the game ends, less ``charged``: the invalid-move penalty of a
        forgiven invalid move made this step) and, at the end, agent 0's outcome. A game the horizon cuts short is
        ``unfinished``: -1 for every agent that wasted moves on forgiven invalid ones (else a loss could be stalled
        away), 0 for the others. Self-play's ``reward_by_role`` is each agent's whole game: the final reward less
        every charge it paid (``invalid_move_penalty`` x its forgiven invalid moves)."""
        if not game.done and state.step < self.horizon:
            return StepOutcome(rewards=tuple(0.0 - c for c in charged), solved=False, info={"correct": False, "seat": state.seat})
        paid = [self.invalid_move_penalty * r for r in state.retries]  # (n_agents,) the charges of the whole game
        if not game.done:
            cut = [-1.0 if r else 0.0 for r in state.retries]  # (n_agents,) the horizon's verdict
            rewards = tuple(v - c for v, c in zip(cut, charged))
            info = {"correct": False, "outcome": "unfinished", "seat": state.seat, "invalid_move": False,
                    "moves": len(state.moves), "game_moves": list(state.moves), "invalid_attempts": sum(state.retries)}
            if self.team is not None:
                info["side_by_role"] = self.side_by_role()
            if self.self_play:
                info["invalid_by"], info["invalid_roles"] = "", []
                info["outcome_by_role"] = {role: "unfinished" for role in self.roles}
                info["reward_by_role"] = {role: v - p for role, v, p in zip(self.roles, cut, paid)}
            return StepOutcome(rewards=rewards, solved=False, info=info)
        by_seat, game_info = game.result
        rewards = tuple(float(by_seat[self.seat_of(a, state)]) for a in range(self.n_agents))  # a team game: its side's
        invalid = [a for a in range(self.n_agents) if any(game_info.get(p, {}).get("invalid_move") for p in self.players_of(a, state))]
        # a puzzle's reward is its progress in [0, 1] (TextArena's): solved at 1, a win; anything less, a loss
        won = rewards[0] >= 1.0 if self.puzzle else rewards[0] > 0
        outcome = ("win" if won else "loss") if self.puzzle else OUTCOMES[int(np.sign(rewards[0]))]
        info: dict[str, Any] = {"correct": won, "outcome": outcome, "seat": state.seat,
                                "invalid_move": bool(invalid), "moves": len(state.moves), "game_moves": list(state.moves),
                                "invalid_attempts": sum(state.retries)}
        if self.puzzle:
            info["progress"] = rewards[0]
        if self.team is not None:
            info["side_by_role"] = self.side_by_role()
        if self.self_play:
            info["invalid_by"] = self.roles[invalid[0]] if invalid else ""
            info["invalid_roles"] = [self.roles[a] for a in invalid]  # a team game: every role with a player eliminated for one
            info["outcome_by_role"] = {role: OUTCOMES[int(np.sign(r))] for role, r in zip(self.roles, rewards)}
            info["reward_by_role"] = {role: r - p for role, r, p in zip(self.roles, rewards, paid)}
        return StepOutcome(rewards=rewards, solved=True, info=info)

    def side_by_role(self) -> dict[str, str]:
        """A team game: each agent's role's side (``Village``, ``Mafia`` ...)."""
        return {role: self.team.sides[game_role] for role, game_role in zip(self.roles, self.game_roles)}

    def demonstrations(self, n: int, choose=None, recovery_share: float = 0.0) -> list[dict]:
        """``n`` one-move transcripts of random legal play, each prompted exactly as training prompts that move
        (:func:`marft.envs.textarena.demonstrations.random_legal_demonstrations`: ``choose``, ``recovery_share``)."""
        return random_legal_demonstrations(self, n, choose, recovery_share)
