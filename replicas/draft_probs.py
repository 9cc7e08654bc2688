"""The draft's q as it travels to the target: its most likely entries only, and exact.

A sampled draft round needs q at the target: q(x) of each draft x for the acceptance chance
min(1, p(x) / q(x)), and the whole row for the residual max(0, p - q) a rejection samples
from (replicas/speculative.py). Dense, q is [k, V] float32: at a 128 k vocabulary 512 KB a
draft, 64 MB a round of 32 sequences at k 4, through the host and over the network.

So the draft samples from q cut to its `top` most likely tokens and renormalised (q_top),
and ships exactly that: the ids and values of those entries. The target rebuilds q_top
bitwise (every other entry is 0), and the rule is exact because q_top is the distribution
the drafts were sampled from. Cutting costs a little acceptance where q's tail had mass the
target would have kept; on a vocabulary of at most `top` tokens nothing is cut.

Terms: V the vocabulary, k the drafts of a call, m = min(top, V) the entries kept a row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEFAULT_TOP = 256       # entries of q kept a draft: 2 KB a draft instead of 4 V bytes


def cut_to_top(q: torch.Tensor, top: int) -> torch.Tensor:
    """q [V] restricted to its `top` largest entries, renormalised: what the draft samples."""
    if top >= q.shape[-1]:
        return q
    kept = torch.zeros_like(q).scatter_(-1, q.topk(top).indices, 1.0)
    cut = q * kept
    return cut / cut.sum()


@dataclass(frozen=True)
class TopProbs:
    """Rows of q_top as (ids, values) [k, m] of a vocabulary of `vocab` tokens."""
    ids: torch.Tensor         # [k, m] int64
    values: torch.Tensor      # [k, m] of q_top's dtype; each row's entries outside ids are 0
    vocab: int

    @classmethod
    def of(cls, rows: torch.Tensor, top: int) -> TopProbs:
        """Rows [k, V] of cut_to_top's output (at most `top` nonzero entries each)."""
        return cls.of_calls([list(rows)], top)[0]

    @classmethod
    def of_calls(cls, calls: list[list[torch.Tensor]], top: int) -> list[TopProbs | None]:
        """Each call's rows [V] of cut_to_top's output as TopProbs on the host (None for a call
        without rows), every call's in one transfer from the device: ids and values travel
        together as float64, which holds both exactly (ids below 2^53, float32 values)."""
        if not any(calls):
            return [None] * len(calls)
        every = torch.stack([row for rows in calls for row in rows])                 # [sum k, V]
        kept = every.topk(min(top, every.shape[-1]), dim=-1)
        both = torch.stack([kept.indices.double(), kept.values.double()]).cpu()    # [2, sum k, m]
        ids, values = both[0].long(), both[1].to(every.dtype)
        out, start = [], 0
        for rows in calls:
            out.append(cls(ids[start:start + len(rows)], values[start:start + len(rows)], every.shape[-1])
                       if rows else None)
            start += len(rows)
        return out

    @property
    def shape(self) -> tuple[int, int]:
        return (self.ids.shape[0], self.vocab)

    def __getitem__(self, rows: slice) -> TopProbs:
        return TopProbs(self.ids[rows], self.values[rows], self.vocab)

    def dense(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """q_top [k, V] as the draft sampled from it."""
        out = torch.zeros(self.shape, dtype=self.values.dtype, device=device)
        return out.scatter_(-1, self.ids.to(device), self.values.to(device))
