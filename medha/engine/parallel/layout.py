"""Where each process sits in a replica's tp x spp x kvp grid, and its process groups.

Rank r = (k * spp + s) * tp + t: KVP group k, pipeline stage s, tensor-parallel rank t. Rank 0
(k = s = t = 0) is the engine's process. Each KVP group is a whole pipeline of TP ranks holding
its share of the KV cache; the ranks of one stage and one TP slot across the KVP groups merge
their partial attentions, and the TP ranks of one stage and group all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    spp: int = 1
    kvp: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.spp * self.kvp

    def rank(self, k: int, s: int, t: int) -> int:
        return (k * self.spp + s) * self.tp + t

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(kvp group, stage, tp rank) of `rank`."""
        t = rank % self.tp
        s = rank // self.tp % self.spp
        return rank // (self.tp * self.spp), s, t

    def stage_zero_peers(self) -> list[int]:
        """Stage-0 ranks other than rank 0: each needs every step from the engine."""
        return [self.rank(k, 0, t) for k in range(self.kvp) for t in range(self.tp)][1:]

    def groups(self, rank: int) -> tuple[object, object]:
        """This rank's (tp group, kvp group), None where the dimension is 1. Every rank must call
        this, in the same order: torch.distributed creates each group collectively."""
        tp = (
            [
                [self.rank(k, s, t) for t in range(self.tp)]
                for k in range(self.kvp)
                for s in range(self.spp)
            ]
            if self.tp > 1
            else []
        )
        kvp = (
            [
                [self.rank(k, s, t) for k in range(self.kvp)]
                for s in range(self.spp)
                for t in range(self.tp)
            ]
            if self.kvp > 1
            else []
        )
        return _member_group(tp, rank), _member_group(kvp, rank)


def _member_group(rank_lists: list[list[int]], rank: int):
    """Create a group for each list of ranks; return the one holding `rank` (None if none)."""
    mine = None
    for ranks in rank_lists:
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine
