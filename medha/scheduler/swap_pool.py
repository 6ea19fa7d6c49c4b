"""The swap pool: the host memory swapped-out KV waits in; the choice between swap and recompute.

A preempted request either loses its KV (recompute: its context is prefilled again later) or
has it copied to host blocks and back (swap: its progress is kept). Swapping costs the bytes
moved over the host link twice (out now, in later); recomputing costs the prefill of what was
computed. `auto` takes the cheaper one; both swapping modes recompute when the pool is full.

The pool is a second BlockManager: the same exact accounting (no leak, no block owned twice)
covers host blocks, and a request owns blocks in at most one of the two between batches.
"""

from __future__ import annotations

import math

from medha.core.batch import KVSwap
from medha.core.request import Request
from medha.perf.swap_cost import SwapCost
from medha.scheduler.block_manager import BlockAccountingError, BlockManager


class SwapPool:
    def __init__(self, num_blocks: int, block_size: int, cost: SwapCost, mode: str) -> None:
        if mode not in ("swap", "auto"):
            raise ValueError(f"a host pool serves preemption_mode swap or auto, not {mode!r}")
        self.mode = mode
        self.cost = cost
        self.block_size = block_size
        self.blocks = BlockManager(num_blocks, block_size)

    @property
    def num_blocks(self) -> int:
        return self.blocks.num_blocks

    @property
    def num_free(self) -> int:
        return self.blocks.num_free

    def tokens_held(self, request_id: str) -> int:
        return self.blocks.tokens_held(request_id)

    def owners(self) -> list[str]:
        return self.blocks.owners()

    def should_swap(self, r: Request, recompute_s: float) -> bool:
        """Swap `r` out (rather than drop its KV)? Only when the pool holds what it computed,
        and, in auto mode, moving it out and back is predicted cheaper than recomputing it."""
        need = math.ceil(r.num_computed / self.block_size)
        if need == 0 or need > self.num_free:
            return False
        return self.mode == "swap" or 2 * self.cost.time(need) < recompute_s

    def swap_out(self, r: Request, device: BlockManager) -> KVSwap:
        """Copy plan of `r`'s computed blocks to fresh host blocks; frees all its device ones."""
        need = math.ceil(r.num_computed / self.block_size)
        self.blocks.grow(r.request_id, need * self.block_size)
        host = list(self.blocks.blocks_of(r.request_id))
        dev = list(device.blocks_of(r.request_id)[:need])
        device.free(r.request_id)
        return KVSwap(r, dev, host)

    def swap_in_need(self, r: Request) -> int:
        """Device blocks `r` needs to come back and take one more token."""
        return math.ceil((r.num_computed + 1) / self.block_size)

    def swap_in(self, r: Request, device: BlockManager) -> KVSwap:
        """Copy plan of `r`'s host blocks into fresh device blocks; frees the host ones."""
        host = list(self.blocks.blocks_of(r.request_id))
        device.grow(r.request_id, len(host) * self.block_size)
        dev = list(device.blocks_of(r.request_id))
        self.blocks.free(r.request_id)
        return KVSwap(r, dev, host)

    def free(self, request_id: str) -> int:
        return self.blocks.free(request_id)

    def check_invariants(self, swapped: dict[str, Request], device: BlockManager) -> None:
        """Host blocks are owned only by swapped requests, which hold no device blocks and
        enough host blocks for what they computed."""
        self.blocks.check_invariants()
        for rid in self.owners():
            if rid not in swapped:
                raise BlockAccountingError(f"host blocks of {rid} outlived its swap")
        for rid, r in swapped.items():
            if device.blocks_of(rid):
                raise BlockAccountingError(f"{rid} owns device and host blocks at once")
            if self.tokens_held(rid) < r.num_computed:
                raise BlockAccountingError(
                    f"{rid} computed {r.num_computed} tokens, "
                    f"holds {self.tokens_held(rid)} on the host"
                )
