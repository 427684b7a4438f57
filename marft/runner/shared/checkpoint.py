"""Checkpoints: ``checkpoints/steps_<N>/`` written whole or not at all.

Layout of one checkpoint::

    steps_<N>/
      <adapter>/adapter_model.safetensors, adapter_config.json   # one PEFT folder per role (and ``critic``)
      ref_<adapter>/...                                          # with --kl_reference initial: the frozen KL reference
      pool_<k>/...                                               # with --opponent pool:K: the opponent pool's snapshots
      value_head.safetensors                                     # the critic's value head (not in critic-free runs)
      optimizers.pt                                              # optimizer states and counters (tensors, numbers)
      trainer_state.json                                         # iteration, env steps, roles, counters, RNG states
                                                                 # (python, numpy, torch), every env's np_random and
                                                                 # current episode, the running episode returns
      config.json                                                # the resolved run config
      manifest.json                                              # size and SHA-256 of every file, written last

A checkpoint is written into a temporary sibling folder (``.steps_<N>.tmp-<pid>``), flushed
to disk and renamed into place when complete, so an interrupted save (even ``kill -9``) never
replaces a good checkpoint; the next start removes the partial folder. Loading never
unpickles arbitrary objects (safetensors, ``torch.load(weights_only=True)``, JSON), checks
every file against the manifest, and names the file that is missing, truncated or corrupted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from peft import set_peft_model_state_dict
from safetensors.torch import load_file, save_file

from marft.agents.critic import CRITIC_ADAPTER
from marft.agents.team import AgentTeam
from marft.config import TrainConfig
from marft.envs.profile import load_profile
from marft.faults import CheckpointError, CheckpointWriteError
from marft.runner.shared.storage import describe_write_error, free_bytes, human_bytes

logger = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^steps_(\d+)$")
PARTIAL_DIR = re.compile(r"^\.(?:steps_\d+|best)\.(?:tmp|old)-(\d+)$")
MANIFEST = "manifest.json"
BEST = "best"
"""``checkpoints/best``: the checkpoint of a run's best moving training accuracy (:mod:`marft.runner.shared.best`),
written atomically like the others and never pruned."""


def rng_state() -> dict:
    """Python, numpy and torch (CPU and every CUDA device) RNG states in JSON-safe form."""
    state = {
        "python": _jsonable(random.getstate()),
        "numpy": _jsonable(np.random.get_state(legacy=False)),
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    np.random.set_state(state["numpy"])
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if state.get("cuda") and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def _jsonable(obj):
    if isinstance(obj, (tuple, list)):
        return [_jsonable(o) for o in obj]
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.integer):
        return int(obj)
    return obj


def save_checkpoint(
    checkpoint_root: Path, step: int, team: AgentTeam, trainer, trainer_state: dict, config_json: str, keep: int = 0,
    name: str | None = None,
) -> Path:
    """Write ``checkpoint_root/steps_<step>`` (or ``checkpoint_root/<name>``, e.g. :data:`BEST`) atomically and
    return its path.

    Everything is written into ``.<name>.tmp-<pid>``, flushed to disk, and renamed into place;
    ``manifest.json`` (size and SHA-256 of every file) is written last. With ``keep > 0`` only the
    newest ``keep`` ``steps_<N>`` checkpoints are kept (a named one is never pruned).

    Raises:
        CheckpointError: a trainable weight is NaN or inf (nothing is written).
        CheckpointWriteError: a write failed (disk full, quota, any I/O error): the partial folder is removed,
            an earlier checkpoint of the same step is kept, and the message names the checkpoint, the free space
            and the last complete checkpoint.
    """
    bad = nonfinite_parameters(team)
    if bad:
        raise CheckpointError(
            f"refusing to save checkpoint {name or f'steps_{step}'}: non-finite weights in {', '.join(bad[:5])}"
            + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        )
    checkpoint_root = Path(checkpoint_root)
    name = name or f"steps_{step}"
    final = checkpoint_root / name
    tmp = checkpoint_root / f".{name}.tmp-{os.getpid()}"
    old = checkpoint_root / f".{name}.old-{os.getpid()}"
    try:
        checkpoint_root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        for adapter in [*team.adapters, *team.reference_adapters.values(), *team.pool_adapters]:
            team.model.save_pretrained(tmp, selected_adapters=[adapter], save_embedding_layers=False)
        if team.has_critic:
            save_file({k: v.detach().cpu().contiguous() for k, v in value_head_state(team).items()}, tmp / "value_head.safetensors")
        torch.save(trainer.state_dict(), tmp / "optimizers.pt")
        (tmp / "trainer_state.json").write_text(json.dumps({**trainer_state, "rng": rng_state()}))
        (tmp / "config.json").write_text(config_json)
        _write_manifest(tmp)
        _fsync_tree(tmp)
        if final.exists():  # re-saving a step: keep the old one until the new one is in place
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(checkpoint_root)
    except Exception as error:  # noqa: BLE001 - ENOSPC, EDQUOT, torch's iostream errors, safetensors' errors alike
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not final.exists():
            os.replace(old, final)  # the earlier save of this step stays
        raise CheckpointWriteError(write_failure_message(final, error)) from error
    shutil.rmtree(old, ignore_errors=True)
    logger.info("saved checkpoint %s", final)
    if keep:
        prune_checkpoints(checkpoint_root, keep)
    return final


def write_failure_message(final: Path, error: BaseException) -> str:
    """The one line for a checkpoint that could not be written: which, why, the free space, the last complete one."""
    last = latest_checkpoint(final.parent)
    return (
        f"could not write checkpoint {final.name} ({final}): {describe_write_error(error)}; "
        f"{human_bytes(free_bytes(final.parent))} free there; the partial folder was removed; "
        + (f"the last complete checkpoint is {last}" if last is not None else "there is no complete checkpoint yet")
    )


def nonfinite_parameters(team: AgentTeam) -> list[str]:
    """Names of the trainable weights (adapters, value head) holding a NaN or inf."""
    bad = [n for n, p in team.model.named_parameters() if "lora_" in n and not torch.isfinite(p).all()]
    return bad + [f"value_head.{n}" for n, p in (team.critic.value_heads.named_parameters() if team.critic else ()) if not torch.isfinite(p).all()]


def value_head_state(team: AgentTeam) -> dict[str, torch.Tensor]:
    """The critics' value heads as saved: ``weight``, ``bias`` for the shared critic (the format of every
    earlier checkpoint), ``<critic>.weight``, ``<critic>.bias`` per critic with per-agent critics."""
    state = team.critic.value_heads.state_dict()
    if team.critic_adapters == [CRITIC_ADAPTER]:
        return {k.removeprefix(CRITIC_ADAPTER + "."): v for k, v in state.items()}
    return state


def load_value_head_state(team: AgentTeam, state: dict[str, torch.Tensor]) -> None:
    if team.critic_adapters == [CRITIC_ADAPTER]:
        state = {f"{CRITIC_ADAPTER}.{k}": v for k, v in state.items()}
    team.critic.value_heads.load_state_dict(state)


def trainable_weights(team: AgentTeam) -> dict[str, torch.Tensor]:
    """Copies of every adapter weight (``model.<name>``) and the value heads (``value_head.<name>``): what a
    rollback or the best checkpoint's evaluation replaces, to be put back by :func:`set_trainable_weights`."""
    weights = {f"model.{name}": p.detach().clone() for name, p in team.model.named_parameters() if "lora_" in name}
    if team.has_critic:
        weights.update({f"value_head.{k}": v.detach().clone() for k, v in value_head_state(team).items()})
    return weights


def set_trainable_weights(team: AgentTeam, weights: dict[str, torch.Tensor]) -> None:
    """Copy :func:`trainable_weights`'s ``weights`` back into the team."""
    params = dict(team.model.named_parameters())
    with torch.no_grad():
        for name, tensor in weights.items():
            if name.startswith("model."):
                params[name[len("model."):]].copy_(tensor)
    if team.has_critic:
        load_value_head_state(team, {k[len("value_head."):]: v for k, v in weights.items() if k.startswith("value_head.")})


def read_checkpoint_meta(path: str | Path) -> tuple[dict, dict]:
    """``(config, trainer_state)`` of a checkpoint, read as JSON and checked against its manifest."""
    path = Path(path)
    if not (path / "trainer_state.json").is_file():
        raise FileNotFoundError(f"{path} is not a checkpoint folder (no trainer_state.json); pass a checkpoints/steps_<N> folder or a run directory")
    _verify_manifest(path)
    return _read_json(path / "config.json"), _read_json(path / "trainer_state.json")


def read_trainer_state(path: str | Path) -> dict:
    """A checkpoint's ``trainer_state.json`` alone, not checked against the manifest (that happens on load)."""
    return _read_json(Path(path) / "trainer_state.json")


def load_checkpoint(path: str | Path, team: AgentTeam, trainer, rollback: bool = False, load_optimizers: bool = True) -> dict:
    """Restore adapters (trainable), value head, optimizers and RNG states; return the trainer state.

    ``rollback``: only what the policy and critic are (adapters, value head, optimizer states), for a run that goes
    back to its best checkpoint and trains on: its counters, RNG streams and KL references stay as they are.
    ``load_optimizers`` False (with ``rollback``): the weights alone, to evaluate them.

    Every file is read and checked before anything is changed, and nothing is unpickled:
    tensors come from safetensors and ``torch.load(weights_only=True)``, the rest is JSON.

    Raises:
        FileNotFoundError: ``path`` is not a checkpoint folder.
        CheckpointError: a file is missing, truncated, corrupted or does not fit this team (named in the message).
    """
    path = Path(path)
    _, state = read_checkpoint_meta(path)
    adapters = {adapter: read_adapter(path, adapter, team.device) for adapter in team.adapters}
    references = {}  # the frozen KL references (--kl_reference initial) this checkpoint has; the others start as their adapter
    for _adapter, reference in team.reference_adapters.items():
        weights = path / reference / "adapter_model.safetensors"
        if weights.is_file():
            references[reference] = _read(weights, lambda f: load_file(f, device=str(team.device)))
    pool = {name: read_adapter(path, name, team.device) for name in team.pool_adapters if (path / name / "adapter_model.safetensors").is_file()}
    if team.has_critic and not (path / "value_head.safetensors").is_file():
        raise CheckpointError(f"checkpoint {path} has no critic (value_head.safetensors): it was saved by a critic-free run (GRPO)")
    value_head = _read(path / "value_head.safetensors", lambda f: load_file(f, device=str(team.device))) if team.has_critic else None
    optimizers = _read(path / "optimizers.pt", lambda f: torch.load(f, map_location=team.device, weights_only=True))
    for adapter, weights in adapters.items():
        set_adapter_weights(team, adapter, weights, path)
    if rollback:
        if team.has_critic:
            _apply(path / "value_head.safetensors", lambda: load_value_head_state(team, value_head))
        if load_optimizers:
            _apply(path / "optimizers.pt", lambda: trainer.load_optimizer_states(optimizers))
        return state
    for name, weights in pool.items():  # an opponent pool's snapshots (a warm start's are replaced as the run starts RL)
        set_adapter_weights(team, name, weights, path)
    for adapter, reference in team.reference_adapters.items():
        if reference in references:
            set_peft_model_state_dict(team.model, references[reference], adapter_name=reference)
        else:  # training starts here from these adapters (a warm start): they are the reference
            if int(state.get("iteration", 0)) > 0:
                logger.warning("checkpoint %s (iteration %s) has no KL reference for %s (it was saved without one, e.g. with --kl_coef 0): "
                               "the reference is the adapter as resumed, not as its training started", path, state["iteration"], adapter)
            team.bank.copy_weights(adapter, reference)
    if team.has_critic:
        _apply(path / "value_head.safetensors", lambda: load_value_head_state(team, value_head))
    _apply(path / "optimizers.pt", lambda: trainer.load_state_dict(optimizers))
    _apply(path / "trainer_state.json", lambda: set_rng_state(state.pop("rng")))
    return state


# ---------------------------------------------------------------------- finding, cleaning, pruning
def checkpoint_steps(checkpoint_root: Path) -> list[tuple[int, Path]]:
    """``(N, path)`` of the complete checkpoints (``steps_<N>`` with a trainer state) under ``checkpoint_root``, oldest first."""
    root = Path(checkpoint_root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and (p / "trainer_state.json").is_file()]
    return sorted(found)


def latest_checkpoint(checkpoint_root: Path) -> Path | None:
    """The newest complete checkpoint under ``checkpoint_root``, or None."""
    steps = checkpoint_steps(checkpoint_root)
    return steps[-1][1] if steps else None


def find_checkpoint(path: str | Path) -> Path:
    """``path`` itself when it is a checkpoint folder; for a run directory (or its ``checkpoints/``),
    its latest complete checkpoint. Partial (temporary) folders are never chosen."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"--load_path {path} does not exist; pass a checkpoints/steps_<N> folder or a run directory")
    if (path / "trainer_state.json").is_file():
        return path
    for root in (path / "checkpoints", path):
        latest = latest_checkpoint(root)
        if latest is not None:
            return latest
    raise FileNotFoundError(f"--load_path {path} holds no complete checkpoint (no checkpoints/steps_<N>/trainer_state.json)")


def trained_checkpoint(path: str | Path, which: str = "best") -> tuple[Path, str]:
    """The checkpoint ``marft eval | export | play`` take from ``path``, and a line saying which it is.

    ``path`` may be a checkpoint folder (taken as it is), or a run directory (or its ``checkpoints/``): ``which`` is
    ``best`` (``checkpoints/best``, the run's best moving training accuracy; its latest checkpoint when the run has
    none) or ``latest`` (the newest ``steps_<N>``, the policy the run ended with)."""
    path = Path(path)
    if which not in ("best", "latest"):
        raise ValueError(f"--checkpoint must be best or latest, got {which!r}")
    if path.exists() and not (path / "trainer_state.json").is_file() and which == "best":
        for root in (path / "checkpoints", path):
            best = root / BEST
            if (best / "trainer_state.json").is_file():
                state = read_trainer_state(best)
                record = state.get("best_tracker", {}).get("best", {})
                moving = record.get("moving_accuracy")
                figures = f", moving training accuracy {moving:.3f}" if moving is not None else ""
                return best, f"{best} (the run's best: iteration {state.get('iteration')}{figures})"
    found = find_checkpoint(path)
    if found.name == BEST:
        return found, f"{found} (the run's best: iteration {read_trainer_state(found).get('iteration')})"
    note = "as given" if (path / "trainer_state.json").is_file() else (
        "the latest" + ("" if which == "latest" else "; the run has no checkpoints/best"))
    return found, f"{found} ({note})"


def cleanup_partial_checkpoints(checkpoint_root: Path) -> list[Path]:
    """Delete temporary folders left by interrupted saves (``.steps_<N>.tmp-<pid>``, ``.old-<pid>``)
    whose process is gone; return what was removed."""
    root = Path(checkpoint_root)
    removed = []
    for p in sorted(root.iterdir()) if root.is_dir() else []:
        m = PARTIAL_DIR.match(p.name)
        if m and not _alive(int(m.group(1))):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
            logger.warning("removed the partial checkpoint %s left by an interrupted save", p)
    return removed


def prune_checkpoints(checkpoint_root: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints (``keep`` 0: none; the newest is never deleted);
    return what was removed."""
    removed = [p for _, p in checkpoint_steps(checkpoint_root)[:-keep]] if keep > 0 else []
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
        logger.info("removed old checkpoint %s (--keep_checkpoints %d)", p, keep)
    return removed


# ---------------------------------------------------------------------- resuming with a config
FIXED_FIELDS = {
    "model": ("model_name_or_path", "n_agents", "shared_lora", "critic_mode", "lora_r", "lora_alpha", "lora_target_modules"),
}
"""Flags that cannot change on resume: they decide which adapters exist and their shapes (roles are checked too)."""
NOT_INHERITED = ("load_path", "output_dir")
"""Runner flags never taken from the checkpoint: where to load from and where to write to."""
BEFORE_THE_FLAG = {"model": {"chat_template": "none"}, "algo": {"kl_coef": 0.0, "max_chunk_mib": 0, "lr_schedule": "constant", "kl_estimator": "k3"}}
"""What a flag meant in checkpoints saved before it existed, when its default now means something else (their prompts
were plain transcripts; they trained without a KL penalty; their update chunks had no budget unless
--max_chunk_tokens gave one; their learning rates were constant); a flag missing from a checkpoint and not listed here
takes today's default."""


def resume_config(config, given: set[str]):
    """The config to resume with: the checkpoint's config, with the flags ``given`` on the command
    line taken from ``config``; ``load_path`` resolved to a ``steps_<N>`` folder.

    Raises:
        CheckpointError: a flag that cannot change (model, agent count, roles, adapter shape) differs.
    """

    path = find_checkpoint(config.runner.load_path)
    saved, state = read_checkpoint_meta(path)
    merged = {}
    current = config.to_dict()
    for section, values in current.items():
        merged[section] = dict(values)
        old = {**BEFORE_THE_FLAG.get(section, {}), **saved.get(section, {})}
        for name in values:
            if name not in given and not (section == "runner" and name in NOT_INHERITED) and name in old:
                merged[section][name] = old[name]
    merged["runner"]["load_path"] = str(path)
    try:
        resumed = TrainConfig.from_dict(merged)
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{path / 'config.json'}: cannot resume with this config: {error}") from error
    problems = resume_incompatibilities(saved, state.get("roles"), resumed)
    if problems:
        raise CheckpointError(f"cannot resume from {path}: " + "; ".join(problems))
    return resumed


def resume_incompatibilities(saved: dict, saved_roles: list[str] | None, config, roles: list[str] | None = None) -> list[str]:
    """What keeps ``config`` (with team ``roles``) from resuming a checkpoint saved with ``saved``."""
    problems = []
    for section, names in FIXED_FIELDS.items():
        for name in names:
            old, new = saved.get(section, {}).get(name), getattr(getattr(config, section), name)
            same = _same_model(old, new) if name == "model_name_or_path" else old == new
            if not same:
                problems.append(f"--{name} was {old!r} in the checkpoint and is {new!r} now (it cannot change on resume)")
    if roles is None and saved_roles is not None and saved.get("model", {}).get("profile_path") != config.model.profile_path:

        roles = [spec.role for spec in load_profile(config.model.profile_path, n_agents=config.model.n_agents)]
    if saved_roles is not None and roles is not None and list(saved_roles) != list(roles):
        problems.append(f"the agent roles were {list(saved_roles)} in the checkpoint and are {list(roles)} now (--profile_path; they cannot change on resume)")
    return problems


def config_changes(saved: dict, config) -> dict[str, tuple]:
    """``{flag: (checkpoint value, current value)}`` for every flag that differs (``load_path`` and ``output_dir`` aside)."""
    changes = {}
    for section, values in config.to_dict().items():
        for name, value in values.items():
            if name not in NOT_INHERITED and name in saved.get(section, {}) and saved[section][name] != value:
                changes[name] = (saved[section][name], value)
    return changes


# ---------------------------------------------------------------------- files
def _write_manifest(folder: Path) -> None:
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    entries = {str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files}
    (folder / MANIFEST).write_text(json.dumps({"files": entries}, indent=1))


def _verify_manifest(folder: Path) -> None:
    """Every file listed in the manifest exists with its size and hash (checkpoints without one are accepted)."""
    manifest = folder / MANIFEST
    if not manifest.is_file():
        logger.warning("checkpoint %s has no %s; its files cannot be verified", folder, MANIFEST)
        return
    for name, entry in _read_json(manifest)["files"].items():
        file = folder / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint file {file} is missing")
        if file.stat().st_size != entry["bytes"]:
            raise CheckpointError(f"checkpoint file {file} is truncated or corrupted: {file.stat().st_size} bytes, {entry['bytes']} were written")
        if _sha256(file) != entry["sha256"]:
            raise CheckpointError(f"checkpoint file {file} is corrupted: its SHA-256 differs from the one written")


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_adapter(path: Path, adapter: str, device) -> dict[str, torch.Tensor]:
    """The weights of ``adapter`` in checkpoint ``path`` (its ``<adapter>/adapter_model.safetensors``).

    Raises:
        CheckpointError: the checkpoint has no such adapter, or its file cannot be read."""
    weights = path / adapter / "adapter_model.safetensors"
    if not weights.is_file():
        raise CheckpointError(f"checkpoint {path} has no adapter {adapter!r} ({weights} missing): was it saved by a different team?")
    return _read(weights, lambda f: load_file(f, device=str(device)))


def set_adapter_weights(team: AgentTeam, adapter: str, weights: dict[str, torch.Tensor], path: Path) -> None:
    """``adapter`` takes ``weights`` (read from checkpoint ``path`` by :func:`read_adapter`).

    Raises:
        CheckpointError: the weights name parameters this team's adapter does not have."""
    result = set_peft_model_state_dict(team.model, weights, adapter_name=adapter)
    team.bank.mark_changed(adapter)
    if getattr(result, "unexpected_keys", None):
        raise CheckpointError(f"{path / adapter / 'adapter_model.safetensors'} holds weights this model does not have: {result.unexpected_keys[:3]}")


def _read_json(file: Path) -> dict:
    return _read(file, lambda f: json.loads(Path(f).read_text()))


def _read(file: Path, load):
    """``load(file)``, any failure re-raised as a ``CheckpointError`` naming the file."""
    if not Path(file).is_file():
        raise CheckpointError(f"checkpoint file {file} is missing")
    try:
        return load(file)
    except Exception as error:  # noqa: BLE001 - safetensors, torch, pickle and json errors alike
        raise CheckpointError(f"checkpoint file {file} cannot be read (truncated, corrupted or not a checkpoint file): {type(error).__name__}: {error}") from error


def _apply(file: Path, fn) -> None:
    try:
        fn()
    except CheckpointError:
        raise
    except Exception as error:  # noqa: BLE001 - shape or key mismatches of loaded state
        raise CheckpointError(f"checkpoint file {file} does not fit this team and trainer: {type(error).__name__}: {error}") from error


def _fsync_tree(folder: Path) -> None:
    for p in folder.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    for d in [*(p for p in folder.rglob("*") if p.is_dir()), folder]:
        _fsync_dir(d)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # this process is not saving while it cleans up
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _same_model(a, b) -> bool:
    if a == b:
        return True
    return a is not None and b is not None and Path(a).exists() and Path(b).exists() and Path(a).resolve() == Path(b).resolve()
