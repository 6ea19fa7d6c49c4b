"""Tensor parallelism inside one stage: which slice of each weight a rank holds, and the
all-reduce that joins the partial sums.

Attention is split by KV head (each rank keeps whole GQA groups, so no K/V is exchanged) and
the MLP by intermediate column; both end in a row-parallel linear whose partial outputs are
summed across the ranks. Counts that do not divide (SmolLM2 has 3 KV heads) are split as
evenly as they go, the first ranks taking one more. Embedding and LM head stay whole on every
rank: the logits are computed once, by rank 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: object = None  # the torch.distributed group of this stage's TP ranks

    def part(self, n: int) -> tuple[int, int]:
        """This rank's [start, end) of n units."""
        base, extra = divmod(n, self.size)
        start = self.rank * base + min(self.rank, extra)
        return start, start + base + (1 if self.rank < extra else 0)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x


SINGLE = TensorParallel()


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W split by input column: each rank multiplies its slice, the partial
    outputs are summed, and the bias is added once, after the sum."""

    def __init__(self, in_local: int, out_features: int, bias: bool, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, in_local))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias
