"""Old import paths of modules that moved, kept for one release: each old module becomes the new one (the same
module object, so attributes, monkeypatching and ``isinstance`` agree) and warns once with a
``DeprecationWarning`` naming the new path. CHANGELOG.md lists the moves."""

from __future__ import annotations

import importlib
import sys
import warnings

MOVED: dict[str, str] = {
    **{f"marft.rollout.{name}": f"marft.runner.shared.{name}" for name in ("buffer", "collector", "evaluation", "turns")},
    **{f"marft.training.{name}": f"marft.runner.shared.{name}"
       for name in ("best", "checkpoint", "diagnostics", "preemption", "runner", "storage")},
    "marft.envs.cooperative": "marft.envs.relay_sum.env",
    "marft.envs.textarena_env": "marft.envs.textarena.env",
    "marft.envs.pettingzoo_env": "marft.envs.pettingzoo.env",
    "marft.envs.code.sandbox": "marft.sandbox",
    "marft.envs.code.harness": "marft.sandbox.harness",
}
"""Old module path -> where it lives now (issue 75: the layout the specification names)."""


def alias(old: str) -> None:
    """Make the module being imported as ``old`` the module it moved to, with a ``DeprecationWarning``."""
    new = MOVED[old]
    warnings.warn(f"{old} moved to {new}; the old path goes in the next release", DeprecationWarning, stacklevel=3)
    sys.modules[old] = importlib.import_module(new)
