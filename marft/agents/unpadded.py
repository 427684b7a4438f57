"""The decoder forward on real tokens only: every layer's linear maps, norms and MLP run on the (N, H) real
tokens of a padded batch, and only attention sees the padded (B, S) layout.

A batch of prompts and replies of different lengths is padded to the longest row; transformers' forward pays
for every pad in every matrix product. Here the pads are dropped once after the embedding and put back (as
zeros) only around each layer's attention, which needs rows; the matrix products, the bulk of the work, cost
what the real tokens cost. The modules themselves are called (the LoRA layers with their active adapter and
dropout, the norms; the gated MLP's three layers op for op as its own forward, :func:`gated_mlp`), so the result
equals the padded forward's to float32 rounding, gradients included (``tests/agents/test_unpadded.py``).

Supported: decoder-only models of the Llama family whose layers read ``input_layernorm → self_attn (q/k/v/o
projections, rotary positions, optional q/k norms) → post_attention_layernorm → mlp`` (Qwen2, Qwen2.5, Qwen3,
Llama, Mistral without sliding windows), full attention only. :func:`supports_unpadded` says whether a model is
one; others run transformers' forward.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import rotate_half

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "mistral")
"""``config.model_type`` values whose decoder layers have the layout this forward reproduces."""


def supports_unpadded(model: nn.Module) -> bool:
    """Whether :func:`unpadded_decoder_states` can run ``model``'s decoder (a ``*ForCausalLM`` or its decoder)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return False
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ["full_attention"]):
        return False  # sliding-window layers
    if getattr(config, "model_type", None) == "mistral" and getattr(config, "sliding_window", None):
        return False
    if getattr(config, "attention_dropout", 0.0):
        return False
    return getattr(config, "_attn_implementation", "sdpa") in ("sdpa", "eager", None)


def logits_from_last_states(model: nn.Module) -> bool:
    """Whether ``model``'s logits are its output embeddings applied to its decoder's last hidden states and nothing
    else, so that a caller may form them itself from the states, a few rows at a time: transformers' own causal-LM
    classes of the Llama family (:data:`SUPPORTED_MODEL_TYPES`). Others may scale or cap their logits, and so may
    remote code that only names one of these model types."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return model_type in SUPPORTED_MODEL_TYPES and type(model).__module__ == f"transformers.models.{model_type}.modeling_{model_type}"


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions on queries or keys ``(..., heads, d)``, ``cos``/``sin`` broadcast over heads (as transformers)."""
    return x * cos + rotate_half(x) * sin


def unpadded_decoder_states(
    decoder: nn.Module, cache, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, tail: int | None = None,
    keep_keys_values: bool = False,
):
    """The decoder's last hidden states of the real tokens of ``ids``, or of its last ``tail`` columns.

    Args:
        decoder: the base model's decoder (``model.get_decoder()``; its modules carry the active adapter).
        cache: a transformers cache holding C columns of keys/values every row attends to first (shared role
            headers, ``RoleHeaderCache``), or a ``HeaderRows`` that forms each layer's rows when read, or None.
            It is read, not extended.
        ids: ``(B, S)`` the columns after the cache.
        mask: ``(B, C + S)`` 1 on real tokens, cache columns included.
        positions: ``(B, S)`` position ids of the S columns.
        tail: only the last ``tail`` columns' states are wanted (the reply's positions, the last prompt token):
            the last layer then computes its keys and values for every token (attention needs them) but its
            queries, attention output and MLP only there. On a 4-layer model that is a fifth of the work.
        keep_keys_values: also return every layer's keys and values (to decode from, :class:`StaticKVDecoder`).
    Returns:
        ``(hidden, real (B, S) bool)``: ``hidden`` holds the final-norm states of the N real tokens in row-major order,
        ``(N, H)`` (``hidden[k]`` is the k-th True of ``real``), or with ``tail`` those of the last columns,
        ``(B, tail, H)`` (a pad among them gets finite states no caller should read); with ``keep_keys_values``
        a third item, per layer ``(keys, values)`` of shape ``(B, kv, C + S, d)`` (zeros at pads).
    """
    B, S = ids.shape
    C = 0 if cache is None else cache.get_seq_length()
    layout = _RealTokens(mask, C, S, positions)
    hidden = decoder.embed_tokens(ids.flatten()[layout.flat])  # (N, H)
    layout.rotary(decoder.rotary_emb, hidden)
    heads = head_counts(decoder.config)
    layers = decoder.layers[: decoder.config.num_hidden_layers]
    kept = []
    for index, layer in enumerate(layers):
        last_tail = tail if tail is not None and index == len(layers) - 1 else None
        cached = None if cache is None else _layer_keys_values(cache, index)
        hidden, keys_values = _decoder_layer(layer, hidden, layout, cached, heads, last_tail)
        if keep_keys_values:
            kept.append(keys_values)
    if tail is not None and not layers:
        hidden = layout.rows(hidden)[:, S - tail :]
    hidden = decoder.norm(hidden)
    return (hidden, layout.real, kept) if keep_keys_values else (hidden, layout.real)


def _layer_keys_values(cache, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``index``'s cached ``(keys, values)``, each ``(B, kv, C, d)``, of a transformers cache or of a cache that
    forms them on reading (``keys_values(index)``, :class:`marft.agents.headers.HeaderRows`)."""
    if hasattr(cache, "keys_values"):
        return cache.keys_values(index)
    return cache.layers[index].keys, cache.layers[index].values


class _RealTokens:
    """Where the N real tokens of a padded ``(B, S)`` batch sit, their rotary tables, and which keys each query
    may attend to (the C cached columns first)."""

    def __init__(self, mask: torch.Tensor, C: int, S: int, positions: torch.Tensor):
        B = mask.shape[0]
        self.B, self.S, self.positions = B, S, positions
        self.real = mask[:, C:].bool()  # (B, S)
        self.flat = self.real.flatten().nonzero().squeeze(1)  # (N,) indices into B·S
        keys_real = mask.bool()[:, None, None, :]  # (B, 1, 1, C + S)
        causal = torch.ones(S, S, dtype=torch.bool, device=mask.device).tril()  # (S, S)
        allowed = keys_real & torch.cat([causal.new_ones(S, C), causal], dim=1)[None, None]  # (B, 1, S, C + S)
        own = torch.cat([causal.new_zeros(S, C), torch.eye(S, dtype=torch.bool, device=mask.device)], dim=1)  # (S, C + S)
        self.allowed = allowed | own[None, None]  # a pad query sees its own (zero) key: no empty softmax row

    def rotary(self, rotary_emb: nn.Module, hidden: torch.Tensor) -> None:
        """The rotary tables ``cos, sin`` ``(N, 1, d)`` of the real tokens (broadcast over heads)."""
        cos, sin = rotary_emb(hidden, self.positions.flatten()[self.flat][None])  # (1, N, d) each
        self.cos, self.sin = cos[0, :, None], sin[0, :, None]

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        """``(N, ...)`` → ``(B, S, ...)``, zeros at pads."""
        return t.new_zeros(self.B * self.S, *t.shape[1:]).index_copy(0, self.flat, t).view(self.B, self.S, *t.shape[1:])


def _decoder_layer(layer: nn.Module, hidden: torch.Tensor, layout: _RealTokens, cached, heads: tuple[int, int, int], tail: int | None):
    """One decoder layer on the real tokens ``hidden (N, H)``; attention on rows, after the ``cached`` keys and
    values ``(B, kv, C, d)`` (or None). With ``tail`` (the last layer of a tail forward) queries, attention output
    and MLP run on the last ``tail`` columns only and the states come back as ``(B, tail, H)``.
    Returns ``(hidden, (keys, values) of shape (B, kv, C + S, d))``."""
    attn, (n_heads, n_kv, head_dim), B, S = layer.self_attn, heads, layout.B, layout.S
    x = layer.input_layernorm(hidden)  # (N, H)
    k = few_rows_linear(fast_layer(attn.k_proj), x).view(-1, n_kv, head_dim)  # (N, kv, d)
    v = few_rows_linear(fast_layer(attn.v_proj), x).view(-1, n_kv, head_dim)
    if hasattr(attn, "k_norm"):  # Qwen3: per-head RMS norms before the rotary positions
        k = attn.k_norm(k)
    k = _rotary(k, layout.cos, layout.sin)
    k_rows, v_rows = layout.rows(k).transpose(1, 2), layout.rows(v).transpose(1, 2)  # (B, kv, S, d)
    if cached is not None:
        k_rows = torch.cat([cached[0], k_rows], dim=2)  # (B, kv, C + S, d)
        v_rows = torch.cat([cached[1], v_rows], dim=2)
    if tail is not None:  # queries, attention output and MLP of the last `tail` columns only (a pad there: zeros in, finite out)
        hidden = layout.rows(hidden)[:, S - tail :]  # (B, tail, H) the residual stream there
        # the norm runs again on these rows rather than reusing rows(x): equal values, but another rounding of the
        # reduction (~1e-7) that seeded runs depend on; it costs B·tail rows
        q = attn.q_proj(layer.input_layernorm(hidden)).view(B, tail, n_heads, head_dim)
        q_cos, q_sin = layout.rows(layout.cos)[:, S - tail :], layout.rows(layout.sin)[:, S - tail :]  # (B, tail, 1, d)
        query_mask = layout.allowed[:, :, S - tail :]
    else:
        q = few_rows_linear(fast_layer(attn.q_proj), x).view(-1, n_heads, head_dim)  # (N, h, d)
        q_cos, q_sin, query_mask = layout.cos, layout.sin, layout.allowed
    if hasattr(attn, "q_norm"):
        q = attn.q_norm(q)
    q = _rotary(q, q_cos, q_sin)
    q_rows = (q if tail is not None else layout.rows(q)).transpose(1, 2)  # (B, h, S or tail, d)
    out = F.scaled_dot_product_attention(
        q_rows, k_rows, v_rows, attn_mask=query_mask, scale=attn.scaling, enable_gqa=n_heads != n_kv,
    ).transpose(1, 2)  # (B, S or tail, h, d)
    out = out.reshape(B, tail, n_heads * head_dim) if tail is not None else out.reshape(B * S, n_heads * head_dim)[layout.flat]
    hidden = hidden + few_rows_linear(fast_layer(attn.o_proj), out)  # (B, tail, H) or (N, H)
    hidden = hidden + gated_mlp(layer.mlp, layer.post_attention_layernorm(hidden))
    return hidden, (k_rows, v_rows)


def head_counts(config) -> tuple[int, int, int]:
    """``(query heads, key/value heads, head dim)`` of a Llama-family config."""
    n_heads = config.num_attention_heads
    return n_heads, config.num_key_value_heads, getattr(config, "head_dim", None) or config.hidden_size // n_heads


FEW_ROWS = 64
"""Up to this many rows, :func:`few_rows_linear` multiplies weight-major on CPU (see there for the measurements)."""


def few_rows_linear(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)`` for ``x (M, in)``; when ``layer`` is a plain ``nn.Linear`` on CPU, no gradient is recorded and M is
    at most :data:`FEW_ROWS`, computed weight-major, ``(W xᵀ)ᵀ + b``.

    A decode step multiplies a few rows (one per env) by every weight of the model, and CPU BLAS computes ``x Wᵀ``
    for a few rows well below its speed on the same bytes as ``W xᵀ``; the gain shrinks as the rows grow and turns
    into a loss past about a hundred rows (on a decode step and on a prompt forward), hence the threshold. The sums are
    the same products in another order: equal to float32 rounding (``tests/agents/test_unpadded.py``). Anything else
    (an adapter layer, a GPU, a forward under autograd, more rows) is called as it is."""
    if type(layer) is not nn.Linear or x.device.type != "cpu" or x.dim() != 2 or x.shape[0] > FEW_ROWS or torch.is_grad_enabled():
        return layer(x)
    out = torch.mm(layer.weight, x.t()).t().contiguous()  # (M, out)
    return out if layer.bias is None else out.add_(layer.bias)


def gated_mlp(mlp: nn.Module, x: torch.Tensor, adapters: RowAdapters | None = None) -> torch.Tensor:
    """The gated MLP of the Llama family, ``down(act(gate(x)) * up(x))`` (the module's own forward, op for op), its layers
    called as :func:`linear` says."""
    gate, up = linear(mlp.gate_proj, x, adapters), linear(mlp.up_proj, x, adapters)
    return linear(mlp.down_proj, mlp.act_fn(gate) * up, adapters)


def fast_layer(module: nn.Module) -> nn.Module:
    """A peft LoRA layer whose adapters are off (folded into the base weights, or the reference policy) computes
    its base layer only: call that directly. Anything else is called as it is."""
    base = getattr(module, "base_layer", None)
    return base if base is not None and getattr(module, "disable_adapters", False) else module


class RowAdapters:
    """Which LoRA adapter each row of a decode step runs through, so that rows of several adapters (two seats' agents,
    an opponent's snapshots) share one step: the base weights' products run once for all rows, and each row's LoRA
    product with its own adapter's factors (:func:`linear`).

    Args:
        names: the adapters.
        code: ``(B,)`` per row, the index of its adapter in ``names``.
    """

    def __init__(self, names: list[str], code: torch.Tensor):
        self.names, self.code = list(names), code
        self.rows = {name: (code == k).nonzero().squeeze(1) for k, name in enumerate(self.names)}  # adapter → (B_a,) its rows
        self._factors: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = {}

    def factors(self, module: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The LoRA factors of the peft layer ``module``, every adapter's side by side, made once per layer (the weights do
        not change while the rows are sampled): ``(A (in, R), s·B (R, out), own (B, R))``, R the adapters' ranks summed,
        ``own`` 1 on each row's own adapter's R columns; None when the layer carries none of the adapters. An adapter
        the layer does not carry adds nothing to its rows, as in peft."""
        key = id(module)
        if key not in self._factors:
            carried = [(k, name) for k, name in enumerate(self.names) if name in module.lora_A]
            if not carried:
                self._factors[key] = None
            else:
                a = torch.cat([module.lora_A[name].weight.t() for _, name in carried], dim=1)  # (in, R)
                b = torch.cat([module.lora_B[name].weight.t() * module.scaling[name] for _, name in carried])  # (R, out)
                block = torch.cat([torch.full((module.r[name],), k, device=a.device) for k, name in carried])  # (R,) each column's adapter
                self._factors[key] = (a, b, (block[None] == self.code.to(a.device)[:, None]).to(a.dtype))  # own (B, R)
        return self._factors[key]


def linear(module: nn.Module, x: torch.Tensor, adapters: RowAdapters | None = None) -> torch.Tensor:
    """``module(x)`` as the forwards here compute it (:func:`fast_layer`, :func:`few_rows_linear`) or, with ``adapters``
    (no gradient), a peft LoRA layer with each row of ``x (B, in)`` through its own adapter: the base layer on every
    row plus each row's ``s·B(A(x))``, as peft's forward adds the active adapter's (in the adapters' dtype, without
    dropout: sampling runs in eval mode). Two products with every adapter's factors side by side, each row keeping its
    own adapter's columns (:meth:`RowAdapters.factors`), whatever the number of adapters."""
    if adapters is None or not hasattr(module, "lora_A"):
        return few_rows_linear(fast_layer(module), x)
    out = few_rows_linear(module.get_base_layer(), x)
    factors = adapters.factors(module)
    if factors is None:
        return out
    a, b, own = factors
    return out.add_((((x.to(a.dtype) @ a) * own) @ b).to(out.dtype))  # (B, in) (in, R) → (B, R), own columns only, (R, out)


class StaticKVDecoder:
    """One token per row at a time on a preallocated KV cache: the decode steps of a sampling loop without
    transformers' per-step work (its cache growing by concatenation, its 4-D mask rebuilt every step, its
    wrappers), on the same modules and the same arithmetic.

    Args:
        decoder: the base model's decoder (:func:`supports_unpadded` must hold).
        keys_values: per layer ``(keys, values)`` ``(B, kv, W, d)`` of the prompt (:func:`unpadded_decoder_states`
            with ``keep_keys_values``).
        mask: ``(B, W)`` 1 on the prompt's real columns.
        max_new_tokens: how many steps may follow (the cache's spare columns).
        adapters: each row's LoRA adapter (:class:`RowAdapters`); None: the active adapter.
    """

    def __init__(self, decoder: nn.Module, keys_values, mask: torch.Tensor, max_new_tokens: int, adapters: RowAdapters | None = None):
        self.decoder = decoder
        self.adapters = adapters
        """Each row's adapter (its LoRA factors gathered once for all the steps), or None: the active adapter."""
        B, W = mask.shape
        self.width = W
        self.keys = [k.new_zeros(B, k.shape[1], W + max_new_tokens, k.shape[3]) for k, _ in keys_values]  # per layer (B, kv, W + L, d)
        self.values = [torch.zeros_like(k) for k in self.keys]
        for index, (k, v) in enumerate(keys_values):
            self.keys[index][:, :, :W] = k
            self.values[index][:, :, :W] = v
        allowed = torch.cat([mask.bool(), mask.new_ones(B, max_new_tokens, dtype=torch.bool)], dim=1)[:, None, None]  # (B, 1, 1, W + L)
        # the additive form attention turns a boolean mask into on every call (0 where allowed, -inf elsewhere), made once
        self.bias = torch.zeros(allowed.shape, dtype=self.keys[0].dtype, device=mask.device).masked_fill_(~allowed, float("-inf"))
        self.steps = 0
        layers = decoder.layers[: decoder.config.num_hidden_layers]
        self.modules = [
            (layer.input_layernorm, *(getattr(layer.self_attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")),
             layer.post_attention_layernorm, layer.mlp)
            for layer in layers
        ]

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Append ``tokens (B,)`` at ``positions (B,)``; → the final-norm hidden states ``(B, H)`` after them."""
        decoder, t = self.decoder, self.width + self.steps
        n_heads, n_kv, head_dim = head_counts(decoder.config)
        B = len(tokens)
        hidden = decoder.embed_tokens(tokens)  # (B, H)
        cos, sin = decoder.rotary_emb(hidden, positions[None])  # (1, B, d)
        cos, sin = cos[0, :, None], sin[0, :, None]  # (B, 1, d)
        bias = self.bias[..., : t + 1]  # (B, 1, 1, t + 1)
        for index, (norm, q_proj, k_proj, v_proj, o_proj, post_norm, mlp) in enumerate(self.modules):
            attn = decoder.layers[index].self_attn
            x = norm(hidden)  # (B, H)
            q = linear(q_proj, x, self.adapters).view(B, n_heads, head_dim)
            k = linear(k_proj, x, self.adapters).view(B, n_kv, head_dim)
            v = linear(v_proj, x, self.adapters).view(B, n_kv, head_dim)
            if hasattr(attn, "q_norm"):
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = _rotary(q, cos, sin), _rotary(k, cos, sin)
            self.keys[index][:, :, t] = k
            self.values[index][:, :, t] = v
            out = F.scaled_dot_product_attention(
                q[:, :, None], self.keys[index][:, :, : t + 1], self.values[index][:, :, : t + 1], attn_mask=bias,
                scale=attn.scaling, enable_gqa=n_heads != n_kv,
            )  # (B, h, 1, d)
            hidden = hidden + linear(o_proj, out.reshape(B, n_heads * head_dim), self.adapters)
            hidden = hidden + gated_mlp(mlp, post_norm(hidden), self.adapters)
        self.steps += 1
        return decoder.norm(hidden)
