"""Trainers, chosen by ``--algorithm_name``."""

from marft.algorithms.appo_trainer import APPOTrainer
from marft.algorithms.tppo_trainer import TPPOTrainer

TRAINERS = {"APPO": APPOTrainer, "TPPO": TPPOTrainer}


def make_trainer(team, config):
    """The trainer registered under ``config.algorithm_name``."""
    return TRAINERS[config.algorithm_name](team, config)
