"""A self-play game's other side played from another checkpoint (``--opponent checkpoint:PATH``): one role of the
team (``--opponent_role``, default the profile's last) takes its adapter from PATH and is never trained, so the
other roles train against a fixed player (a strong past run, a warm start) while they start from ``--load_path``
or from scratch.

The check runs before the model loads (:func:`check_opponent`); the weights are loaded when the run starts RL, after
a warm start's checkpoint (:func:`load_opponent`), replacing that role's adapter. A resumed run does not reload them:
its checkpoint holds the frozen weights it played with, even if PATH (a run directory) has a newer checkpoint since."""

from __future__ import annotations

from pathlib import Path

from marft.runner.shared.checkpoint import find_checkpoint, read_adapter, read_checkpoint_meta, set_adapter_weights

CHECKPOINT = "checkpoint:"
SAME_TEAM = ("model_name_or_path", "profile_path", "lora_r", "lora_target_modules", "shared_lora")
"""Model settings two checkpoints must share for one's adapter to play in the other's team."""


def opponent_checkpoint(opponent: str | None) -> str | None:
    """The PATH of ``checkpoint:PATH``; None without an opponent.

    Raises:
        ValueError: another form (the one built: ``checkpoint:PATH``)."""
    if opponent is None:
        return None
    if not opponent.startswith(CHECKPOINT) or not opponent[len(CHECKPOINT):].strip():
        raise ValueError(f"--opponent {opponent!r}: give checkpoint:PATH (a checkpoint or run directory of the same team); "
                         "the random player of a one-agent game is the environment's own (--profile_path with one agent)")
    return opponent[len(CHECKPOINT):].strip()


def team_differences(other_model: dict, model_config) -> list[str]:
    """The flags of :data:`SAME_TEAM` whose values in ``other_model`` (a checkpoint's saved ``model`` section, or a
    ModelConfig's fields) differ from ``model_config``'s."""
    return [f"--{f}" for f in SAME_TEAM if f in other_model and other_model[f] != getattr(model_config, f)]


def opponent_role(config, roles: list[str]) -> str:
    """``--opponent_role``, or the profile's last role."""
    return config.algo.opponent_role or roles[-1]


def check_opponent(config, roles: list[str], self_play: bool) -> str | None:
    """Before the model loads: the opponent's checkpoint exists, is of this team, and its role is one of the team's
    in a self-play game. Returns that role, which the caller freezes (None without ``--opponent``).

    Raises:
        ValueError: not a self-play game, ``--shared_lora``, an unknown role, or a checkpoint of another team.
        FileNotFoundError: no such checkpoint."""
    where = opponent_checkpoint(config.algo.opponent)
    if where is None:
        if config.algo.opponent_role is not None:
            raise ValueError(f"--opponent_role {config.algo.opponent_role!r} names the role played from --opponent checkpoint:PATH; give --opponent too")
        return None
    if not self_play:
        raise ValueError(f"--opponent {config.algo.opponent}: a checkpoint plays one side of a self-play game (textarena:<id> with a "
                         f"two-agent profile such as --profile_path game_seats); --env_name {config.env.env_name} with this profile is not one")
    if config.model.shared_lora:
        raise ValueError("--opponent checkpoint:PATH swaps one role's adapter, but with --shared_lora every role speaks through one")
    role = opponent_role(config, roles)
    if role not in roles:
        raise ValueError(f"--opponent_role must be one of {roles} (the role played from --opponent), got {role!r}")
    try:
        found = find_checkpoint(where)
    except FileNotFoundError as missing:
        raise FileNotFoundError(f"--opponent {config.algo.opponent}: {str(missing).replace('--load_path ', '')}") from None
    saved, _ = read_checkpoint_meta(found)
    differs = team_differences(saved.get("model", {}), config.model)
    if differs:
        raise ValueError(f"--opponent {config.algo.opponent}: {found} is of another team ({', '.join(differs)} differ)")
    return role


def load_role_adapter(team, role: str, checkpoint: Path) -> None:
    """``role``'s adapter takes its weights from ``checkpoint`` (a ``steps_<N>`` folder of the same team).

    Raises:
        CheckpointError: the checkpoint's adapter for the role is missing, unreadable or of another shape."""
    adapter = team.agent_adapters[[spec.role for spec in team.profile].index(role)]
    set_adapter_weights(team, adapter, read_adapter(checkpoint, adapter, team.device), checkpoint)


def load_opponent(team, config) -> str | None:
    """The opponent role's adapter takes its weights from ``--opponent``'s checkpoint; returns that role (None
    without ``--opponent``).

    Raises:
        CheckpointError: the checkpoint's adapter for the role is missing, unreadable or of another shape."""
    where = opponent_checkpoint(config.algo.opponent)
    if where is None:
        return None
    role = opponent_role(config, [spec.role for spec in team.profile])
    load_role_adapter(team, role, find_checkpoint(where))
    return role
