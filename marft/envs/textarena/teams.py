"""TextArena's team games: several players per side, each player's side and role dealt by the game (issue 76).

A team game is played by a profile with one agent per role of the game (SecretMafia: ``Villager``, ``Doctor``,
``Detective``, ``Mafia``; ``--profile_path secret_mafia``): the agent named as a player's role moves for that player,
so two Villagers are one agent with two seats. Every agent is paid its own players' reward (TextArena's: 1 to the
winning side, -1 to the other), so each side is a team and the credit is per team. Train one side against a fixed
other side by freezing the other side's roles (``--frozen_roles Mafia``, their adapters from the warm start) or by
loading them from a checkpoint (``--opponent checkpoint:PATH --opponent_role Mafia``).

A game is registered here by the part of its id before ``-v`` (every variant of ``SecretMafia-v0`` shares it), with
how many players it is played by here and where its state names each player's role.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TeamGame:
    """How marft plays one of TextArena's team games."""

    players: int
    """Players in a game (TextArena allows a range; marft plays this many, so tasks are comparable)."""
    roles: tuple[str, ...]
    """Every role the game deals, as it names them: the profile's agents carry exactly these names."""
    seat_roles: Callable[[Any], dict[int, str]]
    """``seat_roles(game) -> {player id: role}``: the roles the game dealt (TextArena's game object, under its wrappers)."""
    sides: dict[str, str]
    """Each role's side (who plays with whom, e.g. ``Village``, ``Mafia``)."""
    canonical: Callable[[str], str] = str
    """``canonical(reply) -> move``: a reply as the game is given it (and the transcript records it)."""


def _mafia_roles(game) -> dict[int, str]:
    return dict(game.player_roles)


PLAYER_TAG = re.compile(r"\[\s*player\s*(\d+)\s*\]", re.IGNORECASE)


def _mafia_move(reply: str) -> str:
    # SecretMafia counts "[Player 3]" as a vote for 3 (as its rules ask), but TextArena strips such tags from what the
    # other players are shown, so the vote would be hidden from them: written "[3]", everyone sees whom it names
    return PLAYER_TAG.sub(r"[\1]", reply)


TEAM_GAMES: dict[str, TeamGame] = {
    "SecretMafia": TeamGame(players=6, roles=("Villager", "Doctor", "Detective", "Mafia"), seat_roles=_mafia_roles,
                            sides={"Villager": "Village", "Doctor": "Village", "Detective": "Village", "Mafia": "Mafia"},
                            canonical=_mafia_move),
}
"""A team game's id before ``-v`` → how marft plays it (TextArena 0.7.4). SecretMafia with 6 players deals 2 Mafia, a
Doctor, a Detective and 2 Villagers; Codenames needs NLTK data that no pip package ships (see ``docs/games.md``)."""


def team_game(game_id: str) -> TeamGame | None:
    """The registered team game ``game_id`` is a variant of (``SecretMafia-v0-train`` → SecretMafia), or None."""
    return TEAM_GAMES.get(game_id.split("-v", 1)[0])
