"""How one replica spreads a model over devices: tensor x stream-pipeline x KV-cache parallel."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = field(default=1, metadata={"help": "tensor-parallel degree inside a stage"})
    spp: int = field(default=1, metadata={"help": "stream-pipeline stages (layers split)"})
    kvp: int = field(default=1, metadata={"help": "KV-cache parallel groups for long requests"})
    max_tokens_per_kvp_group: int = field(
        default=1 << 20,
        metadata={"help": "KV tokens one KVP group holds before the next group joins"},
    )

    def __post_init__(self) -> None:
        for name in ("tp", "spp", "kvp", "max_tokens_per_kvp_group"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.tp * self.spp * self.kvp

    def kvp_groups(self, kv_len: int) -> int:
        """Groups holding a request's KV once it has `kv_len` tokens (groups join as it grows)."""
        if self.kvp == 1:
            return 1
        return min(self.kvp, max(1, math.ceil(kv_len / self.max_tokens_per_kvp_group)))
