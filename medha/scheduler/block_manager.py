"""Paged KV blocks: which fixed-size blocks of the cache hold each request's tokens.

With KV-cache parallelism (KvpBlockManager) each group of devices has its own pages, and a
request's tokens fill group 0 up to `max_tokens_per_group` (or the group's size, if smaller),
then group 1, and so on (groups join as a request grows; the last group takes whatever is
left). A block is of use only in its group, so `shortfall` counts free blocks per group. Both
managers live in this module because `BlockManager.for_layout` picks between them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from medha.core.request import Request
from medha.perf.model_specs import ModelSpec
from medha.perf.parallel_config import ParallelConfig


class BlockAccountingError(AssertionError):
    pass


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Popping from the end hands out low block ids first, which keeps tests readable.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[str, list[int]] = {}

    @classmethod
    def from_memory(
        cls,
        kv_memory_bytes: float,
        model: ModelSpec,
        parallel: ParallelConfig,
        dtype_bytes: int,
        block_size: int = 16,
    ) -> BlockManager:
        """Blocks that fit in `kv_memory_bytes` of KV memory per device.

        Each device holds its TP share of the heads and its SPP share of the layers; each KVP
        group holds its own pages, so a replica has kvp times the blocks of one group.
        """
        per_token = model.kv_bytes_per_token(dtype_bytes) / (
            min(parallel.tp, model.num_kv_heads) * parallel.spp
        )
        blocks = int(kv_memory_bytes // (per_token * block_size))
        if blocks < 1:
            raise ValueError(
                f"kv memory of {kv_memory_bytes:.3g} bytes holds no "
                f"{block_size}-token block of {model.name}"
            )
        return cls.for_layout(blocks, block_size, parallel)

    @classmethod
    def for_layout(
        cls, blocks_per_group: int, block_size: int, parallel: ParallelConfig
    ) -> BlockManager:
        """`blocks_per_group` blocks, or with KV-cache parallelism that many in each group."""
        if parallel.kvp == 1:
            return cls(blocks_per_group, block_size)
        return KvpBlockManager(
            blocks_per_group, block_size, parallel.kvp, parallel.max_tokens_per_kvp_group
        )

    # ---- queries -----------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def owners(self) -> list[str]:
        return list(self._tables)

    def blocks_of(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def at_capacity(self, requests: Iterable[Request]) -> list[Request]:
        """Those of `requests` whose blocks hold no more than their scheduled tokens: the next
        token each schedules needs a new block. (One pass for a batch's decodes.) A request's
        blocks hold at least its scheduled tokens (check_invariants), so only one whose count
        is a whole number of blocks can be full: the others are passed over without a lookup."""
        get, bs = self._tables.get, self.block_size
        return [
            r
            for r in requests
            if not r.num_scheduled % bs and len(get(r.request_id, ())) * bs <= r.num_scheduled
        ]

    def tokens_held(self, request_id: str) -> int:
        return len(self._tables.get(request_id, ())) * self.block_size

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Extra blocks for `request_id` to hold `num_tokens` tokens in total."""
        have = len(self._tables.get(request_id, ()))
        return max(0, math.ceil(num_tokens / self.block_size) - have)

    def shortfall(
        self, request_id: str, num_tokens: int, reserve: int = 0, freeable: tuple[str, ...] = ()
    ) -> int:
        """Blocks still missing for `request_id` to hold `num_tokens` tokens with `reserve`
        blocks left free (0: it fits), counting the blocks of `freeable` requests as free."""
        free = self.num_free + sum(len(self._tables.get(v, ())) for v in freeable)
        return max(0, self.blocks_needed(request_id, num_tokens) - (free - reserve))

    def can_grow_each(self, count: int) -> bool:
        """Whether `count` requests can each take one more block, wherever their next one lies."""
        return count <= self.num_free

    # ---- changes -----------------------------------------------------------------------------
    def grow(self, request_id: str, num_tokens: int, reserve: int = 0) -> int:
        """Give `request_id` blocks for up to `num_tokens` tokens, keeping `reserve` blocks free.

        Returns the number of tokens it can hold now (less than asked when blocks run out).
        """
        table = self._tables.setdefault(request_id, [])
        want = math.ceil(num_tokens / self.block_size) - len(table)
        take = max(0, min(want, len(self._free) - reserve))
        for _ in range(take):
            table.append(self._free.pop())
        if not table:
            del self._tables[request_id]
        return min(num_tokens, len(table) * self.block_size)

    def free(self, request_id: str) -> int:
        blocks = self._tables.pop(request_id, [])
        self._free.extend(reversed(blocks))
        return len(blocks)

    def _free_ids(self) -> list[int]:
        return self._free

    def check_invariants(self) -> None:
        """No leak, no double free: free + used = total, and no block in two places."""
        used = [b for table in self._tables.values() for b in table]
        free_list = self._free_ids()
        free, owned = set(free_list), set(used)
        if len(free) != len(free_list):
            raise BlockAccountingError("a block is on the free list twice")
        if len(owned) != len(used):
            raise BlockAccountingError("a block is owned by two requests (or twice by one)")
        if free & owned:
            raise BlockAccountingError("a block is both free and in use")
        if len(free) + len(owned) != self.num_blocks:
            raise BlockAccountingError(
                f"free {len(free)} + used {len(owned)} != total {self.num_blocks}"
            )
        everything = free | owned
        if min(everything) < 0 or max(everything) >= self.num_blocks:
            raise BlockAccountingError("a block id is out of range")
        if any(not table for table in self._tables.values()):
            raise BlockAccountingError("an empty block table was left behind")


class KvpBlockManager(BlockManager):
    """Blocks owned by KV-cache parallel groups, a request's filled group by group (see the
    module's docstring)."""

    def __init__(
        self, blocks_per_group: int, block_size: int, groups: int, max_tokens_per_group: int
    ) -> None:
        super().__init__(blocks_per_group * groups, block_size)
        if max_tokens_per_group % block_size:
            raise ValueError(
                f"max_tokens_per_kvp_group ({max_tokens_per_group}) must be a "
                f"multiple of the block size ({block_size})"
            )
        self.blocks_per_group = blocks_per_group
        self.groups = groups
        # a request's share of a group that is not its last: G tokens, or the whole group if
        # that is smaller (a group cannot hold more than its blocks)
        self._blocks_per_share = min(max_tokens_per_group // block_size, blocks_per_group)
        # group g owns block ids [g * blocks_per_group, (g + 1) * blocks_per_group)
        self._pools = [
            list(range((g + 1) * blocks_per_group - 1, g * blocks_per_group - 1, -1))
            for g in range(groups)
        ]
        self._free = []

    def group_of(self, block_index: int) -> int:
        """The group that holds a request's `block_index`-th block."""
        return min(block_index // self._blocks_per_share, self.groups - 1)

    @property
    def capacity_tokens(self) -> int:
        """The longest context one request can hold: a share of each group but the last,
        all of the last."""
        return (
            (self.groups - 1) * self._blocks_per_share + self.blocks_per_group
        ) * self.block_size

    def groups_holding(self, request_id: str) -> int:
        table = self._tables.get(request_id, ())
        return self.group_of(len(table) - 1) + 1 if table else 0

    def shortfall(
        self, request_id: str, num_tokens: int, reserve: int = 0, freeable: tuple[str, ...] = ()
    ) -> int:
        """As BlockManager's, but a block is of use only in the group it belongs to: room in
        group 0 does not help a request whose next blocks lie in group 1."""
        free = [len(pool) for pool in self._pools]
        for v in freeable:
            for b in self._tables.get(v, ()):
                free[b // self.blocks_per_group] += 1
        have = len(self._tables.get(request_id, ()))
        need = [0] * self.groups
        for i in range(have, math.ceil(num_tokens / self.block_size)):
            need[self.group_of(i)] += 1
        short = sum(max(0, n - f) for n, f in zip(need, free))
        return max(short, sum(need) - (sum(free) - reserve))

    def can_grow_each(self, count: int) -> bool:
        return all(count <= len(pool) for pool in self._pools)

    @property
    def num_free(self) -> int:
        return sum(map(len, self._pools))

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def grow(self, request_id: str, num_tokens: int, reserve: int = 0) -> int:
        table = self._tables.setdefault(request_id, [])
        want = math.ceil(num_tokens / self.block_size) - len(table)
        for _ in range(max(0, min(want, self.num_free - reserve))):
            pool = self._pools[self.group_of(len(table))]
            if not pool:
                break  # this request's next group is full, though others have room
            table.append(pool.pop())
        if not table:
            del self._tables[request_id]
        return min(num_tokens, len(table) * self.block_size)

    def free(self, request_id: str) -> int:
        blocks = self._tables.pop(request_id, [])
        for b in reversed(blocks):
            self._pools[b // self.blocks_per_group].append(b)
        return len(blocks)

    def _free_ids(self) -> list[int]:
        return [b for pool in self._pools for b in pool]

    def check_invariants(self) -> None:
        """As BlockManager's, and every block sits in its group: free ones in their group's
        pool, a request's i-th block in the group its i-th block belongs to."""
        super().check_invariants()
        for g, pool in enumerate(self._pools):
            if any(b // self.blocks_per_group != g for b in pool):
                raise BlockAccountingError(f"group {g}'s free list holds another's block")
        for rid, table in self._tables.items():
            if any(b // self.blocks_per_group != self.group_of(i) for i, b in enumerate(table)):
                raise BlockAccountingError(f"{rid} holds a block of the wrong KVP group")
