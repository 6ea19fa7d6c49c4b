"""KV blocks in host memory: the swap pool and the prefix cache's host tier.

Swap preemption: the scheduler decides (`--preemption-mode swap|auto`) and puts the block
mappings on the batch (`Batch.swap_in`, `Batch.swap_out`); `HostKVBlocks.apply` moves the data
before the batch runs, swap-ins first (see `Batch`). The pool is one tensor, block-major: a
host block holds every layer's K and V for its tokens and is one contiguous copy, pinned on CUDA
so that the copies run at the link's speed. On CPU both sides are host memory and a swap is a
memcpy.

The prefix cache's host tier (`--prefix-cache device+host`) is a second HostKVBlocks of its
own size: the engine copies a batch's `cache_out` blocks into it before anything else, and
its `cache_in` blocks back after the swaps (see Batch for the order).

Only one process holds the KV here: with tp, spp or kvp > 1 every rank would have to move its
own shard, which is not built yet, so swapping is refused there with an error.
"""

from __future__ import annotations

import dataclasses

import torch

from medha.core.batch import Batch
from medha.engine.errors import EngineError
from medha.perf import ParallelConfig
from medha.scheduler.config import SchedulerConfig


def size_host_memory(
    scheduler: SchedulerConfig, parallel: ParallelConfig, kv_bytes_per_token: int, block_size: int
) -> SchedulerConfig:
    """The scheduler config with the prefix cache's default chosen (device in one process, off
    with worker processes), the swap pool and the prefix cache's host tier sized in blocks of
    this engine's KV dtype; refuses what is not built. `parallel`: the engine's layout."""
    layout = ", ".join(
        f"{k}={getattr(parallel, k)}" for k in ("tp", "spp", "kvp") if getattr(parallel, k) > 1
    )
    block_bytes = kv_bytes_per_token * block_size
    if scheduler.prefix_cache is None:
        # the engine's default: on, as vLLM's and SGLang's are (docs/prefix_cache.md measured
        # that it costs the schedulers nothing), where it is built: in one process
        mode = "off" if layout else "device"
        scheduler = dataclasses.replace(scheduler, prefix_cache=mode)
    if scheduler.prefix_cache != "off":
        if layout:  # the block tables would carry shared blocks to every rank; not yet tested
            raise EngineError(
                f"prefix_cache {scheduler.prefix_cache} runs in one process so far, not with "
                f"{layout}: use prefix_cache off"
            )
        if scheduler.prefix_cache == "device+host" and scheduler.host_cache_blocks is None:
            blocks = int(scheduler.host_cache_gb * 2**30 // block_bytes)
            scheduler = dataclasses.replace(scheduler, host_cache_blocks=blocks)
    if scheduler.preemption_mode == "recompute":
        return scheduler
    if layout:
        raise EngineError(
            f"preemption_mode {scheduler.preemption_mode} runs in one process "
            f"so far, not with {layout}: use preemption_mode recompute"
        )
    if scheduler.host_kv_blocks is not None:
        return scheduler
    blocks = int(scheduler.swap_space_gb * 2**30 // block_bytes)
    return dataclasses.replace(scheduler, host_kv_blocks=blocks)


def move_kv(
    batch: Batch, swap_blocks: HostKVBlocks | None, prefix_host_blocks: HostKVBlocks | None
) -> None:
    """The batch's KV copies, before its step runs, in the order Batch gives."""
    if batch.cache_out:
        prefix_host_blocks.swap_out(
            [d for d, _ in batch.cache_out], [h for _, h in batch.cache_out]
        )
    if swap_blocks is not None:
        swap_blocks.apply(batch)
    if batch.cache_in:
        prefix_host_blocks.swap_in([h for h, _ in batch.cache_in], [d for _, d in batch.cache_in])


class HostKVBlocks:
    """One host tensor of KV blocks and the copies between it and the device's KV cache."""

    def __init__(self, kv_caches: list[torch.Tensor], num_blocks: int, block_size: int) -> None:
        """`kv_caches`: the model runner's per-layer K/V tensors, [..., slots, head_dim]."""
        self.caches = kv_caches
        first = self.caches[0]
        self.device = first.device
        self.block_size = block_size
        # [host block, layer, ..., token in block, head_dim]; empty, not zeros: only blocks
        # that were written are ever copied back
        shape = (num_blocks, len(self.caches), *first.shape[:-2], block_size, first.shape[-1])
        self.host = torch.empty(shape, dtype=first.dtype, pin_memory=self.device.type == "cuda")

    @classmethod
    def for_swap_pool(cls, scheduler: SchedulerConfig, runner) -> HostKVBlocks | None:
        """The swap pool (None: preemption by recompute only)."""
        if scheduler.preemption_mode == "recompute" or not scheduler.host_kv_blocks:
            return None
        return cls(runner.kv_caches, scheduler.host_kv_blocks, runner.block_size)

    @classmethod
    def for_prefix_host_tier(cls, scheduler: SchedulerConfig, runner) -> HostKVBlocks | None:
        """The prefix cache's host tier (None: no host tier)."""
        if scheduler.prefix_cache != "device+host" or not scheduler.host_cache_blocks:
            return None
        return cls(runner.kv_caches, scheduler.host_cache_blocks, runner.block_size)

    def apply(self, batch: Batch) -> None:
        """Move the batch's swaps: host -> device first, then device -> host (a swap-out may
        reuse a host block a swap-in of the same batch emptied)."""
        if batch.swap_in:
            self.swap_in(
                [h for s in batch.swap_in for h in s.host_blocks],
                [d for s in batch.swap_in for d in s.device_blocks],
            )
        if batch.swap_out:
            self.swap_out(
                [d for s in batch.swap_out for d in s.device_blocks],
                [h for s in batch.swap_out for h in s.host_blocks],
            )

    def _blocks(self, cache: torch.Tensor) -> torch.Tensor:
        """A cache tensor as [..., block, token in block, head_dim] (a view)."""
        return cache.unflatten(-2, (-1, self.block_size))

    @torch.inference_mode()
    def swap_out(self, device_blocks: list[int], host_blocks: list[int]) -> None:
        idx = torch.tensor(device_blocks, device=self.device)
        # gather every layer's blocks on the device, then one contiguous copy per run of
        # consecutive host blocks
        staged = torch.stack([self._blocks(c).index_select(-3, idx) for c in self.caches])
        staged = staged.movedim(-3, 0).contiguous()  # [block, K/V of each layer, ...]
        # non-blocking on CUDA: the host pool is read only by later swap-ins, copies on the
        # same stream, and the step that may overwrite these device blocks queues behind
        for i, h, n in _runs(host_blocks):
            self.host[h : h + n].copy_(staged[i : i + n], non_blocking=True)

    @torch.inference_mode()
    def swap_in(self, host_blocks: list[int], device_blocks: list[int]) -> None:
        staged = torch.empty(
            (len(host_blocks), *self.host.shape[1:]), dtype=self.host.dtype, device=self.device
        )
        for i, h, n in _runs(host_blocks):
            staged[i : i + n].copy_(self.host[h : h + n], non_blocking=True)
        idx = torch.tensor(device_blocks, device=self.device)
        for j, cache in enumerate(self.caches):
            self._blocks(cache).index_copy_(-3, idx, staged[:, j].movedim(0, -3))


def _runs(blocks: list[int]):
    """(position, first block, length) of each run of consecutive block ids."""
    start = 0
    for i in range(1, len(blocks) + 1):
        if i == len(blocks) or blocks[i] != blocks[i - 1] + 1:
            yield start, blocks[start], i - start
            start = i
