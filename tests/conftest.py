"""Shared fixtures: tiny random models built from a config (never downloaded)."""

import logging
import warnings
from pathlib import Path

import pytest
import torch

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


@pytest.fixture
def one_thread():
    """One intra-op thread: much faster for the tiny models on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
