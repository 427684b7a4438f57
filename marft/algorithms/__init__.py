"""Trainers, chosen by ``--algorithm_name``.

:data:`marft.choices.TRAINERS` is the one table of algorithm names: ``--help``, the config's validation, the
benchmark and :func:`make_trainer` all read it. Entries name their class as ``"module:Class"`` and
are imported on first use, so reading the names imports no model code.
"""

from __future__ import annotations

import importlib

from marft.choices import TRAINERS


def trainer_class(name: str):
    """The trainer class registered as ``name``."""
    if name not in TRAINERS:
        raise ValueError(f"unknown algorithm {name!r}; registered: {', '.join(TRAINERS)}")
    module, attr = TRAINERS[name].split(":")
    return getattr(importlib.import_module(module), attr)


def make_trainer(team, config, steps_per_iteration: int, dist=None, horizon: int = 1):
    """The trainer registered under ``config.algorithm_name``; ``steps_per_iteration`` (env steps collected per
    iteration, all processes together) converts the agent schedule, counted in env steps, into iterations;
    ``dist`` is the process group of a data-parallel run (None: one process); ``horizon``: the env's team steps per
    episode (a group-relative trainer's round: one group episode per env per round)."""
    cls = trainer_class(config.algorithm_name)
    trainer = cls(team, config, steps_per_iteration=steps_per_iteration, **({} if dist is None else {"dist": dist}))
    if cls.group_relative:
        trainer.round_length = horizon
    return trainer
