"""Loading the ONE base model and its tokenizer: any local Hugging Face folder, or an embedded model built once and cached."""

from __future__ import annotations

import logging
import os

import torch

from marft.agents.dtypes import TORCH_DTYPES
from marft.config import ModelConfig
from marft.models.tiny import SmallRecipe, TinyRecipe, ensure_tiny_model
from marft.models.tiny_instruct import InstructRecipe

logger = logging.getLogger(__name__)

EMBEDDED_RECIPES = {recipe.name: recipe for recipe in (TinyRecipe(), InstructRecipe(), SmallRecipe())}
"""``--model_name_or_path`` of a shipped embedded model (``marft-tiny``, ``marft-tiny-instruct``, ``marft-small``) → its recipe."""


def embedded_recipe(name: str) -> TinyRecipe | None:
    """The recipe of a shipped embedded model, None for any other name."""
    return EMBEDDED_RECIPES.get(name)


def resolve_device(name: str) -> torch.device:
    """``auto`` → cuda when available, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def looks_like_local_path(name: str) -> bool:
    """A name that can only mean a local directory: absolute, relative, home-based, or deeper than ``org/name``."""
    return name.startswith((".", "/", "~")) or name.count("/") >= 2


def check_model_path(name: str) -> None:
    """Fail with one clear line when a local model directory is missing (before anything is loaded)."""
    if embedded_recipe(name) is not None:
        return
    path = os.path.expanduser(name)
    if looks_like_local_path(name) and not os.path.isdir(path):
        raise FileNotFoundError(
            f"model directory {name!r} does not exist; pass --model_name_or_path with a local Hugging Face "
            f"model folder, a hub name, or {' / '.join(map(repr, EMBEDDED_RECIPES))} for the embedded tiny models"
        )
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"model directory {name!r} has no config.json: it is not a Hugging Face model folder")


def resolve_model_path(name: str) -> str:
    """The embedded tiny models are built (once) and cached; anything else is passed to Hugging Face."""
    check_model_path(name)
    recipe = embedded_recipe(name)
    return ensure_tiny_model(recipe=recipe) if recipe is not None else os.path.expanduser(name)


def load_base_model(config: ModelConfig):
    """Load the base causal LM and tokenizer once, frozen and in eval mode.

    Returns ``(model, tokenizer)``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(config.model_name_or_path)
    device = resolve_device(config.device)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=config.trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=TORCH_DTYPES[config.dtype], trust_remote_code=config.trust_remote_code
        )
    except OSError as error:
        raise OSError(
            f"could not load model {config.model_name_or_path!r}: {error}. Pass a local model folder with "
            "--model_name_or_path (no model hub is reachable offline)"
        ) from error
    model.to(device)
    model.eval()
    if tokenizer.eos_token_id is None:
        raise ValueError(f"the tokenizer of {path!r} has no EOS token; agents could never stop replying")
    logger.info("loaded %s (%.1fM parameters) on %s", path, sum(p.numel() for p in model.parameters()) / 1e6, device)
    return model, tokenizer
