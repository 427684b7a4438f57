"""The adapter bank: ONE frozen base model wrapped by peft, with one LoRA adapter per name.

It creates the adapters (the agents' and the critics'), routes every forward pass through one of
them, and selects each adapter's parameters by name. What the adapters are for (policies, critics)
is the team's business; the bank only knows names.
"""

from __future__ import annotations

import copy
import re
import warnings
from collections.abc import Sequence
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from peft import LoraConfig, get_peft_model
from peft.tuners.lora.layer import Linear as LoraLinear
from peft.tuners.tuners_utils import BaseTunerLayer

if TYPE_CHECKING:
    from marft.config import ModelConfig


def lora_targets(base_model: nn.Module, target: str) -> str | list[str]:
    """peft's ``target_modules`` for ``--lora_target_modules``: ``all-linear`` as it is (every linear layer but the
    output layer, peft's rule); comma-separated names as a list, where an ``all-linear`` among them (any case) stands
    for those linear layers, so ``all-linear,lm_head`` adapts the output layer too. The linear layers are named by
    their last name segment where no other module ends in one, else by their full paths (as peft does).

    Raises:
        ValueError: a listed name that no module of the model ends in (peft would skip it without a word)."""
    names = [t.strip() for t in target.split(",") if t.strip()]
    if [n.lower() for n in names] == ["all-linear"]:
        return "all-linear"
    modules = dict(base_model.named_modules())
    unknown = [n for n in names if n.lower() != "all-linear" and not any(path == n or path.endswith("." + n) for path in modules)]
    if unknown:
        raise ValueError(f"--lora_target_modules names {unknown}, which no module of this model is called "
                         f"(its linear layers end in e.g. {sorted({p.rsplit('.', 1)[-1] for p, m in modules.items() if isinstance(m, nn.Linear)})[:8]})")
    if not any(n.lower() == "all-linear" for n in names):
        return names
    from transformers.pytorch_utils import Conv1D

    output = base_model.get_output_embeddings()
    linear = {path for path, module in modules.items() if isinstance(module, (nn.Linear, Conv1D)) and module is not output}
    short = {path.rsplit(".", 1)[-1] for path in linear}
    ambiguous = any(path.rsplit(".", 1)[-1] in short for path in modules if path and path not in linear)
    expanded = sorted(linear if ambiguous else short)
    return expanded + [n for n in names if n.lower() != "all-linear" and n not in expanded]


@contextmanager
def tied_output_layer_allowed(enabled: bool = True):
    """Without peft's warning that an adapter covers an output layer tied to the input embedding, where that LoRA is
    the output layer's alone, by design (:meth:`AdapterBank.merged` never folds it in, the export unties the layer
    before merging). ``enabled=False`` (the input embedding adapted too): the warning stays."""
    with warnings.catch_warnings():
        if enabled:
            warnings.filterwarnings("ignore", message="Model has `tie_word_embeddings=True`")
        yield


def adapter_name_for(role: str) -> str:
    """A peft-safe adapter name for a role ("Agent 1" → "agent_1")."""
    name = re.sub(r"[^0-9a-zA-Z_]+", "_", role.strip()).strip("_").lower()
    return name or "agent"


def adapter_of(parameter_name: str) -> str | None:
    """The adapter a peft parameter belongs to: the name segment right after its ``lora_*`` segment
    (``...q_proj.lora_A.<adapter>.weight``, ``...lora_embedding_A.<adapter>``), or None for a base weight.

    Exact segments, not substrings: an adapter named ``model``, ``mlp``, ``layers`` or ``1`` must not
    select every parameter whose path contains that word."""
    parts = parameter_name.split(".")
    for part, following in zip(parts, parts[1:]):
        if part.startswith("lora_"):
            return following
    return None


class AdapterBank:
    """LoRA adapters named ``names`` on one frozen base model (``self.model``, a peft model).

    Args:
        base_model: a Hugging Face causal LM; its weights are frozen here.
        config: the model section of the run config (LoRA rank, alpha, dropout, target modules,
            gradient checkpointing).
        names: the adapters to create, the first one becoming peft's default.
    """

    def __init__(self, base_model, config: ModelConfig, names: Sequence[str]):
        self.names = list(names)
        targets = lora_targets(base_model, config.lora_target_modules)
        lora = LoraConfig(
            r=config.lora_r,
            lora_alpha=config.lora_alpha,
            lora_dropout=config.lora_dropout,
            target_modules=targets,
            task_type="CAUSAL_LM",
        )
        for p in base_model.parameters():
            p.requires_grad_(False)
        embedding_name = next((n for n, m in base_model.named_modules() if m is base_model.get_input_embeddings()), "")
        self.quiet_tied = isinstance(targets, str) or not any(embedding_name == t or embedding_name.endswith("." + t) for t in targets)
        """peft's tied-layer warning is silenced unless the input embedding itself is adapted."""
        with tied_output_layer_allowed(self.quiet_tied):
            self.model = get_peft_model(base_model, lora, adapter_name=self.names[0])
            for name in self.names[1:]:
                self.model.add_adapter(name, lora)
        self.lora_layers = [m for m in self.model.modules() if isinstance(m, BaseTunerLayer)]
        self.output_layer_adapted = isinstance(self.model.get_output_embeddings(), BaseTunerLayer)
        """Whether the adapters include the output layer (``--lora_target_modules all-linear,lm_head``)."""
        embeddings = base_model.get_input_embeddings()
        self.tied_layers = [layer for layer in self.lora_layers
                            if embeddings is not None and getattr(layer.get_base_layer(), "weight", None) is embeddings.weight]
        """LoRA layers whose base weight is also the input embedding (an output layer tied to it): never merged into."""
        self.lora_dropouts = [m for layer in self.lora_layers for m in getattr(layer, "lora_dropout", {}).values()]
        self.revisions: dict[str, int] = {}
        """Per adapter, how many times its weights were changed by an optimizer step or a checkpoint load
        (:meth:`mark_changed`): what an inference engine serving copies of the adapters checks."""
        self.merged_adapter: str | None = None
        """Inside :meth:`merged`: the adapter whose LoRA product the base weights carry; None outside."""
        self.checkpointed_layers = []
        if config.gradient_checkpointing:
            from transformers.modeling_layers import GradientCheckpointingLayer

            enable = getattr(base_model, "activation_checkpointing_enable", None)  # the newer name of gradient_checkpointing_enable
            if enable is not None:
                enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                base_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            self.checkpointed_layers = [m for m in base_model.modules() if isinstance(m, GradientCheckpointingLayer)]
        self.model.eval()  # new LoRA modules start in train mode: dropout stays off outside lora_dropout_active()

    def mark_changed(self, adapter: str) -> None:
        """``adapter``'s weights were just changed (an optimizer step, a checkpoint load)."""
        self.revisions[adapter] = self.revisions.get(adapter, 0) + 1

    @property
    def active(self) -> str:
        """The adapter forward passes go through now."""
        return str(self.model.active_adapter)

    def parameters(self, adapter: str) -> list[nn.Parameter]:
        """The LoRA parameters of one adapter, selected by the exact adapter segment of their names
        (:func:`adapter_of`; not by ``requires_grad``, not by substring)."""
        return [p for n, p in self.model.named_parameters() if adapter_of(n) == adapter]

    def route(self, adapter: str) -> None:
        """Make ``adapter`` the one every LoRA layer applies, leaving ``requires_grad`` alone (see :meth:`train_only`).

        peft's ``set_adapter`` walks every module and flips ``requires_grad`` of every adapter, several
        milliseconds per call; a rollout switches adapters three times per team step, so this sets the
        active adapter of the LoRA layers found once (a test checks it against ``set_adapter``)."""
        if adapter not in self.model.peft_config:
            raise ValueError(f"no adapter named {adapter!r}; the team has {sorted(self.model.peft_config)}")
        self.model.active_adapter = adapter
        self.model.base_model.active_adapter = adapter
        for layer in self.lora_layers:
            layer._active_adapter = [adapter]

    def train_only(self, adapter: str | None) -> None:
        """``adapter``'s parameters require grad, every other LoRA parameter does not (None: none does)."""
        for name, p in self.model.named_parameters():
            p.requires_grad_(adapter is not None and adapter_of(name) == adapter)

    def add_frozen_copies(self, copies: dict[str, str]) -> None:
        """For each ``source: name``, a new adapter ``name`` holding ``source``'s current weights, as a frozen
        reference: it has no dropout, and never requires grad nor enters an optimizer (both select adapters by
        name). Its memory is one more adapter's, not a model copy's.

        Raises:
            ValueError: a name is taken by an existing adapter, or a source does not exist."""
        taken = set(copies.values()) & set(self.model.peft_config)
        if taken:
            raise ValueError(f"cannot add frozen adapter(s) {sorted(taken)}: an adapter has that name already")
        missing = set(copies) - set(self.model.peft_config)
        if missing:
            raise ValueError(f"no adapter named {sorted(missing)} to copy")
        active = self.active
        for source, name in copies.items():
            config = copy.deepcopy(self.model.peft_config[source])
            config.lora_dropout = 0.0
            with tied_output_layer_allowed(self.quiet_tied):
                self.model.add_adapter(name, config)
            self.copy_weights(source, name)
        self.route(active)
        self.train_only(None)
        self.model.eval()

    def copy_weights(self, source: str, target: str) -> None:
        """Copy adapter ``source``'s LoRA weights into adapter ``target`` (same layers, same shapes)."""
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, p in params.items():
                if adapter_of(name) == source:
                    parts = name.split(".")
                    at = next(i + 1 for i, part in enumerate(parts[:-1]) if part.startswith("lora_") and parts[i + 1] == source)
                    params[".".join([*parts[:at], target, *parts[at + 1 :]])].copy_(p)

    @contextmanager
    def reference_policy(self):
        """Inside, every forward runs the base model alone (all adapters off): the reference policy of the
        KL penalty, with no second model in memory. Which parameters require grad is kept (peft's
        ``disable_adapter`` resets it on exit)."""
        trainable = {name: p.requires_grad for name, p in self.model.named_parameters()}
        try:
            with self.model.disable_adapter():
                yield
        finally:
            for name, p in self.model.named_parameters():
                p.requires_grad_(trainable[name])

    def layers_of(self, adapter: str) -> list[BaseTunerLayer]:
        """The LoRA layers that carry ``adapter``."""
        return [layer for layer in self.lora_layers if adapter in layer.lora_A]

    def can_merge(self, adapter: str) -> bool:
        """Whether :meth:`merged` can fold ``adapter`` into the base weights: every LoRA layer is a plain
        (no DoRA or other variant) linear layer in float32 (in half precision W + ΔW rounds the small update away)."""
        return all(
            isinstance(layer, LoraLinear) and adapter not in layer.lora_variant and layer.get_base_layer().weight.dtype == torch.float32
            for layer in self.layers_of(adapter)
        )

    def can_mix(self, adapters) -> bool:
        """Whether rows of ``adapters`` can share one decode step, each row through its own adapter
        (:func:`marft.agents.unpadded.linear`): every LoRA layer of theirs is a plain linear one (no DoRA or other
        variant, no LoRA bias), and the input embedding is not adapted (a step embeds every row alike)."""
        if isinstance(self.model.get_input_embeddings(), BaseTunerLayer):
            return False
        return all(isinstance(layer, LoraLinear) and adapter not in layer.lora_variant and not getattr(layer, "lora_bias", {}).get(adapter, False)
                   for adapter in adapters for layer in self.layers_of(adapter))

    def merged_if(self, adapter: str, enabled: bool):
        """:meth:`merged` when ``enabled`` and :meth:`can_merge`, else a context that changes nothing."""
        return self.merged(adapter) if enabled and self.can_merge(adapter) else nullcontext()

    @contextmanager
    def merged(self, adapter: str):
        """Inside, forward passes run ``adapter`` folded into the base weights: each adapted linear layer
        computes ``x (W + s·B·A)ᵀ``, one matrix product instead of three (``x Wᵀ + s·(x Aᵀ) Bᵀ``), with its LoRA
        branch switched off. No gradient flows inside (sampling only).

        The sums are temporary tensors (memory: one more copy of the adapted weights while inside); on exit each
        base weight gets its original tensor back, bit for bit (peft's ``merge``/``unmerge`` would add and subtract
        ΔW, which does not restore W exactly). Outputs equal the unmerged forward's to float32 rounding (~1e-6).
        An adapted output layer whose weight is the input embedding too (tied) keeps its LoRA branch: folded in,
        the update would change the input embedding as well. Raises when :meth:`can_merge` is false."""
        if not self.can_merge(adapter):
            raise ValueError(f"adapter {adapter!r} cannot be merged (not plain float32 LoRA on linear layers)")
        if self.merged_adapter is not None:
            raise RuntimeError(f"adapter {self.merged_adapter!r} is merged already")
        layers = [layer for layer in self.layers_of(adapter) if layer not in self.tied_layers]  # a tied layer keeps its LoRA branch
        originals = [(layer.get_base_layer().weight, layer.get_base_layer().weight.data, layer._disable_adapters) for layer in layers]
        try:
            with torch.no_grad():
                for layer, (weight, data, _) in zip(layers, originals):
                    weight.data = data + layer.get_delta_weight(adapter)  # (out, in), a new tensor
                    layer._disable_adapters = True  # the layer runs its base layer alone (peft's enable_adapters(False) would also reset requires_grad)
            self.merged_adapter = adapter
            yield
        finally:
            for layer, (weight, data, disabled) in zip(layers, originals):
                weight.data = data
                layer._disable_adapters = disabled
            self.merged_adapter = None

    @contextmanager
    def lora_dropout_paused(self):
        """Inside the update, a forward that measures instead of training (the reference's log-probs,
        ``--max_update_kl``'s KL) runs without LoRA dropout, as the rollout that sampled the replies did."""
        active = [module for module in self.lora_dropouts if module.training]
        for module in active:
            module.eval()
        try:
            yield
        finally:
            for module in active:
                module.train()

    @contextmanager
    def lora_dropout_active(self):
        """Inside (the update), LoRA dropout (``--lora_dropout``) is active; everywhere else the model is in
        eval mode, so rollouts, critic values and scoring are deterministic functions of the weights.

        With ``--gradient_checkpointing`` the decoder layers are checkpointed inside too: transformers
        checkpoints a layer only while that layer is in training mode, so the layers' own ``training`` flags
        are set (not ``.train()``, which would also turn on the base model's dropout below them)."""
        for module in self.lora_dropouts:
            module.train()
        for layer in self.checkpointed_layers:
            layer.training = True
        try:
            yield
        finally:
            for module in self.lora_dropouts:
                module.eval()
            for layer in self.checkpointed_layers:
                layer.training = False
