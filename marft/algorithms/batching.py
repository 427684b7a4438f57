"""An update epoch's rows as minibatches and gradient-accumulation chunks.

A minibatch is one optimizer step; its rows run in chunks whose gradients add up. With several chunks a minibatch's
rows are sorted by length before they are cut (each chunk then pays for less padding), and the chunk token budget
(``--max_chunk_tokens`` / ``--max_chunk_mib``, :mod:`marft.algorithms.chunk_budget`) cuts chunks further, counting
the positions a chunk's forward runs (:func:`forward_positions`). With several processes the rows are shared out as
:func:`plan_minibatches` describes. The trainer (:meth:`~marft.algorithms.ppo.PPOTrainer.minibatches`) calls these
with its config, team and process group.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from marft.distributed import Distributed
from marft.types import TurnBatch


class Minibatch(NamedTuple):
    """One optimizer step's rows (:func:`plan_minibatches`)."""

    chunks: list[torch.Tensor]
    """Row indices of each gradient-accumulation chunk, in the order they run."""
    units: float
    """The minibatch's loss units summed over processes (each chunk's loss is weighted by its share of them)."""
    budget_cut: bool = False
    """Whether the chunk token budget cut it (its chunks then run their own role headers)."""


def forward_positions(rows: int, header: int, rest: int, reply: int, n_headers: int) -> tuple[int, int]:
    """``(rows', headers')``: the positions a chunk's forward runs for ``rows`` rows laid out as ``[rest][reply]``
    behind ``n_headers`` shared role headers (the longest ``header`` tokens each, run once for all their rows), and
    those of the header forward. Prompts that are only their header run whole rows (nothing would follow a shared
    header): ``rows x (header + reply)``, no header forward."""
    if rest == 0:
        return rows * (header + reply), 0
    return rows * (rest + reply), n_headers * header


def row_share(samples: TurnBatch, dist: Distributed) -> tuple[int, int, bool]:
    """``(offset, total, equal)``: where this process's rows start in the union of all processes' rows (rank 0's
    first), how many rows the union has, and whether every process holds as many (one all-reduce;
    ``(0, n, True)`` with one process)."""
    n_samples = samples.prompt_ids.shape[0]
    counts = dist.sum_floats([n_samples if rank == dist.rank else 0 for rank in range(dist.world_size)])
    return int(sum(counts[: dist.rank])), int(sum(counts)), len(set(counts)) == 1


def plan_minibatches(
    samples: TurnBatch,
    chunks_per_minibatch: int,
    num_mini_batch: int,
    dist: Distributed,
    loss_units: Callable[[TurnBatch, torch.Tensor], float],
    budget: int | None,
    header_lengths: torch.Tensor | None,
) -> list[Minibatch]:
    """One epoch: shuffled index minibatches, each split into ``chunks_per_minibatch`` chunks, with the loss
    units (``loss_units(samples, indices)``) of each minibatch summed over processes.

    When every process holds as many rows, each shuffles its own and cuts them into ``num_mini_batch``
    minibatches (so every process runs as many, and seeded runs draw their random numbers as they always did).
    When the shares differ, the permutation is of the union of all processes' rows (drawn by rank 0,
    :meth:`Distributed.permutation`), cut into ``num_mini_batch`` minibatches of ``ceil(total / num_mini_batch)``
    rows; each process keeps its own rows of each, so every process runs as many minibatches (its own part
    possibly empty: no chunk) and the union of the processes' k-th minibatches is the single-process k-th
    minibatch on the union. With several chunks a minibatch's rows are sorted by length before it is cut into
    chunks: each chunk then holds rows of similar lengths and pays for less padding (the minibatch's gradient,
    their sum, is the same). The chunk token ``budget`` (positions; None: none) then cuts chunks further, with
    ``header_lengths`` ``(n,)`` when the forward shares role headers (:func:`header_lengths`); a minibatch it does
    not cut keeps the chunks (and row order) it has without a budget, so a run whose chunks all fit computes
    exactly what it computes without one."""
    n_samples = samples.prompt_ids.shape[0]
    offset, total, equal = row_share(samples, dist)
    if equal:  # every process shuffles its own rows: as many minibatches everywhere, no broadcast
        minibatches = list(torch.randperm(n_samples).split(max(1, math.ceil(n_samples / num_mini_batch))))
    else:
        size = max(1, math.ceil(total / num_mini_batch))
        minibatches = [
            indices[(indices >= offset) & (indices < offset + n_samples)] - offset for indices in dist.permutation(total).split(size)
        ]
    units = dist.sum_floats([loss_units(samples, indices) for indices in minibatches])  # one all-reduce
    lengths = samples.prompt_mask.sum(-1)  # (n,) real prompt tokens (and reply tokens, where replies are trained)
    if samples.response_mask is not None:
        lengths = lengths + samples.response_mask.sum(-1)
    return [
        Minibatch(chunks, max(u, 1.0), budget_cut)
        for indices, u in zip(minibatches, units)
        for chunks, budget_cut in [chunks_of(samples, indices[lengths[indices].argsort(stable=True)], indices,
                                             chunks_per_minibatch, budget, header_lengths)]
    ]


def chunks_of(samples: TurnBatch, by_length: torch.Tensor, shuffled: torch.Tensor, chunks_per_minibatch: int,
              budget: int | None, header_lengths: torch.Tensor | None) -> tuple[list[torch.Tensor], bool]:
    """``(chunks, budget_cut)``: one minibatch's rows (``by_length``: sorted by length; ``shuffled``: as drawn) as
    gradient-accumulation chunks under ``budget`` (see :func:`plan_minibatches`)."""
    chunks = [chunk for chunk in (by_length if chunks_per_minibatch > 1 else shuffled).chunk(chunks_per_minibatch) if len(chunk)]
    if budget is None:
        return chunks, False
    cut = [part for chunk in by_length.chunk(chunks_per_minibatch) if len(chunk)
           for part in token_budget_split(samples, chunk, budget, header_lengths)]
    if len(cut) > len(chunks):
        return cut, True
    if header_lengths is not None and len(chunks) > 1:  # headers shared over the chunks are held until the last
        rows, headers = zip(*(chunk_positions(samples, chunk, header_lengths) for chunk in chunks))
        if max(rows) + sum(headers) > budget:
            return chunks, True  # each chunk runs its own headers instead
    return chunks, False


def chunk_positions(samples: TurnBatch, chunk: torch.Tensor, header_lengths: torch.Tensor) -> tuple[int, int]:
    """``(rows, headers)``: the positions ``chunk``'s forward runs behind its shared role headers, and those of
    its header forward (:func:`forward_positions`)."""
    header = header_lengths[chunk]
    rest = samples.prompt_mask[chunk].sum(-1) - header
    reply = samples.response_mask[chunk].sum(-1).max() if samples.response_mask is not None else 0
    return forward_positions(len(chunk), int(header.max()), int(rest.max()), int(reply), len(samples.agent[chunk].unique()))


def header_lengths(samples: TurnBatch, headers) -> torch.Tensor | None:
    """``(n,)`` each row's role-header tokens when the forward shares the role ``headers``
    (:class:`~marft.agents.headers.RoleHeaderCache`; rows of several agents are then laid out as
    ``[longest header][longest rest]``), else None."""
    if samples.agent is None or not headers.sharable:
        return None
    lengths = torch.tensor([len(ids) for ids in headers.header_ids])  # (n_agents,)
    return lengths[samples.agent.long()]


def token_budget_split(
    samples: TurnBatch, chunk: torch.Tensor, budget: int, header_lengths: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """Cut ``chunk`` (row indices, in order) into consecutive parts whose forward positions stay within
    ``budget``; a row longer than the budget on its own is a part by itself. A part's forward runs
    ``rows x (longest prompt + longest reply)`` positions as :meth:`TurnBatch.trimmed` leaves it, or, with
    ``header_lengths (n,)`` (rows behind shared role headers, ``samples.agent`` set), ``rows x (longest rest
    after its header + longest reply)`` for the rows plus ``agents x longest header`` for the header forward: a
    header runs once for all its rows, so its columns are not counted in every row (they would make the budget
    hold fewer real positions for an agent with a long header than for one whose conversation is long, and the
    peak depend on which agent's chunk runs). What a row keeps of the header it attends to, its keys and values,
    is a small part of a position and not counted. The parts' losses keep their weights (each part's units over
    the minibatch's), so the minibatch's gradient is the same."""
    prompt = samples.prompt_mask[chunk].sum(-1).tolist()  # (n,) real prompt tokens per row
    reply = samples.response_mask[chunk].sum(-1).tolist() if samples.response_mask is not None else [0] * len(prompt)
    shared = header_lengths is not None
    header = header_lengths[chunk].tolist() if shared else [0] * len(prompt)
    agent = samples.agent[chunk].tolist() if shared else [0] * len(prompt)

    parts, start, widest, agents = [], 0, (0, 0, 0), set()  # widest: longest header, rest after it, reply
    for i, row in enumerate(zip(header, (p - h for p, h in zip(prompt, header)), reply)):
        wider = tuple(max(a, b) for a, b in zip(widest, row))
        more = agents | {agent[i]}
        if i > start and sum(forward_positions(i - start + 1, *wider, len(more))) > budget:
            parts.append(chunk[start:i])
            start, wider, more = i, row, {agent[i]}
        widest, agents = wider, more
    parts.append(chunk[start:])
    return parts
