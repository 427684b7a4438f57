"""Trainers, chosen by ``--algorithm_name``."""

from marft.algorithms.appo_trainer import APPOTrainer

TRAINERS = {"APPO": APPOTrainer}


def make_trainer(team, config):
    """The trainer registered under ``config.algorithm_name``."""
    return TRAINERS[config.algorithm_name](team, config)
