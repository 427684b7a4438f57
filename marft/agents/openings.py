"""Shared prompt openings: after its role header, many prompts of one agent often open with the same text (a game's
rules, a puzzle's instructions, the empty top rows of a board). Rows that share an opening can run it once, as part
of their header (:class:`marft.agents.headers.RoleHeaderCache`), instead of once in every row.

:func:`shared_opening` picks, per agent and batch, one opening length ``L``: the rows are grouped by their first ``L``
tokens, each group's opening runs once behind the agent's role header, and every row keeps only what follows. The
length is the one that saves the most positions, counting the extra header copy each further group costs; an
opening that saves less than :data:`MIN_SAVED_SHARE` of the rows' positions is not taken (prompts whose openings
differ, such as one math problem per row, stay as they were).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MIN_SAVED_SHARE = 0.125
"""An opening is shared only when it saves at least this share of the rows' positions (after the role header)."""


@dataclass
class Opening:
    """Rows grouped by a shared opening of ``length`` tokens: ``openings[g]`` the ids of group ``g``'s opening, and
    ``group_of_row (n,)`` each row's group (in the order the groups first appear). ``length`` 0: nothing shared, one
    empty opening for every row."""

    length: int
    openings: list[list[int]]
    group_of_row: torch.Tensor


def positions_saved(length: int, rows: int, groups: int, header_tokens: int) -> int:
    """Positions a forward saves when ``rows`` rows share openings of ``length`` tokens in ``groups`` groups behind
    a role header of ``header_tokens``: every row drops the opening, and each group runs it once with its own copy of
    the header (one header forward ran before: ``groups - 1`` more)."""
    return length * (rows - groups) - (groups - 1) * header_tokens


def shared_opening(ids: torch.Tensor, mask: torch.Tensor, header_tokens: int, enabled: bool = True,
                   min_saved_share: float = MIN_SAVED_SHARE) -> Opening:
    """The opening that rows ``ids (n, W)``, left-padded (``mask (n, W)``), share best behind a role header of
    ``header_tokens`` tokens (see the module's docstring); not ``enabled``: none. Every row keeps at least one
    token after its opening."""
    n = len(ids)
    lengths = mask.sum(1)  # (n,) real tokens per row
    cap = int(lengths.min()) - 1 if n else 0  # every row keeps a token after the opening
    nothing = Opening(0, [[]], torch.zeros(n, dtype=torch.long))
    if not enabled or n < 2 or cap <= 0:
        return nothing
    W = ids.shape[1]
    starts = W - lengths  # (n,) first real column
    columns = (starts[:, None] + torch.arange(cap, device=ids.device)).clamp(max=W - 1)  # (n, cap)
    heads = ids.gather(1, columns).cpu()  # (n, cap) each row's first cap real tokens
    rows = heads.tolist()
    order = sorted(range(n), key=rows.__getitem__)  # lexicographic: rows sharing an opening are adjacent
    ordered = heads[order]  # (n, cap)
    common = (ordered[1:] == ordered[:-1]).long().cumprod(1).sum(1)  # (n - 1,) opening shared by neighbours
    best_length, best_saved = 0, min_saved_share * float(lengths.sum())
    for length in sorted(set(common.tolist()) - {0}):
        groups = 1 + int((common < length).sum())
        saved = positions_saved(length, n, groups, header_tokens)
        if saved > best_saved:
            best_length, best_saved = length, saved
    if best_length == 0:
        return nothing
    index: dict[tuple[int, ...], int] = {}
    group_of_row = torch.tensor([index.setdefault(tuple(row[:best_length]), len(index)) for row in rows])
    return Opening(best_length, [list(opening) for opening in index], group_of_row)


def drop_openings(ids: torch.Tensor, mask: torch.Tensor, length: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded rows ``(n, W)`` without their first ``length`` real tokens, left-padded to the longest rest:
    ``(n, W')`` ids and mask."""
    if length == 0:
        return ids, mask
    rest = mask.sum(1) - length  # (n,) tokens left per row (> 0: see shared_opening)
    width = int(rest.max())
    ids, mask = ids[:, ids.shape[1] - width:], mask[:, mask.shape[1] - width:].clone()  # the real rest is right-aligned
    mask[torch.arange(width, device=mask.device)[None, :] < (width - rest)[:, None].to(mask.device)] = 0  # (n, W')
    return ids.masked_fill(mask == 0, pad_id), mask
