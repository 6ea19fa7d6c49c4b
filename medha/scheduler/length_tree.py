"""A quad-tree over KV (prefix) lengths: where the decodes are, and how much memory they hold.

AlignedServe batches decodes of similar prefix length. The tree answers the two questions its
batch search asks, without scanning every request: how many requests lie in a length range
(density), and how many KV blocks they hold (the memory a batch of them needs). The root covers
[0, leaf_tokens * 4**depth); every node splits its range into four equal children, so siblings
have equal widths and comparing their request counts compares densities.
"""

from __future__ import annotations

from collections.abc import Iterator

from medha.core.request import Request


class LengthNode:
    __slots__ = ("lo", "width", "count", "blocks", "children", "members")

    def __init__(self, lo: int, width: int) -> None:
        self.lo, self.width = lo, width
        self.count = 0  # requests in this subtree
        self.blocks = 0  # KV blocks they hold
        self.children: list[LengthNode] | None = None  # created on first insert below
        self.members: dict[str, Request] | None = None  # leaves only

    def requests(self, longest_first: bool = False) -> Iterator[Request]:
        """Every request of the subtree, shortest range first (or longest first)."""
        if self.members is not None:
            yield from self.members.values()
        elif self.children:
            for child in reversed(self.children) if longest_first else self.children:
                if child.count:
                    yield from child.requests(longest_first)

    def overlapping(self, lo: int, hi: int) -> Iterator[Request]:
        """The subtree's requests in leaves whose ranges meet [lo, hi]."""
        if not self.count or hi < self.lo or lo >= self.lo + self.width:
            return
        if self.members is not None:
            yield from self.members.values()
        elif self.children:
            for child in self.children:
                yield from child.overlapping(lo, hi)


class LengthQuadTree:
    def __init__(self, max_len: int, leaf_tokens: int = 64, block_size: int = 16) -> None:
        width = leaf_tokens
        while width < max_len:
            width *= 4
        self.root = LengthNode(0, width)
        self.leaf_tokens = leaf_tokens
        self.block_size = block_size
        self._where: dict[str, tuple[LengthNode, int, int]] = {}  # rid -> (leaf, len, blocks)

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._where

    def request(self, request_id: str) -> Request:
        return self._where[request_id][0].members[request_id]

    def ids(self):
        return self._where.keys()

    def blocks_for(self, kv_len: int) -> int:
        """Blocks a decode over `kv_len` cached tokens holds (its KV; the block its new token
        may need is the scheduler's to find, which is why every ready decode fits together)."""
        return -(-kv_len // self.block_size)

    def path(self, kv_len: int) -> list[LengthNode]:
        """Root-to-leaf nodes covering `kv_len`, created as needed."""
        node, nodes = self.root, [self.root]
        kv_len = min(kv_len, self.root.width - 1)  # a longer context shares the last leaf
        while node.width > self.leaf_tokens:
            if node.children is None:
                w = node.width // 4
                node.children = [LengthNode(node.lo + i * w, w) for i in range(4)]
            node = node.children[(kv_len - node.lo) * 4 // node.width]
            nodes.append(node)
        if node.members is None:
            node.members = {}
        return nodes

    def _add(self, nodes: list[LengthNode], count: int, blocks: int) -> None:
        for node in nodes:
            node.count += count
            node.blocks += blocks

    def insert(self, r: Request, kv_len: int) -> None:
        """Place `r` at `kv_len`, or move it there if it is already in the tree."""
        old = self._where.get(r.request_id)
        blocks = self.blocks_for(kv_len)
        if old is not None:
            leaf, _, old_blocks = old
            if kv_len - leaf.lo in range(leaf.width) and blocks == old_blocks:
                self._where[r.request_id] = (leaf, kv_len, blocks)  # counts unchanged
                return
            self.remove(r.request_id)
        nodes = self.path(kv_len)
        self._add(nodes, 1, blocks)
        nodes[-1].members[r.request_id] = r
        self._where[r.request_id] = (nodes[-1], kv_len, blocks)

    def remove(self, request_id: str) -> None:
        leaf, kv_len, blocks = self._where.pop(request_id)
        self._add(self.path(kv_len), -1, -blocks)
        del leaf.members[request_id]
