"""Shared fixtures: tiny random models built from a config (never downloaded)."""

import logging
import warnings
from pathlib import Path

import pytest

DATA_DIR = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory) -> str:
    """An untrained tiny Qwen2-style model and tokenizer, saved once per test session."""
    from marft.models.tiny import build_random_model

    return build_random_model(str(tmp_path_factory.mktemp("random_model")))


@pytest.fixture(autouse=True)
def _quiet_warnings():
    logging.getLogger("transformers").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        yield
