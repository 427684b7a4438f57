"""Checkpoints: ``checkpoints/steps_<N>/`` written whole or not at all.

Layout of one checkpoint::

    steps_<N>/
      <adapter>/adapter_model.safetensors, adapter_config.json   # one PEFT folder per role (and ``critic``)
      value_head.safetensors                                     # the critic's value head
      optimizers.pt                                              # optimizer states (tensors only)
      trainer_state.json                                         # iteration, env steps, counters, RNG states
      config.json                                                # the resolved run config

A checkpoint is written into a temporary sibling folder and renamed into place
when complete, so an interrupted save never replaces a good checkpoint.
"""

from __future__ import annotations

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

from marft.agents.team import CRITIC_ADAPTER, AgentTeam

logger = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^steps_(\d+)$")


def rng_state() -> dict:
    """Python, numpy and torch RNG states in JSON-safe form."""
    return {
        "python": _jsonable(random.getstate()),
        "numpy": _jsonable(np.random.get_state(legacy=False)),
        "torch": torch.get_rng_state().tolist(),
    }


def set_rng_state(state: dict) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    np.random.set_state(state["numpy"])
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))


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


def save_checkpoint(checkpoint_root: Path, step: int, team: AgentTeam, trainer, trainer_state: dict, config_json: str) -> Path:
    """Write ``checkpoint_root/steps_<step>`` atomically and return its path."""
    checkpoint_root = Path(checkpoint_root)
    checkpoint_root.mkdir(parents=True, exist_ok=True)
    final = checkpoint_root / f"steps_{step}"
    tmp = checkpoint_root / f".steps_{step}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for adapter in team.policy_adapters + [CRITIC_ADAPTER]:
        team.model.save_pretrained(tmp, selected_adapters=[adapter])
    save_file({k: v.detach().cpu().contiguous() for k, v in team.value_head.state_dict().items()}, tmp / "value_head.safetensors")
    torch.save(trainer.state_dict(), tmp / "optimizers.pt")
    (tmp / "trainer_state.json").write_text(json.dumps({**trainer_state, "rng": rng_state()}))
    (tmp / "config.json").write_text(config_json)
    for stale in (final,) if final.exists() else ():
        shutil.rmtree(stale)
    os.replace(tmp, final)
    logger.info("saved checkpoint %s", final)
    return final


def load_checkpoint(path: str | Path, team: AgentTeam, trainer) -> dict:
    """Restore adapters (trainable), value head, optimizers and RNG states; return the trainer state."""
    path = Path(path)
    if not (path / "trainer_state.json").is_file():
        raise FileNotFoundError(f"{path} is not a checkpoint folder (no trainer_state.json); pass a checkpoints/steps_<N> folder")
    for adapter in team.policy_adapters + [CRITIC_ADAPTER]:
        weights = path / adapter / "adapter_model.safetensors"
        if not weights.is_file():
            raise FileNotFoundError(f"checkpoint {path} has no adapter {adapter!r} ({weights} missing): was it saved by a different team?")
        result = set_peft_model_state_dict(team.model, load_file(weights, device=str(team.device)), adapter_name=adapter)
        if getattr(result, "unexpected_keys", None):
            raise ValueError(f"{weights} holds weights this model does not have: {result.unexpected_keys[:3]}")
    team.value_head.load_state_dict(load_file(path / "value_head.safetensors", device=str(team.device)))
    trainer.load_state_dict(torch.load(path / "optimizers.pt", map_location=team.device, weights_only=True))
    state = json.loads((path / "trainer_state.json").read_text())
    set_rng_state(state.pop("rng"))
    return state
