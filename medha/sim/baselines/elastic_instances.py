"""LoongServe's elastic instances and the KV each holds: which requests' KV lives where, in
16-token blocks, never more than an instance's capacity.

A request's KV is reserved whole (prompt plus every output token it may generate) when its
prefill starts, on the instances the scale-down picks among those of its prefill; it fills
them in order (the first holder's share, then the next's), which is where each decode step
reads its KV and writes the new token's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from medha.core.request import Request


@dataclass(eq=False)
class Share:
    """`tokens` of a request's context, positions [offset, offset + tokens), on `instance`."""

    instance: Instance
    offset: int
    tokens: int


@dataclass(eq=False)
class Instance:
    """One elastic instance: a TP group, on `node` (a group of tp devices in a node)."""

    index: int
    node: int
    capacity: int  # KV tokens (whole blocks)
    block_size: int
    used: int = 0  # KV tokens reserved, a whole number of blocks
    prefill: object | None = None  # the prefill iteration it is taken by (planned or running)
    decode_end: float | None = None  # end of the decode iteration it runs, if any
    holds: dict[str, Request] = field(default_factory=dict)  # requests with KV here

    @property
    def free(self) -> int:
        return self.capacity - self.used

    def __repr__(self) -> str:
        return f"Instance({self.index}, node {self.node}, {self.used}/{self.capacity} KV tokens)"


class KVLedger:
    """Where each live request's KV is; what the request table's `kv` frees a request through
    (it calls `free(request_id)` when a request ends; no prefix caching)."""

    prefix_caching = False
    cache_outputs = False

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.shares: dict[str, list[Share]] = {}

    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size) * self.block_size

    def plan(self, need: int, instances: Sequence[Instance], taken: dict | None = None):
        """The fewest of `instances` that hold `need` tokens, most free memory first (ties: the
        lower index), as (instance, tokens reserved) pairs; None if they cannot. `taken`: tokens
        already promised on some instances (other prompts of the same batch)."""
        taken = taken or {}
        order = sorted(instances, key=lambda i: (-(i.free - taken.get(i, 0)), i.index))
        out, left = [], self._blocks(need)
        for inst in order:
            if left <= 0:
                break
            room = inst.free - taken.get(inst, 0)
            if room <= 0:
                continue
            take = min(room, left)
            out.append((inst, take))
            left -= take
        return out if left <= 0 else None

    def reserve(self, r: Request, plan: list[tuple[Instance, int]]) -> None:
        shares, offset = [], 0
        for inst, tokens in plan:
            inst.used += tokens
            if inst.used > inst.capacity:
                raise AssertionError(f"{inst} over capacity")
            inst.holds[r.request_id] = r
            shares.append(Share(inst, offset, tokens))
            offset += tokens
        self.shares[r.request_id] = shares

    def free(self, request_id: str) -> None:
        for s in self.shares.pop(request_id, ()):
            s.instance.used -= s.tokens
            del s.instance.holds[request_id]

    def decode_layout(self, r: Request, kv_len: int) -> tuple[Instance, list[tuple[Instance, int]]]:
        """For a decode step over `kv_len` cached tokens: the instance that writes the new
        token's KV and runs the request's token-parallel work (its master), and each holder's
        cached tokens (those holding any)."""
        shares = self.shares[r.request_id]
        parts = [
            (s.instance, min(s.tokens, kv_len - s.offset)) for s in shares if kv_len > s.offset
        ]
        master = next(
            (s.instance for s in shares if kv_len < s.offset + s.tokens), shares[-1].instance
        )
        return master, parts

    def check(self, instances: Sequence[Instance]) -> None:
        """Every instance's reservation is the sum of the shares on it, within capacity."""
        held = {i: 0 for i in instances}
        for shares in self.shares.values():
            for s in shares:
                held[s.instance] += s.tokens
        for inst, tokens in held.items():
            if tokens != inst.used or not 0 <= inst.used <= inst.capacity:
                raise AssertionError(f"{inst}: shares hold {tokens} tokens")
