"""KV blocks of a replica with KV-cache parallel groups: each group has its own pages, and a
request's tokens fill group 0 up to `max_tokens_per_group` (or the group's size, if smaller),
then group 1, and so on (groups join as a request grows; the last group takes whatever is
left). A block is of use only in its group, so `shortfall` counts free blocks per group."""

from __future__ import annotations

import math

from medha.scheduler.block_manager import BlockAccountingError, BlockManager


class KvpBlockManager(BlockManager):
    def __init__(self, blocks_per_group: int, block_size: int, groups: int,
                 max_tokens_per_group: int) -> None:
        super().__init__(blocks_per_group * groups, block_size)
        if max_tokens_per_group % block_size:
            raise ValueError(f"max_tokens_per_kvp_group ({max_tokens_per_group}) must be a "
                             f"multiple of the block size ({block_size})")
        self.blocks_per_group = blocks_per_group
        self.groups = groups
        # a request's share of a group that is not its last: G tokens, or the whole group if
        # that is smaller (a group cannot hold more than its blocks)
        self._blocks_per_share = min(max_tokens_per_group // block_size, blocks_per_group)
        # group g owns block ids [g * blocks_per_group, (g + 1) * blocks_per_group)
        self._pools = [list(range((g + 1) * blocks_per_group - 1, g * blocks_per_group - 1, -1))
                       for g in range(groups)]
        self._free = []

    def group_of(self, block_index: int) -> int:
        """The group that holds a request's `block_index`-th block."""
        return min(block_index // self._blocks_per_share, self.groups - 1)

    @property
    def capacity_tokens(self) -> int:
        """The longest context one request can hold: a share of each group but the last,
        all of the last."""
        return ((self.groups - 1) * self._blocks_per_share + self.blocks_per_group) \
            * self.block_size

    def groups_holding(self, request_id: str) -> int:
        table = self._tables.get(request_id, ())
        return self.group_of(len(table) - 1) + 1 if table else 0

    def shortfall(self, request_id: str, num_tokens: int, reserve: int = 0,
                  freeable: tuple[str, ...] = ()) -> int:
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
