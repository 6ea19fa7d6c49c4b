"""AlignedServe (Bai et al., 2026): decode batches of similar prefix (KV) length.

A decode's attention reads its whole KV cache, so in one iteration a token over a long context
costs more than one over a short context; a kernel that pads a batch to its longest context, or
hands each sequence to one unit of the device, waits for the longest one. Batching decodes of
similar length removes that iteration-level bubble. Only the paper's abstract was within reach;
the search below is our reading of the issue's description:

- Ready decodes live in a quad-tree over KV length (`LengthQuadTree`) whose nodes count requests
  and KV blocks.
- Density first: from the root, follow the child holding the most requests (siblings have equal
  widths, so most requests = densest) while it still holds `aligned_min_batch` of them. That
  node is the dense core. The batch then grows to the enclosing ranges while the enclosing range
  fits the memory threshold and max_num_seqs and the predictor says that one iteration of the
  whole range costs no more than one of the core plus one of the rest: together they share one
  read of the weights; apart, where attention pads to the longest context, the core's short
  contexts are not padded to the rest's long ones. The cost model decides, not a fixed bonus
  (under the plain roofline, attention is a sum of each decode's own reads, so together always
  wins and the policy batches every ready decode, as fcfs does).
- Starvation: a ready decode that has waited `aligned_starvation_s` for its next token promotes
  its range (the smallest enclosing node with `aligned_min_batch` requests) ahead of density.
- Batch-level scheduling: a batch runs `aligned_batch_iterations` iterations; the candidate that
  follows it is prepared when it starts, from the other decodes (in AlignedServe that is when
  the candidate's KV is fetched to the GPU), so batches of different lengths take turns.

Prefills are first come, first served and join whatever iteration runs, as under fcfs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from medha.core.config import SchedulerConfig
from medha.core.request import Request
from medha.scheduler.length_tree import LengthNode, LengthQuadTree
from medha.scheduler.policies.base_policy import POLICIES
from medha.scheduler.policies.fcfs_policy import FcfsPolicy

if TYPE_CHECKING:
    from medha.perf.predictor import Predictor
    from medha.scheduler.block_manager import BlockManager

# Leaf width of the tree: four KV blocks. Narrower leaves only split clusters the cost model
# cannot tell apart (a few blocks of difference), and make the tree deeper.
LEAF_BLOCKS = 4


@POLICIES.register("aligned")
class AlignedPolicy(FcfsPolicy):
    summary = (
        "AlignedServe: fcfs prefills; decodes batched by similar prefix length "
        "(quad-tree, density first, starvation promotion)"
    )

    def __init__(self, config: SchedulerConfig | None = None) -> None:
        super().__init__(config)
        config = self.config
        settings = config.aligned
        self.min_batch = settings.min_batch
        self.batch_iterations = settings.batch_iterations
        target = config.tpot_target_s or 0.05
        self.starvation_s = settings.starvation_s or 4 * target
        self.max_seqs = config.max_num_seqs
        self._memory_fraction = settings.memory_fraction
        self.predictor: Predictor | None = None
        self.tree: LengthQuadTree | None = None
        self.max_blocks = 0
        self.current: list[Request] = []
        self.candidate: list[Request] = []
        self._turns_left = 0

    def bind(self, predictor: Predictor, blocks: BlockManager, max_model_len: int) -> None:
        self.predictor = predictor
        self.tree = LengthQuadTree(
            max_model_len, LEAF_BLOCKS * blocks.block_size, blocks.block_size
        )
        self.max_blocks = max(1, int(self._memory_fraction * blocks.num_blocks))

    # ---- batch-level scheduling --------------------------------------------------------------
    def select_decodes(self, decodes: list[Request], now: float) -> list[Request]:
        if self.tree is None:
            return decodes  # not bound to a scheduler: plain continuous batching
        self._sync(decodes)
        tree = self.tree
        batch = [r for r in self.current if r.request_id in tree] if self._turns_left else []
        if not batch:
            batch = [r for r in self.candidate if r.request_id in tree] or self.search(now)
            self.current = batch
            self._turns_left = self.batch_iterations
            self.candidate = self.search(now, exclude=batch)
        self._turns_left -= 1
        return batch

    def _sync(self, decodes: list[Request]) -> None:
        """Make the tree hold exactly the ready decodes, each at its current KV length."""
        tree = self.tree
        ready = {r.request_id for r in decodes}
        for rid in [rid for rid in tree.ids() if rid not in ready]:
            tree.remove(rid)  # finished, aborted, preempted or in a running batch
        for r in decodes:
            tree.insert(r, r.num_scheduled)

    # ---- the search --------------------------------------------------------------------------
    def search(self, now: float, exclude: list[Request] = ()) -> list[Request]:
        """The next batch among the ready decodes not in `exclude` (empty if there are none)."""
        tree = self.tree
        for r in exclude:
            tree.remove(r.request_id)
        try:
            if not len(tree):
                return []
            path = self._starved_path(now) or self._dense_path()
            return self._take(self._grow(path))
        finally:
            for r in exclude:
                tree.insert(r, r.num_scheduled)

    def _dense_path(self) -> list[LengthNode]:
        """Root to the dense core: the densest child while it holds min_batch requests."""
        path = [self.tree.root]
        while path[-1].children:
            best = max(path[-1].children, key=lambda c: c.count)
            if best.count < self.min_batch:
                break
            path.append(best)
        return path

    def _starved_path(self, now: float) -> list[LengthNode] | None:
        """Root to the smallest range with min_batch requests around the longest-waiting decode,
        if it has waited past the starvation limit."""
        oldest = min(self.tree.root.requests(), key=_last_served)
        if now - _last_served(oldest) < self.starvation_s:
            return None
        path = self.tree.path(oldest.num_scheduled)
        while len(path) > 1 and path[-1].count < self.min_batch:
            path.pop()
        return path

    def _grow(self, path: list[LengthNode]) -> LengthNode:
        """Widen the batch to enclosing ranges while they fit and are cheaper served together."""
        node = path.pop()
        while path and self._fits(path[-1]) and self._together_pays(node, path[-1]):
            node = path.pop()
        return node

    def _fits(self, node: LengthNode) -> bool:
        return node.blocks <= self.max_blocks and node.count <= self.max_seqs

    def _together_pays(self, node: LengthNode, parent: LengthNode) -> bool:
        """One iteration of the parent's decodes costs no more than one of the node's plus one
        of the parent's others."""
        mine = [r.num_scheduled for r in node.requests()]
        rest = [r.num_scheduled for r in parent.requests() if not _within(r, node)]
        if not rest:
            return True
        time = self.predictor.shape_time
        return time((), mine + rest) <= time((), mine) + time((), rest)

    def _take(self, node: LengthNode) -> list[Request]:
        """The node's requests, shortest first, within the memory threshold and max_num_seqs
        (a dense core can exceed them on its own; at least one request always runs)."""
        batch, blocks = [], 0
        for r in node.requests():
            blocks += self.tree.blocks_for(r.num_scheduled)
            if batch and (blocks > self.max_blocks or len(batch) == self.max_seqs):
                break
            batch.append(r)
        return batch


def _within(r: Request, node: LengthNode) -> bool:
    return node.lo <= r.num_scheduled < node.lo + node.width


def _last_served(r: Request) -> float:
    """When the request last received a token (its first one comes from its prefill)."""
    return r.token_times_s[-1] if r.token_times_s else r.arrival_s
