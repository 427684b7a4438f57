"""The token budget of one gradient-accumulation chunk of the update: what bounds the update's memory.

``--max_chunk_tokens N`` sets it in positions. Without it the budget comes from ``--max_chunk_mib``: the memory
one chunk's forward may keep for its backward, divided by an estimate of what one position keeps in a decoder
layer stack. The estimate counts, per layer and position, ``8 x hidden + 4 x intermediate`` values (the saved
inputs and outputs of the norms, projections, attention and MLP, and the LoRA inputs; a mixture of experts'
intermediate size times the experts each token visits), or one ``hidden`` vector per layer plus one layer's worth
under ``--gradient_checkpointing`` (only the layers' inputs are kept). Every value is counted as float32 whatever
the model's dtype: a bf16 model's LoRA layers (peft keeps adapters in float32) and norms keep float32 copies of
their inputs, so a bf16 count would be 1.5-1.7x low. It is an estimate, not a measurement (the memory table of
``docs/results/benchmarks.md`` has what it bounds); the attention probabilities of an eager (non-fused) attention and the
vocabulary's logits (bounded on their own, ``--max_logits_mib``) are not counted.

The default memory, 1024 MiB on CPU and a quarter of the GPU's memory on CUDA, is fixed per device kind, so a
seeded CPU run chunks the same on every machine. A minibatch the budget does not cut runs as it does without a
budget (:func:`~marft.algorithms.batching.plan_minibatches`), so a small model's run (the embedded
``marft-tiny``: 69,905 positions at 1024 MiB) is the same with or without it.
"""

from __future__ import annotations

import torch

from marft.config import AlgoConfig

CPU_CHUNK_MIB = 1024
"""The default ``--max_chunk_mib`` on CPU."""
GPU_MEMORY_SHARE = 4
"""On CUDA the default ``--max_chunk_mib`` is the GPU's total memory over this (the rest holds the weights, the
logits budget, an inference engine's share and the allocator's slack)."""
VALUE_BYTES = 4
"""Bytes counted per kept value: float32, whatever the model's dtype (module docstring)."""


def default_chunk_mib(device: torch.device) -> int:
    """``--max_chunk_mib`` when not given: :data:`CPU_CHUNK_MIB` on CPU (and other devices), the GPU's total memory
    over :data:`GPU_MEMORY_SHARE` on CUDA."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory // GPU_MEMORY_SHARE // 2**20
    return CPU_CHUNK_MIB


def bytes_per_position(model_config, gradient_checkpointing: bool = False) -> int:
    """Estimated activation bytes one token position keeps for the backward over the decoder layers of a
    transformers model config (its text config for multimodal ones).

    Raises:
        ValueError: the config names no hidden size or layer count (set ``--max_chunk_tokens`` or
            ``--max_chunk_mib 0``)."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    hidden = _first(text, "hidden_size", "n_embd", "d_model")
    layers = _first(text, "num_hidden_layers", "n_layer", "num_layers")
    if hidden is None or layers is None:
        raise ValueError(
            f"cannot estimate the update's memory per position of a {type(text).__name__} (no hidden size or layer "
            "count in its config): set the chunk budget with --max_chunk_tokens N, or none with --max_chunk_mib 0"
        )
    intermediate = _first(text, "moe_intermediate_size", "intermediate_size", "n_inner", "ffn_dim") or 4 * hidden
    intermediate *= _first(text, "num_experts_per_tok") or 1  # a token's MLP activations in every expert it visits
    per_layer = 8 * hidden + 4 * intermediate  # values one layer keeps per position
    values = layers * hidden + per_layer if gradient_checkpointing else layers * per_layer
    return values * VALUE_BYTES


def _first(config, *names: str) -> int | None:
    """The first of ``names`` that ``config`` sets (not None)."""
    return next((value for value in (getattr(config, name, None) for name in names) if value is not None), None)


def chunk_token_budget(config: AlgoConfig, model_config, device: torch.device, gradient_checkpointing: bool = False) -> int | None:
    """The update's chunk budget in positions: ``--max_chunk_tokens`` if given, else ``--max_chunk_mib`` (or its
    device default) over :func:`bytes_per_position`; None for no budget (``--max_chunk_mib 0``)."""
    if config.max_chunk_tokens is not None:
        return config.max_chunk_tokens
    mib = default_chunk_mib(device) if config.max_chunk_mib is None else config.max_chunk_mib
    if mib == 0:
        return None
    return max(1, mib * 2**20 // bytes_per_position(model_config, gradient_checkpointing))


def budget_source(config: AlgoConfig, device: torch.device) -> str:
    """Where :func:`chunk_token_budget` took the budget from, for the run's log."""
    if config.max_chunk_tokens is not None:
        return "--max_chunk_tokens"
    if config.max_chunk_mib is None:
        return f"--max_chunk_mib {default_chunk_mib(device)}, the {'GPU' if device.type == 'cuda' else 'CPU'} default"
    return f"--max_chunk_mib {config.max_chunk_mib}"
