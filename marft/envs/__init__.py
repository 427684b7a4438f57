"""Environments for agent teams, and a small registry to build them by name.

    >>> from marft import envs
    >>> env = envs.make("math", dataset_path="arithmetic", horizon=2)
    >>> env = envs.make("relay_sum", split="test")   # the cooperative toy task
    >>> env = envs.make("route", split="test")       # the orchestration toy task
    >>> env = envs.make("my_package.my_module:MyEnv", split="test")   # any importable class, by path
    >>> env = envs.make("guess")     # a folder marft/envs/guess/ whose env.py defines one CustomEnv subclass

A name is found, in this order: the registry (:func:`register`), an import path ``"module:Attr"``, a folder
``marft/envs/<name>/`` (as the original MARFT lays envs out: its ``ENV`` attribute, or the one :class:`CustomEnv`
subclass its ``env`` module defines), then the ``marft.envs`` entry points of installed packages (``[project.entry-points."marft.envs"]``
``agree = "my_package.agree:AgreeEnv"`` makes ``--env_name agree`` work once the package is installed).
The shipped environments are registered with gymnasium too (``gymnasium.make("marft/Math-v0")``).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Callable
from importlib.metadata import entry_points

import gymnasium

from marft.envs.base import CustomEnv, EpisodeState, MultiAgentTextEnv, StepOutcome
from marft.envs.profile import AgentSpec, load_profile
from marft.envs.textarena.env import TextArenaEnv

_REGISTRY: dict[str, str | Callable[..., CustomEnv]] = {}


def register(name: str, entry_point: str | Callable[..., CustomEnv]) -> None:
    """Make ``make(name)`` build ``entry_point``: a class/callable, or ``"module:Attr"`` (imported lazily)."""
    if isinstance(entry_point, str) and ":" not in entry_point:
        raise ValueError(f"entry_point {entry_point!r} must look like 'package.module:ClassName'")
    _REGISTRY[name] = entry_point


def registered() -> list[str]:
    """Names accepted by ``make``, sorted."""
    return sorted(_REGISTRY)


ENTRY_POINT_GROUP = "marft.envs"
"""The entry-point group installed packages declare their environments in."""


def _import(entry_point: str, name: str) -> Callable[..., CustomEnv]:
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


def resolve(name: str) -> Callable[..., CustomEnv]:
    """The class (or factory) ``name`` stands for: a registered name, a TextArena game (``textarena:<id>``), an
    import path ``"module:Attr"``, a folder ``marft/envs/<name>/`` (:func:`_folder_env`), or an installed package's
    ``marft.envs`` entry point.

    Raises:
        ValueError: none of those; the message lists the registered names and how to add one.
    """
    if name in _REGISTRY:
        entry = _REGISTRY[name]
        return _import(entry, name) if isinstance(entry, str) else entry
    if name.startswith("textarena:"):  # a TextArena game: textarena:TicTacToe-v0

        return functools.partial(TextArenaEnv, name.split(":", 1)[1])
    if ":" in name:
        return _import(name, name)
    folder = _folder_env(name)
    if folder is not None:
        return folder
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        if entry.name == name:
            return _import(entry.value, name)
    raise ValueError(
        f"unknown environment {name!r}; registered: {', '.join(registered())}. Pass an import path "
        f"(--env_name my_package.my_module:MyEnv), call marft.envs.register({name!r}, ...) in Python, or declare an "
        f"entry point in the {ENTRY_POINT_GROUP!r} group of an installed package"
    )


def _folder_env(name: str) -> Callable[..., CustomEnv] | None:
    """The env of the folder ``marft/envs/<name>/`` (a package): its ``ENV`` attribute, else the one
    :class:`CustomEnv` subclass defined in its ``env`` module. None: no such folder.

    Raises:
        ValueError: the folder defines no env, or several without an ``ENV`` to choose.
    """
    if not name.isidentifier():
        return None
    module_name = f"{__name__}.{name}"
    spec = importlib.util.find_spec(module_name)
    if spec is None or spec.submodule_search_locations is None:
        return None
    package = importlib.import_module(module_name)
    if hasattr(package, "ENV"):
        return package.ENV
    if importlib.util.find_spec(f"{module_name}.env") is None:
        raise ValueError(f"environment {name!r}: the folder {spec.submodule_search_locations[0]} has no env.py "
                         "(and its __init__.py sets no ENV)")
    module = importlib.import_module(f"{module_name}.env")
    found = [value for value in vars(module).values()
             if isinstance(value, type) and issubclass(value, CustomEnv) and value.__module__ == module.__name__]
    if len(found) != 1:
        names = ", ".join(cls.__name__ for cls in found) or "none"
        raise ValueError(f"environment {name!r}: {module.__name__} must define exactly one CustomEnv subclass "
                         f"(found {names}); set ENV = YourEnv in its __init__.py to choose")
    return found[0]


def make(name: str, **kwargs) -> CustomEnv:
    """Build the environment ``name`` (see :func:`resolve`) with ``kwargs``.

    Returns:
        CustomEnv: a new, not yet reset environment (no gymnasium wrappers).
    """
    return resolve(name)(**kwargs)


register("math", "marft.envs.math.env:MathEnv")
register("relay_sum", "marft.envs.relay_sum.env:RelaySumEnv")
register("code", "marft.envs.code.env:CodeEnv")
register("route", "marft.envs.route.env:RouteEnv")

GYM_IDS = {"math": "marft/Math-v0", "relay_sum": "marft/RelaySum-v0", "code": "marft/Code-v0", "route": "marft/Route-v0"}
"""gymnasium ids of the registered environments."""
for _name, _gym_id in GYM_IDS.items():
    if _gym_id not in gymnasium.registry:
        gymnasium.register(id=_gym_id, entry_point=_REGISTRY[_name])

__all__ = [
    "AgentSpec",
    "CustomEnv",
    "EpisodeState",
    "MultiAgentTextEnv",
    "StepOutcome",
    "load_profile",
    "make",
    "register",
    "registered",
    "resolve",
]
