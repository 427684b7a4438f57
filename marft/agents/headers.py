"""The shared role-header cache: every prompt of agent ``a`` starts with the same role header, so a batch
of a's prompts runs the header once and shares its keys/values instead of computing them in every row. With
``share_openings``, rows whose prompts also open alike after the header (a game's rules) share that opening too
(:mod:`marft.agents.openings`): the header of such a row is its role header and its group's opening.

Used by the generation backend (rollouts) and the critic (values), through whichever adapter is active.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from contextlib import contextmanager

import torch
import torch.nn as nn
from transformers import DynamicCache

from marft.agents.adapters import AdapterBank
from marft.agents.openings import drop_openings, shared_opening
from marft.agents.prompts import left_pad
from marft.agents.unpadded import supports_unpadded, unpadded_decoder_states


def position_ids_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Pad-aware positions: the first real token of each row gets position 0. (B, S) → (B, S)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def pick_rows(tensor: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Row b of the result is row ``rows[b]`` of ``tensor``. (n, ...) → (B, ...).

    Without gradients this is an index. Under autograd the rows are picked by a one-hot matrix product: the
    backward of an index adds the rows' gradients with atomic adds on CPU, in a different order from run to
    run, which made training irreproducible; the product's backward sums them in a fixed order."""
    if not tensor.requires_grad:
        return tensor[rows]
    one_hot = nn.functional.one_hot(rows, len(tensor)).to(tensor.dtype)  # (B, n)
    return (one_hot @ tensor.flatten(1)).view(len(rows), *tensor.shape[1:])


def joined_batches(batches: Sequence[tuple[int, torch.Tensor, torch.Tensor]], pad_id: int):
    """Prompt batches of several agents, ``(agent, prompt_ids (B_n, P_n), prompt_mask (B_n, P_n))`` each, as one batch
    left-padded to the widest: ``(ids (ΣB, P), mask (ΣB, P), agents (ΣB,) each row's agent)``, rows in the order given."""
    width = max(ids.shape[1] for _, ids, _ in batches)
    ids = torch.cat([nn.functional.pad(ids, (width - ids.shape[1], 0), value=pad_id) for _, ids, _ in batches])  # (ΣB, P)
    mask = torch.cat([nn.functional.pad(mask, (width - mask.shape[1], 0)) for _, _, mask in batches])  # (ΣB, P)
    agents = torch.cat([torch.full((len(ids),), agent, dtype=torch.long) for agent, ids, _ in batches])  # (ΣB,)
    return ids, mask, agents


def select_rows(cache, rows: torch.Tensor) -> None:
    """Row b of every layer's keys/values becomes row ``rows[b]`` of the cache (:func:`pick_rows`). (n, ...) → (B, ...).
    Without gradients the cache's own selection (which also picks any other per-row state its layers keep)."""
    if not any(layer.keys.requires_grad or layer.values.requires_grad for layer in cache.layers):
        cache.batch_select_indices(rows)
        return
    for layer in cache.layers:
        layer.keys, layer.values = pick_rows(layer.keys, rows), pick_rows(layer.values, rows)


MEMO_ENTRIES = 16
"""Inside :meth:`RoleHeaderCache.frozen`: the most header forwards kept for reuse (the oldest goes first)."""


class HeaderRows:
    """The keys/values of n role headers and each of B rows' header, read one layer at a time: a forward on the
    real tokens (:func:`~marft.agents.unpadded.unpadded_decoder_states`) forms a layer's ``(B, kv, C, d)`` rows
    when it reaches that layer. Without gradients (the rollout's critic values, reference log-probs) the rows'
    copies of the headers then never exist for every layer at once (B·C columns per layer instead of per model);
    with gradients each layer's attention keeps its joined keys/values for the backward anyway, and what is saved
    is the second, separate copy of every layer's header rows. :meth:`materialized` is the transformers cache of
    the rows, for forwards that extend a cache."""

    def __init__(self, cache: DynamicCache, rows: torch.Tensor):
        self.cache, self.rows = cache, rows

    def get_seq_length(self) -> int:
        return self.cache.get_seq_length()

    def keys_values(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``index``'s keys and values of the rows, ``(B, kv, C, d)`` each."""
        layer = self.cache.layers[index]
        return pick_rows(layer.keys, self.rows), pick_rows(layer.values, self.rows)

    def materialized(self) -> DynamicCache:
        """The rows' keys/values in a transformers cache (every layer formed now)."""
        select_rows(self.cache, self.rows)
        return self.cache


class RoleHeaderCache:
    """Runs role headers once per batch (or once per rollout, inside :meth:`frozen`) and re-packs prompts
    behind them.

    Args:
        bank: the adapters; headers run through the active one.
        header_ids: per agent, its role header's ids (``PromptEncoder.header_ids``; empty for anonymous roles).
        pad_id: the padding id.
        device: where the model runs.
        unpadded_forward: :meth:`decoder_states` runs the linear layers on real tokens only
            (:mod:`marft.agents.unpadded`) where the model supports it.
        share_openings: rows of one agent whose prompts open alike after the role header run that opening once
            with the header (:func:`~marft.agents.openings.shared_opening`).
    """

    def __init__(self, bank: AdapterBank, header_ids: Sequence[list[int]], pad_id: int, device, unpadded_forward: bool = False,
                 share_openings: bool = False):
        self.bank = bank
        self.share_openings = share_openings
        self.header_ids = list(header_ids)
        self.pad_id = pad_id
        self.device = device
        self.unpadded_forward = unpadded_forward and supports_unpadded(bank.model.get_base_model())
        """Whether :meth:`decoder_states` skips the pads in the linear layers (asked for, and the model supports it)."""
        self.memo: dict | None = None
        """Inside :meth:`frozen`: header keys/values per (adapter, merged adapter, headers), the latest
        :data:`MEMO_ENTRIES`; None outside. ``headers``: ``(agent, opening ids)`` per header."""
        self.chunk_memo: dict | None = None
        """Inside :meth:`shared_over_chunks`: per (adapter, merged adapter, headers) the header forward's keys/values
        (with their graph), the detached copies each chunk used, and the padded header ids and mask; None outside."""

    @contextmanager
    def frozen(self):
        """A stretch in which no adapter changes (a rollout, an evaluation): each adapter's role-header
        keys/values are computed once and reused by every call inside, instead of once per call."""
        if self.memo is not None:
            yield
            return
        self.memo = {}
        try:
            yield
        finally:
            self.memo = None

    @contextmanager
    def shared_over_chunks(self):
        """A minibatch cut into chunks for gradient accumulation: each role header runs once, with the gradient, for
        all the chunks (not once per chunk). Every chunk starts from detached copies of the header's keys/values;
        on leaving, the header's backward receives the chunks' gradients, summed in chunk order: the gradient of
        one header forward per chunk, for one forward and one backward. Leave it before the optimizer step."""
        if self.chunk_memo is not None:
            yield
            return
        self.chunk_memo = {}
        try:
            yield
            for sources, copies, _, _ in self.chunk_memo.values():
                outputs, grads = [], []
                for index, source in enumerate(sources):
                    received = [chunk[index].grad for chunk in copies if chunk[index].grad is not None]
                    if received and source.requires_grad:
                        outputs.append(source)
                        grads.append(torch.stack(received).sum(0))  # a fixed order: reproducible
                if outputs:
                    torch.autograd.backward(outputs, grads)
        finally:
            self.chunk_memo = None

    def run(self, headers: Sequence[tuple[int, Sequence[int]]]):
        """Run the listed headers once, through the active adapter, in one forward: ``(agent, opening ids)`` each,
        that agent's role header followed by the opening (empty: the role header alone).

        Returns ``(cache, header_ids (n, Hmax), header_mask (n, Hmax))``, headers left-padded to the
        longest, or ``(None, ...)`` when every header is empty (anonymous profiles, no opening). Inside
        :meth:`frozen` the result is computed once per adapter and headers.
        """
        headers = tuple((agent, tuple(opening)) for agent, opening in headers)
        memo_key = (self.bank.active, self.bank.merged_adapter, headers)  # merged weights give (within rounding) other keys/values
        if self.memo is not None and memo_key in self.memo:
            cache, header_ids, header_mask = self.memo[memo_key]
            return copy.deepcopy(cache), header_ids, header_mask  # forwards extend the cache they are given
        chunked = self.chunk_memo is not None and torch.is_grad_enabled()
        if not (chunked and memo_key in self.chunk_memo):
            header_ids, header_mask = left_pad([self.header_ids[a] + list(opening) for a, opening in headers], self.pad_id, self.device)
            if header_ids.shape[1] == 0:
                return None, header_ids, header_mask
            cache = self.forward_headers(header_ids, header_mask)
            if self.memo is not None:
                if len(self.memo) >= MEMO_ENTRIES:
                    self.memo.pop(next(iter(self.memo)))  # the oldest
                self.memo[memo_key] = (copy.deepcopy(cache), header_ids, header_mask)
            if not chunked:
                return cache, header_ids, header_mask
            self.chunk_memo[memo_key] = ([t for layer in cache.layers for t in (layer.keys, layer.values)], [], header_ids, header_mask)
        sources, copies, header_ids, header_mask = self.chunk_memo[memo_key]
        return self._detached_copy(sources, copies), header_ids, header_mask

    def forward_headers(self, header_ids: torch.Tensor, header_mask: torch.Tensor):
        """One forward of left-padded headers ``(n, Hmax)`` through the active adapter → their cache. With
        :attr:`unpadded_forward` it runs on the headers' real tokens (keys and values are all it keeps: the last
        layer's queries and MLP run on one column only), pads' keys and values zero (every row masks them)."""
        decoder = self.bank.model.get_base_model().get_decoder()
        if self.unpadded_forward:
            positions = position_ids_from_mask(header_mask)
            _, _, keys_values = unpadded_decoder_states(decoder, None, header_ids, header_mask, positions, tail=1, keep_keys_values=True)
            return DynamicCache(keys_values)  # per layer (keys, values) (n, kv, Hmax, d)
        return decoder(
            input_ids=header_ids, attention_mask=header_mask, position_ids=position_ids_from_mask(header_mask), use_cache=True,
        ).past_key_values  # header positions 0..h_a-1, as in every row of agent a

    def _detached_copy(self, sources: list[torch.Tensor], copies: list) -> DynamicCache:
        """A cache of detached copies of a header forward's keys/values (leaves that collect one chunk's gradient),
        recorded in ``copies``."""
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in sources]
        copies.append(leaves)
        return DynamicCache([(leaves[i], leaves[i + 1]) for i in range(0, len(leaves), 2)])  # per layer (keys, values)

    def rests(self, agent: int, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What follows agent ``agent``'s role header in each of its left-padded prompts. (B, P) → (B, P - h) ids and mask.

        Row b's rest fills its last len_b - h columns, so dropping the first h columns keeps every rest,
        and the mask of what is left is the prompt mask shifted by h."""
        header = self.header_ids[agent]
        h = len(header)
        if h == 0:
            return prompt_ids, prompt_mask
        starts = prompt_mask.shape[1] - prompt_mask.sum(1, keepdim=True)  # (B, 1) first real column
        columns = starts + torch.arange(h, device=prompt_ids.device)  # (B, h)
        if (columns >= prompt_ids.shape[1]).any() or not torch.equal(
            prompt_ids.gather(1, columns.clamp(max=prompt_ids.shape[1] - 1)), prompt_ids.new_tensor(header).expand(len(prompt_ids), -1)
        ):
            raise ValueError(f"a prompt of agent {agent} does not start with its role header; encode it with encode_prompts")
        return prompt_ids[:, h:], prompt_mask[:, :-h]

    @property
    def sharable(self) -> bool:
        """Whether a forward may start from a shared header's cache now. Not while ``--gradient_checkpointing``
        checkpoints the layers (the update): transformers then drops a given cache (a checkpointed layer would
        write it twice), so the rows would silently lose their header."""
        return not any(layer.training for layer in self.bank.checkpointed_layers)

    def behind_headers(self, batches: Sequence[tuple[int, torch.Tensor, torch.Tensor]], by_layer: bool = False):
        """Prompt batches of one or more agents, re-packed behind their agent's shared role header.

        Args: ``batches``: ``(agent, prompt_ids (B_n, P_n), prompt_mask (B_n, P_n))`` per agent, as the
        prompt encoder writes them (``[pads][header][rest]``).
        Returns :meth:`rows_behind_headers` of their rows in the order given.
        """
        ids, mask, agents = joined_batches(batches, self.pad_id)
        return self.rows_behind_headers(agents, ids, mask, by_layer)

    @property
    def reads_by_layer(self) -> bool:
        """Whether :meth:`decoder_states` runs on the real tokens now, reading a :class:`HeaderRows` layer by layer."""
        return self.unpadded_forward and self.sharable

    def rows_behind_headers(self, agents: torch.Tensor, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, by_layer: bool = False):
        """Prompts of several agents, each row re-packed behind its agent's shared role header (with
        :attr:`share_openings`, and the opening its group of rows shares after it), in their own order.

        Args: ``agents (B,)``: each row's agent; ``prompt_ids (B, P)``, ``prompt_mask (B, P)`` as the prompt
        encoder writes them (``[pads][header][rest]``); ``by_layer``: return the headers as :class:`HeaderRows`
        (for :meth:`decoder_states` while :attr:`reads_by_layer`), not as a transformers cache of every row.
        Returns ``(cache, ids (B, Hmax + S), mask (B, Hmax + S))``, each row ``[header][pads][rest]``: the cache
        holds the Hmax header columns (:meth:`run`: one forward for the distinct headers, whatever the number
        of rows; its keys/values are indexed per row, so under autograd each header's backward receives the
        summed gradient of its rows), and pad-aware positions from ``mask`` equal those of the unshared rows.
        ``(None, prompt_ids, prompt_mask)`` when nothing can be shared (no headers, prompts that are only their
        header, or not :attr:`sharable`).
        """
        distinct = agents.unique().tolist()  # sorted agents
        if not self.sharable or (not self.share_openings and all(len(self.header_ids[a]) == 0 for a in distinct)):
            return None, prompt_ids, prompt_mask
        B, device = len(agents), prompt_ids.device
        header_of_row = torch.empty(B, dtype=torch.long, device=device)  # (B,) each row's index into the headers
        headers, rests = [], []  # (agent, opening) per header; (rows, rest ids, rest mask) per agent
        for a in distinct:
            rows = (agents == a).nonzero().squeeze(1).to(device)  # the agent's rows
            ids, mask = self.rests(a, prompt_ids[rows], prompt_mask[rows])
            opening = shared_opening(ids, mask, len(self.header_ids[a]), enabled=self.share_openings)
            header_of_row[rows] = len(headers) + opening.group_of_row.to(device)
            headers += [(a, ids_of_opening) for ids_of_opening in opening.openings]
            rests.append((rows, *drop_openings(ids, mask, opening.length, self.pad_id)))
        width = max(ids.shape[1] for _, ids, _ in rests)
        if width == 0:  # prompts that are only their header: nothing would follow the cache
            return None, prompt_ids, prompt_mask
        rest_ids = torch.full((B, width), self.pad_id, dtype=prompt_ids.dtype, device=device)  # (B, S) right-aligned rests
        rest_mask = torch.zeros((B, width), dtype=prompt_mask.dtype, device=device)
        for rows, ids, mask in rests:
            rest_ids[rows, width - ids.shape[1]:] = ids
            rest_mask[rows, width - mask.shape[1]:] = mask
        cache, header_ids, header_mask = self.run(headers)
        if cache is None:  # anonymous roles and no shared opening
            return None, prompt_ids, prompt_mask
        ids = torch.cat([header_ids[header_of_row], rest_ids], dim=1)
        mask = torch.cat([header_mask[header_of_row], rest_mask], dim=1)
        rows = HeaderRows(cache, header_of_row)
        return (rows if by_layer else rows.materialized()), ids, mask

    def decoder_states(self, cache, ids: torch.Tensor, mask: torch.Tensor, tail: int) -> torch.Tensor:
        """Last hidden states of the active adapter's decoder at the last ``tail`` columns of ``ids (B, S)``, whose
        first columns ``cache`` (or None) already holds. → (B, tail, H).

        With :attr:`unpadded_forward` (and not under gradient checkpointing, whose layer wrappers it would
        bypass) the layers' matrix products run on the real tokens only, and the last layer's queries, attention
        and MLP on those columns only (:func:`unpadded_decoder_states`); the states of pads among them are then
        arbitrary (transformers' forward gives them values no caller reads either)."""
        cached = 0 if cache is None else cache.get_seq_length()
        decoder = self.bank.model.get_base_model().get_decoder()
        positions = position_ids_from_mask(mask)[:, cached:]  # (B, S - cached)
        ids = ids[:, cached:]
        if self.reads_by_layer:
            return unpadded_decoder_states(decoder, cache, ids, mask, positions, tail=tail)[0]  # (B, tail, H)
        if isinstance(cache, HeaderRows):
            cache = cache.materialized()
        return decoder(
            input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=cache is not None,
        ).last_hidden_state[:, -tail:]
