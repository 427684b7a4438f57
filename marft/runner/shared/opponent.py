"""A self-play game's other side played by someone other than the team's own adapter for it:

* ``--opponent checkpoint:PATH``: one role of the team (``--opponent_role``, default the profile's last) takes its
  adapter from PATH and is never trained, so the other roles train against a fixed player (a strong past run, a warm
  start) while they start from ``--load_path`` or from scratch. The weights are loaded when the run starts RL, after a
  warm start's checkpoint (:func:`load_opponent`), replacing that role's adapter. A resumed run does not reload them:
  its checkpoint holds the frozen weights it played with, even if PATH (a run directory) has a newer checkpoint since.
* ``--opponent pool:K`` (two-seat games): the opponent role plays each game with one of the K latest snapshots of the
  other role's adapter (:class:`OpponentPool`), drawn per game, a snapshot taken every ``--opponent_refresh``
  iterations; the snapshots are frozen adapters of the one model (megabytes each), saved in every checkpoint.

Both are checked before the model loads (:func:`check_opponent`); the opponent role joins ``--frozen_roles``."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from marft.faults import CheckpointError
from marft.runner.shared.checkpoint import find_checkpoint, read_adapter, read_checkpoint_meta, set_adapter_weights

CHECKPOINT = "checkpoint:"
POOL = "pool:"
POOL_PREFIX = "pool_"
"""A pool snapshot's adapter is ``pool_<slot>``."""
SAME_TEAM = ("model_name_or_path", "profile_path", "lora_r", "lora_target_modules", "shared_lora")
"""Model settings two checkpoints must share for one's adapter to play in the other's team."""


def parse_opponent(opponent: str | None) -> tuple[str, str | int] | None:
    """``("checkpoint", PATH)`` or ``("pool", K)``; None without an opponent.

    Raises:
        ValueError: another form, or a pool size that is not a whole number of at least 1."""
    if opponent is None:
        return None
    if opponent.startswith(CHECKPOINT) and opponent[len(CHECKPOINT):].strip():
        return "checkpoint", opponent[len(CHECKPOINT):].strip()
    if opponent.startswith(POOL):
        size = opponent[len(POOL):].strip()
        if not size.isdigit() or int(size) < 1:
            raise ValueError(f"--opponent {opponent!r}: pool:K takes the number of snapshots K, a whole number of at least 1 (e.g. pool:4)")
        return "pool", int(size)
    raise ValueError(f"--opponent {opponent!r}: give checkpoint:PATH (a checkpoint or run directory of the same team) or pool:K "
                     "(the K latest snapshots of the trained role); the random player of a one-agent game is the environment's "
                     "own (--profile_path with one agent)")


def opponent_checkpoint(opponent: str | None) -> str | None:
    """The PATH of ``checkpoint:PATH``; None without one (no opponent, or a pool).

    Raises:
        ValueError: a form that is neither (:func:`parse_opponent`)."""
    parsed = parse_opponent(opponent)
    return parsed[1] if parsed is not None and parsed[0] == "checkpoint" else None


def pool_size(opponent: str | None) -> int | None:
    """K of ``pool:K``; None without a pool."""
    parsed = parse_opponent(opponent)
    return parsed[1] if parsed is not None and parsed[0] == "pool" else None


def team_differences(other_model: dict, model_config) -> list[str]:
    """The flags of :data:`SAME_TEAM` whose values in ``other_model`` (a checkpoint's saved ``model`` section, or a
    ModelConfig's fields) differ from ``model_config``'s."""
    return [f"--{f}" for f in SAME_TEAM if f in other_model and other_model[f] != getattr(model_config, f)]


def opponent_role(config, roles: list[str]) -> str:
    """``--opponent_role``, or the profile's last role."""
    return config.algo.opponent_role or roles[-1]


def check_opponent(config, roles: list[str], self_play: bool) -> str | None:
    """Before the model loads: ``--opponent`` is one of its forms, in a self-play game, for one of the team's roles; a
    checkpoint exists and is of this team; a pool plays a two-seat game on the team's own model. Returns the opponent
    role, which the caller freezes (None without ``--opponent``).

    Raises:
        ValueError: not a self-play game, ``--shared_lora``, an unknown role, a checkpoint of another team, a pool
            outside a two-agent profile, on its first role, with ``--on_collapse rollback`` or on the vLLM engine.
        FileNotFoundError: no such checkpoint."""
    parsed = parse_opponent(config.algo.opponent)
    if parsed is None:
        if config.algo.opponent_role is not None:
            raise ValueError(f"--opponent_role {config.algo.opponent_role!r} names the role played from --opponent (checkpoint:PATH or "
                             "pool:K); give --opponent too")
        return None
    kind, where = parsed
    if not self_play:
        raise ValueError(f"--opponent {config.algo.opponent}: {'a checkpoint' if kind == 'checkpoint' else 'a pool'} plays one side of a "
                         f"self-play game (textarena:<id> with a two-agent profile such as --profile_path game_seats); "
                         f"--env_name {config.env.env_name} with this profile is not one")
    if config.model.shared_lora:
        raise ValueError(f"--opponent {config.algo.opponent} swaps one role's adapter, but with --shared_lora every role speaks through one")
    role = opponent_role(config, roles)
    if role not in roles:
        raise ValueError(f"--opponent_role must be one of {roles} (the role played from --opponent), got {role!r}")
    if kind == "pool":
        if len(roles) != 2:
            raise ValueError(f"--opponent {config.algo.opponent}: a pool holds snapshots of the one trained role of a two-seat game; "
                             f"this profile has {len(roles)} roles ({', '.join(roles)})")
        if role != roles[1]:
            raise ValueError(f"--opponent {config.algo.opponent} plays the profile's second role ({roles[1]}): the run's training "
                             f"accuracy and checkpoints/best follow the first role's games, the one that trains; "
                             f"--opponent_role {role!r} would make them the snapshots'")
        if config.runner.on_collapse == "rollback":
            raise ValueError(f"--opponent {config.algo.opponent}: the training accuracy is the win rate against the pool, which is "
                             "meant to fall as the pool catches up with the trained role; --on_collapse rollback (the default) would "
                             "undo that progress: give --on_collapse warn (or stop)")
        if config.model.generation_backend == "vllm":
            raise ValueError(f"--opponent {config.algo.opponent} samples each game's snapshot with the team's own model; "
                             "the vLLM engine serves the team's adapters only: use --generation_backend decode_loop")
        return role
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


class OpponentPool:
    """The K latest snapshots of the trained role's adapter (``--opponent pool:K``), frozen adapters ``pool_0 ..
    pool_<K-1>`` of the team's one model, and which one plays each game.

    Snapshot n (n = 0, 1, ...) is taken at iteration ``n · refresh`` into slot ``n mod K``, replacing the oldest; the
    first is the adapter training starts from (:meth:`start`). Which slots hold one, and the snapshot each game of a
    round plays (:meth:`draw`), follow from the iteration and the run's seed alone, so a resumed run (whose checkpoint
    holds the snapshots) goes on exactly.

    Args:
        team: the agent team (its :class:`~marft.agents.adapters.AdapterBank` gets the pool's adapters).
        size: K.
        refresh: iterations between snapshots (``--opponent_refresh``).
        opponent: the agent that plays from the pool (``--opponent_role``'s index); the other agent is the trained one.
    """

    def __init__(self, team, size: int, refresh: int, opponent: int):
        self.team, self.size, self.refresh, self.opponent = team, size, refresh, opponent
        self.trained_adapter = team.agent_adapters[1 - opponent]
        """The adapter the snapshots are taken of."""
        self.adapters = [f"{POOL_PREFIX}{slot}" for slot in range(size)]
        """The snapshots' adapter names, by slot."""
        for name in self.adapters:
            team.bank.add_frozen_copies({self.trained_adapter: name})
        team.set_active(None)
        team.pool_adapters = list(self.adapters)  # saved and restored with every checkpoint

    def filled(self, iteration: int) -> int:
        """Slots holding a snapshot during ``iteration``."""
        return min(iteration // self.refresh + 1, self.size)

    def start(self) -> None:
        """Every slot takes the trained adapter as it is now (the run starts RL): snapshot 0."""
        for name in self.adapters:
            self.team.bank.copy_weights(self.trained_adapter, name)

    def before_iteration(self, iteration: int) -> str | None:
        """At a snapshot's iteration (a positive multiple of ``refresh``) the trained adapter is copied into its slot;
        returns that slot's adapter (None at other iterations)."""
        if iteration == 0 or iteration % self.refresh:
            return None
        name = self.adapters[(iteration // self.refresh) % self.size]
        self.team.bank.copy_weights(self.trained_adapter, name)
        return name

    def draw(self, seed: int, rank: int, iteration: int, round_index: int, n_envs: int, group_size: int = 1) -> list[str]:
        """The snapshot each of ``n_envs`` games of a round plays, uniformly among the filled slots, drawn from
        ``(seed, rank, iteration, round)`` alone; the ``group_size`` games of one group (GRPO's, on one task) face one
        snapshot, so their group baseline compares the trained role's games, not its opponents' strengths."""
        rng = np.random.default_rng([seed, rank, iteration, round_index, 76])  # 76: a stream of its own
        slots = rng.integers(self.filled(iteration), size=n_envs // group_size).repeat(group_size)  # (E,)
        return [self.adapters[slot] for slot in slots]

    def check_resume(self, saved_config: dict, path: Path) -> None:
        """A run resumed (not warm-started) from ``path`` goes on with its checkpoint's pool: the same K and refresh, every
        slot in it.

        Raises:
            CheckpointError: ``--opponent`` or ``--opponent_refresh`` changed, or a snapshot is missing."""
        algo = saved_config.get("algo", {})
        was = (algo.get("opponent"), algo.get("opponent_refresh"))
        if pool_size(was[0]) != self.size or was[1] != self.refresh:
            raise CheckpointError(f"cannot resume from {path} with --opponent pool:{self.size} --opponent_refresh {self.refresh}: it was "
                                  f"saved with --opponent {was[0]} --opponent_refresh {was[1]}, and the pool's snapshots and schedule are "
                                  "the checkpoint's (start a new run from it with a warm start instead)")
        missing = [name for name in self.adapters if not (path / name / "adapter_model.safetensors").is_file()]
        if missing:
            raise CheckpointError(f"cannot resume from {path}: its opponent pool lacks {', '.join(missing)}")
