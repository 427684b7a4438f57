"""The generation backends by name (``--generation_backend``): which class samples the replies, and making one."""

from __future__ import annotations

from typing import TYPE_CHECKING

from marft.agents.generation import DecodeLoop, GenerationBackend, SamplingSettings, TransformersGenerate
from marft.agents.vllm_backend import VLLMGenerate

if TYPE_CHECKING:
    from marft.agents.headers import RoleHeaderCache
    from marft.config import ModelConfig


def vllm_backend(headers: RoleHeaderCache, settings: SamplingSettings, logprobs_from_generate: bool, config: ModelConfig | None = None,
                 previous: GenerationBackend | None = None) -> GenerationBackend:
    """A :class:`~marft.agents.vllm_backend.VLLMGenerate` (vLLM is imported only here), on ``previous``'s engine if it has one."""

    return VLLMGenerate(headers, settings, config, engine=getattr(previous, "engine", None))


BACKEND_CLASSES = {"decode_loop": DecodeLoop, "generate": TransformersGenerate, "vllm": vllm_backend}
"""``--generation_backend`` (:data:`marft.choices.GENERATION_BACKENDS`) → the backend class: ``decode_loop``, marft's
own sampling loop (the default; the same ids and log-probs as generate for a seed on CPU); ``generate``,
transformers' ``model.generate`` (the reference and fallback); ``vllm``, a colocated vLLM engine
(:class:`marft.agents.vllm_backend.VLLMGenerate`)."""


def make_backend(name: str, headers: RoleHeaderCache, settings: SamplingSettings, logprobs_from_generate: bool,
                 config: ModelConfig | None = None, previous: GenerationBackend | None = None) -> GenerationBackend:
    """The generation backend named ``name`` (:data:`BACKEND_CLASSES`); ``config``: the model config (vllm reads
    its engine settings there); ``previous``: the backend this one replaces (vllm keeps its engine)."""
    if name not in BACKEND_CLASSES:
        raise ValueError(f"--generation_backend must be one of {', '.join(BACKEND_CLASSES)}, got {name!r}")
    if name == "vllm":
        return vllm_backend(headers, settings, logprobs_from_generate, config, previous)
    return BACKEND_CLASSES[name](headers, settings, logprobs_from_generate)
