"""What swapping KV blocks to host memory and back costs, beside what recomputing them costs.

Each device moves its own shard of a block (its TP share of the KV heads, its stage's layers)
over its own host link, all devices at once. A batch meets its swaps in every pipeline stage
in turn (each stage copies its layers' KV when the batch reaches it), so a swap adds spp times
one device's copy time to the batch's latency. Per-transfer latency (about 10 us on PCIe) is
left out: swaps move whole requests, megabytes at a time.
"""

from __future__ import annotations

from medha.perf.predictor import Predictor


class SwapCost:
    def __init__(
        self, predictor: Predictor, block_size: int, bandwidth_gbps: float | None = None
    ) -> None:
        """`bandwidth_gbps` overrides the hardware's host link (GB/s per device, one way)."""
        model, hw, par = predictor.model, predictor.hardware, predictor.parallel
        shards = min(par.tp, model.num_kv_heads) * par.spp
        self.block_bytes = model.kv_bytes_per_token(hw.dtype_bytes) * block_size / shards
        self.bandwidth = bandwidth_gbps * 1e9 if bandwidth_gbps else hw.host_link_bw
        self._stages = par.spp

    def time(self, num_blocks: int) -> float:
        """Seconds one direction of a swap of `num_blocks` blocks adds to a batch."""
        return num_blocks * self.block_bytes / self.bandwidth * self._stages

    def blocks_in(self, memory_bytes: float) -> int:
        """Host blocks that `memory_bytes` of host memory per device hold."""
        return int(memory_bytes // self.block_bytes)
