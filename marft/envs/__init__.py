"""Environments for agent teams, and a small registry to build them by name.

    >>> from marft import envs
    >>> env = envs.make("math", dataset_path="arithmetic", horizon=2)
    >>> env = envs.make("relay_sum", split="test")   # the cooperative toy task
    >>> env = envs.make("route", split="test")       # the orchestration toy task
    >>> env = envs.make("my_package.my_module:MyEnv", split="test")   # any importable class, by path

A name is found, in this order: the registry (:func:`register`), an import path ``"module:Attr"``,
then the ``marft.envs`` entry points of installed packages (``[project.entry-points."marft.envs"]``
``agree = "my_package.agree:AgreeEnv"`` makes ``--env_name agree`` work once the package is installed).
The shipped environments are registered with gymnasium too (``gymnasium.make("marft/Math-v0")``).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from importlib.metadata import entry_points

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


ENTRY_POINT_GROUP = "marft.envs"
"""The entry-point group installed packages declare their environments in."""


def _import(entry_point: str, name: str) -> Callable[..., MultiAgentTextEnv]:
    """``"package.module:Attr"`` imported; a clear ``ValueError`` naming ``name`` when that fails."""
    module, _, attr = entry_point.partition(":")
    try:
        found = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"environment {name!r}: cannot import {entry_point!r} ({type(error).__name__}: {error}); "
                         "is the module on PYTHONPATH (or installed) and the class name right?") from error
    if not callable(found):
        raise ValueError(f"environment {name!r}: {entry_point!r} is not a class or callable")
    return found


def resolve(name: str) -> Callable[..., MultiAgentTextEnv]:
    """The class (or factory) ``name`` stands for: a registered name, an import path ``"module:Attr"``, or an
    installed package's ``marft.envs`` entry point.

    Raises:
        ValueError: none of those; the message lists the registered names and how to add one.
    """
    if name in _REGISTRY:
        entry = _REGISTRY[name]
        return _import(entry, name) if isinstance(entry, str) else entry
    if name.startswith("textarena:"):  # a TextArena game: textarena:TicTacToe-v0
        from marft.envs.textarena_env import TextArenaEnv

        return functools.partial(TextArenaEnv, name.split(":", 1)[1])
    if ":" in name:
        return _import(name, name)
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        if entry.name == name:
            return _import(entry.value, name)
    raise ValueError(
        f"unknown environment {name!r}; registered: {', '.join(registered())}. Pass an import path "
        f"(--env_name my_package.my_module:MyEnv), call marft.envs.register({name!r}, ...) in Python, or declare an "
        f"entry point in the {ENTRY_POINT_GROUP!r} group of an installed package"
    )


def make(name: str, **kwargs) -> MultiAgentTextEnv:
    """Build the environment ``name`` (see :func:`resolve`) with ``kwargs``.

    Returns:
        MultiAgentTextEnv: a new, not yet reset environment (no gymnasium wrappers).
    """
    return resolve(name)(**kwargs)


register("math", "marft.envs.math.env:MathEnv")
register("relay_sum", "marft.envs.cooperative:RelaySumEnv")
register("code", "marft.envs.code.env:CodeEnv")
register("route", "marft.envs.route:RouteEnv")

GYM_IDS = {"math": "marft/Math-v0", "relay_sum": "marft/RelaySum-v0", "code": "marft/Code-v0", "route": "marft/Route-v0"}
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
    "resolve",
]
