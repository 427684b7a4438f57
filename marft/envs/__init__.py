"""Environments for agent teams, and a small registry to build them by name.

    >>> from marft import envs
    >>> env = envs.make("math", dataset_path="arithmetic", horizon=2)
    >>> env = envs.make("relay_sum", split="test")   # the cooperative toy task

The same environments are registered with gymnasium (``gymnasium.make("marft/Math-v0")``).
"""

from __future__ import annotations

import importlib
from typing import Callable

import gymnasium

from marft.envs.base import EpisodeState, MultiAgentTextEnv, StepOutcome
from marft.envs.profile import AgentSpec, load_profile

_REGISTRY: dict[str, str | Callable[..., MultiAgentTextEnv]] = {}


def register(name: str, entry_point: str | Callable[..., MultiAgentTextEnv]) -> None:
    """Make ``make(name)`` build ``entry_point``: a class/callable, or ``"module:Attr"`` (imported lazily)."""
    if isinstance(entry_point, str) and ":" not in entry_point:
        raise ValueError(f"entry_point {entry_point!r} must look like 'package.module:ClassName'")
    _REGISTRY[name] = entry_point


def registered() -> list[str]:
    """Names accepted by ``make``, sorted."""
    return sorted(_REGISTRY)


def _resolve(entry_point: str | Callable[..., MultiAgentTextEnv]) -> Callable[..., MultiAgentTextEnv]:
    if not isinstance(entry_point, str):
        return entry_point
    module, attr = entry_point.split(":")
    return getattr(importlib.import_module(module), attr)


def make(name: str, **kwargs) -> MultiAgentTextEnv:
    """Build the environment registered as ``name`` with ``kwargs``.

    Returns:
        MultiAgentTextEnv: a new, not yet reset environment (no gymnasium wrappers).
    """
    if name not in _REGISTRY:
        raise ValueError(f"unknown environment {name!r}; registered: {', '.join(registered())}")
    return _resolve(_REGISTRY[name])(**kwargs)


register("math", "marft.envs.math.env:MathEnv")
register("relay_sum", "marft.envs.cooperative:RelaySumEnv")
register("code", "marft.envs.code.env:CodeEnv")

GYM_IDS = {"math": "marft/Math-v0", "relay_sum": "marft/RelaySum-v0", "code": "marft/Code-v0"}
"""gymnasium ids of the registered environments."""
for _name, _gym_id in GYM_IDS.items():
    if _gym_id not in gymnasium.registry:
        gymnasium.register(id=_gym_id, entry_point=_REGISTRY[_name])

__all__ = [
    "AgentSpec",
    "EpisodeState",
    "MultiAgentTextEnv",
    "StepOutcome",
    "load_profile",
    "make",
    "register",
    "registered",
]
