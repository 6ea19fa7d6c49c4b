"""AlignedServe (Bai et al.): decodes batched by similar prefix (KV) length, batch by batch.

A decode's attention reads its whole KV cache, so where the kernel's time follows the batch's
longest context, short decodes batched with a long one wait for it (the iteration-level bubble).
AlignedServe keeps the prefilled requests in a host-memory KV pool, groups them by prefix length
into batches, and runs one batch at a time on the decode device. The mechanisms, as the paper
gives them:

- The pool is a quad-tree over prefix length, [1, 65536] (Section 4.1), each node counting its
  requests and their KV blocks (`LengthQuadTree`).
- Density First Search (Algorithm 1, `_dfs`): top-down from the root, the first node whose
  blocks are at most M_thr (`memory_fraction` of the decode device's blocks, 0.4) and whose
  requests number at least N_thr (`min_batch`, 36) is the batch (case 1); a node over M_thr
  hands the search to its child with the most requests (case 2); a node within M_thr but with
  fewer than N_thr requests goes back to its parent and takes in its siblings, left ones right
  to left (L-Search), then right ones left to right (R-Search), until N_thr (case 3).
- Batch-level scheduling (Algorithm 2, `select_decodes`): the running batch lives on the decode
  device; the Candidate Batch Buffer holds the next generated batch, the Candidate Requests
  Buffer requests that belong with the running batch. After each iteration: if the running
  batch's next tokens do not fit the decode device, the longest request is evicted to the
  requests buffer, during a switch the longest of the old batch (case 3); room is filled from
  the requests buffer (case 1), and when that is empty from the candidate batch (case 2, the
  batch switch); an emptied candidate buffer is refilled by a new search at once (pipelined).
- Dynamic prefetch (Section 3.5): pooled requests whose length lies in the running batch's
  range move to the requests buffer.
- Starvation (Section 3.5): each internal node records when its subtree last generated a batch;
  when the longest-pooled request's subtree has generated none for `starvation_s`, the next
  batch comes from that subtree.
- Transfers: a request entering or leaving the decode device moves its KV over NVLink from or
  to the prefill device's buffers (GPU prefetch), or over PCIe from or to host memory without
  it; the time is added to the iteration (`kv_move_time_s`), as the paper's iteration
  preparation. Prefetches from the pool into the buffers run over PCIe beside decoding and are
  taken as hidden, as the paper's pipelining has them.

Where this differs from the paper's system, and why:
- medha runs one replica, so the pool is not a separate host memory: the replica's KV cache
  stands for decode device + pool (`decode_blocks` of it are the decode device), the pooled
  requests' KV stays in it, and the pool is tracked here, by request id. Prefills run in the
  same replica rather than on prefill devices.
- "Room" for cases 1 and 2 is the decode device's blocks and `running_seqs`; the paper refills
  when requests completed, which is when room appears.
- When the switch starts is read two ways. Section 3.4's case 2 takes the candidate batch as
  soon as requests completed and the requests buffer is empty; Sections 3.2 and 3.3 replace the
  running batch when it is too small to saturate the device, which Algorithm 1 defines as fewer
  than N_thr requests. The second is the default: read literally (`switch_on_room`), the old
  and new batches share nearly every iteration (81% of them on the 95%-short mix, where the
  paper reports at most 12.4%), since a batch's requests finish one by one.
- The paper gives no starvation threshold; the default is its longest reported TTFT without
  the rule (30 s), so that the rule only acts beyond what the paper observed.
- Case 3 takes in the siblings under the node's parent only, the left ones first. The paper
  says to "search bottom-up further" and return to the parent for its left and/or right
  siblings, the batch to span as small a range as possible: `widen` climb does that (siblings
  nearest first, left and right in turn, then up a level while under N_thr). The starvation
  rule reads the stamps over the longest-pooled request; the paper stamps every internal node
  and favours whichever has gone longest without a batch: `starvation_scope` nodes. Both stay
  options on measurement (docs/reproductions.md, AlignedServe).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from medha.core.request import Request, RequestState
from medha.perf.swap_cost import SwapCost
from medha.scheduler.config import SchedulerConfig
from medha.scheduler.length_tree import LengthNode, LengthQuadTree
from medha.scheduler.policies.base_policy import POLICIES
from medha.scheduler.policies.fcfs_policy import FcfsPolicy

if TYPE_CHECKING:
    from medha.perf.predictor import Predictor
    from medha.scheduler.block_manager import BlockManager

# Leaf width of the tree: four KV blocks (the paper does not give its leaf width). Narrower
# leaves split lengths no cost model tells apart, and deepen the tree.
LEAF_BLOCKS = 4
# The prefix lengths the tree covers (Section 4.1); longer ones count as the longest.
PREFIX_RANGE = 65536


@POLICIES.register("aligned")
class AlignedPolicy(FcfsPolicy):
    pauses_steps = False  # (Policy.pauses_steps)
    summary = (
        "AlignedServe: fcfs prefills into a prefix-length pool; decodes run batch by batch "
        "(Density First Search, candidate buffers, batch switch, host-pool transfers)"
    )

    def __init__(self, config: SchedulerConfig | None = None) -> None:
        super().__init__(config)
        settings = self.config.aligned
        self.min_batch = settings.min_batch  # N_thr
        self.starvation_s = settings.starvation_s
        self.prefix_aware = settings.batching == "dfs"
        self.climb = settings.widen == "climb"
        self.every_node = settings.starvation_scope == "nodes"
        self.prefetch = settings.prefetch
        self.switch_on_room = settings.switch_on_room
        self.running_seqs = settings.running_seqs or self.config.max_num_seqs
        self._memory_fraction = settings.memory_fraction
        self._decode_blocks = settings.decode_blocks
        self.tree: LengthQuadTree | None = None
        self.device_blocks = 0  # the decode device's KV blocks
        self.max_blocks = 0  # M_thr
        self.move_cost: SwapCost | None = None
        self.pool_since: dict[str, float] = {}  # pooled request -> when it entered the pool
        self.running: dict[str, Request] = {}
        self.requests_buffer: dict[str, Request] = {}  # Candidate Requests Buffer
        self.batch_buffer: list[Request] = []  # Candidate Batch Buffer
        self.origin: dict[str, int] = {}  # request in running / requests buffer -> its batch
        self.batch_id = 0  # the batch the running batch is (becoming) during a switch
        self._next_id = 1
        self._buffer_id = 0  # id of the batch in the batch buffer
        self.stamps: dict[tuple[int, int], float] = {}  # node -> when it last generated a batch
        self._move_s = 0.0
        self.stats = {
            "iterations": 0,
            "switch_iterations": 0,
            "batches": 0,
            "starved_batches": 0,
            "blocks_in": 0,
            "blocks_out": 0,
            "move_s": 0.0,
        }

    def bind(self, predictor: Predictor, blocks: BlockManager, max_model_len: int) -> None:
        size = blocks.block_size
        self.tree = LengthQuadTree(PREFIX_RANGE, LEAF_BLOCKS * size, size)
        self.device_blocks = min(self._decode_blocks or blocks.num_blocks, blocks.num_blocks)
        self.max_blocks = max(1, int(self._memory_fraction * self.device_blocks))
        hw = predictor.hardware
        # NVLink (the hardware's GPU-to-GPU link) with GPU prefetch; the host link (PCIe) without
        bandwidth = hw.link_bw if self.prefetch else hw.host_link_bw
        self.move_cost = SwapCost(predictor, size, bandwidth / 1e9)

    def kv_move_time_s(self) -> float:
        move, self._move_s = self._move_s, 0.0
        return move

    # ---- Algorithm 2: batch-level scheduling ---------------------------------------------------
    def select_decodes(self, decodes: list[Request], now: float) -> list[Request]:
        if self.tree is None:
            return decodes  # not bound to a scheduler: plain continuous batching
        ready = {r.request_id: r for r in decodes}
        self._sync(decodes, now)
        blocks = self.tree.blocks_for
        need = sum(blocks(r.num_scheduled + 1) for r in self.running.values())
        moved_in = moved_out = 0
        # case 3: the next tokens do not fit the decode device
        while need > self.device_blocks and len(self.running) > 1:
            victim = self._victim()
            need -= blocks(victim.num_scheduled + 1)
            moved_out += blocks(victim.num_scheduled)
            del self.running[victim.request_id]
            self.requests_buffer[victim.request_id] = victim
        # case 1: room filled from the requests buffer
        need, moved = self._admit(list(self.requests_buffer.values()), need)
        moved_in += moved
        for r in list(self.requests_buffer.values()):
            if r.request_id in self.running:
                del self.requests_buffer[r.request_id]
        # case 2: then from the candidate batch (the batch switch), once the running batch is
        # too small to saturate the device (or, read literally, whenever it has room)
        if not self.requests_buffer and (self.switch_on_room or len(self.running) < self.min_batch):
            if not self.batch_buffer:
                self._generate(now)
            need, moved = self._admit(self.batch_buffer, need, self._buffer_id)
            moved_in += moved
            self.batch_buffer = [r for r in self.batch_buffer if r.request_id not in self.running]
            if not self.batch_buffer:
                self._generate(now)  # the next candidate is ready before it is needed
        if self.prefix_aware:
            self._prefetch()
        self._move_s = self.move_cost.time(moved_in) + self.move_cost.time(moved_out)
        stats = self.stats
        stats["blocks_in"] += moved_in
        stats["blocks_out"] += moved_out
        stats["move_s"] += self._move_s
        stats["iterations"] += 1
        if len({self.origin[rid] for rid in self.running}) > 1:
            stats["switch_iterations"] += 1
        return [r for r in self.running.values() if r.request_id in ready]

    def _sync(self, decodes: list[Request], now: float) -> None:
        """Forget requests that left decoding (finished, aborted, preempted by the cache); pool
        the ones new to it (just prefilled, or prefilled again)."""
        gone = [
            rid
            for rid, r in (*self.running.items(), *self.requests_buffer.items())
            if r.state is not RequestState.DECODING
        ]
        for rid in gone:
            self.running.pop(rid, None)
            self.requests_buffer.pop(rid, None)
            self.origin.pop(rid, None)
        self.batch_buffer = [r for r in self.batch_buffer if r.state is RequestState.DECODING]
        for rid in list(self.pool_since):
            if self._pooled(rid).state is not RequestState.DECODING:
                self.tree.remove(rid)
                del self.pool_since[rid]
        held = self.running.keys() | self.requests_buffer.keys()
        held |= {r.request_id for r in self.batch_buffer}
        for r in decodes:
            rid = r.request_id
            if rid not in held and rid not in self.pool_since:
                self.tree.insert(r, r.num_scheduled)
                self.pool_since[rid] = now

    def _pooled(self, rid: str) -> Request:
        return self.tree.request(rid)

    def _admit(self, queue: list[Request], need: int, batch: int | None = None) -> tuple[int, int]:
        """Move requests of `queue`, in order, into the running batch while they fit the decode
        device and `running_seqs` (one always does into an empty batch). Returns the blocks the
        running batch's next tokens need and the blocks moved in."""
        blocks = self.tree.blocks_for
        moved = 0
        for r in queue:
            more = blocks(r.num_scheduled + 1)
            if self.running and (
                len(self.running) >= self.running_seqs or need + more > self.device_blocks
            ):
                break
            self.running[r.request_id] = r
            if batch is not None:
                self.origin[r.request_id] = batch
                self.batch_id = batch
            need += more
            moved += blocks(r.num_scheduled)
        return need, moved

    def _victim(self) -> Request:
        """The longest request, of the old batch while a switch is under way."""
        old = [r for rid, r in self.running.items() if self.origin[rid] != self.batch_id]
        return max(old or self.running.values(), key=lambda r: r.num_scheduled)

    def _prefetch(self) -> None:
        """Pooled requests within the running batch's length range join the requests buffer,
        up to M_thr blocks there."""
        own = [
            r.num_scheduled for rid, r in self.running.items() if self.origin[rid] == self.batch_id
        ]
        if not own or not len(self.tree):
            return
        blocks = self.tree.blocks_for
        held = sum(blocks(r.num_scheduled) for r in self.requests_buffer.values())
        for r in list(self.tree.root.overlapping(min(own), max(own))):
            more = blocks(r.num_scheduled)
            if held + more > self.max_blocks:
                break
            held += more
            self._unpool(r)
            self.requests_buffer[r.request_id] = r
            self.origin[r.request_id] = self.batch_id

    def _unpool(self, r: Request) -> None:
        self.tree.remove(r.request_id)
        del self.pool_since[r.request_id]

    # ---- batch generation ----------------------------------------------------------------------
    def _generate(self, now: float) -> None:
        """Fill the candidate batch buffer from the pool (nothing if the pool is empty)."""
        if not len(self.tree):
            return
        if self.prefix_aware:
            starved = self._starved_path(now)
            target = None
            if starved is not None:  # follow the longest-pooled request of the starved subtree
                target = self._oldest(starved[-1]).num_scheduled
            batch, node = self._dfs(starved or [self.tree.root], target)
            for n in self.tree.path(node.lo):  # it and its ancestors generated a batch
                self.stamps[(n.lo, n.width)] = now
                if n is node:
                    break
            self.stats["starved_batches"] += starved is not None
        else:
            batch = self._first_come()
        for r in batch:
            self._unpool(r)
        self.batch_buffer = batch
        self._buffer_id = self._next_id
        self._next_id += 1
        self.stats["batches"] += 1

    def _dfs(
        self, path: list[LengthNode], target: int | None = None
    ) -> tuple[list[Request], LengthNode]:
        """Algorithm 1 from the last node of `path` (root first): the batch and the node it came
        from. `target`: case 2 descends towards this KV length (a starving subtree's
        longest-pooled request) rather than to the densest child."""
        node = path[-1]
        while True:
            if node.blocks <= self.max_blocks and node.count >= self.min_batch:
                return self._take(node), node  # case 1
            if node.blocks > self.max_blocks:  # case 2
                if not node.children:
                    return self._take(node), node  # a leaf over M_thr: its shortest, up to M_thr
                if target is not None:
                    node = self.tree.path(target)[len(path)]
                else:
                    node = max(node.children, key=lambda c: c.count)
                path.append(node)
                continue
            if len(path) == 1:
                return self._take(node), node  # case 3 at the search's start: nothing wider
            if self.climb:
                return self._climb(path)  # case 3, bottom-up as far as it takes
            return self._widen(path[-2], node), path[-2]  # case 3

    def _take(self, node: LengthNode) -> list[Request]:
        """The node's requests, shortest first, within M_thr and running_seqs (at least one)."""
        batch, held = [], 0
        for r in node.requests():
            held += self.tree.blocks_for(r.num_scheduled)
            if batch and (held > self.max_blocks or len(batch) == self.running_seqs):
                break
            batch.append(r)
        return batch

    def _widen(self, parent: LengthNode, node: LengthNode) -> list[Request]:
        """Case 3: `node` fits but holds fewer than N_thr requests; take in its siblings under
        `parent`, nearest first: L-Search (left ones, right to left), then R-Search (right ones,
        left to right), each stopping at a sibling that does not fit whole or once N_thr is
        reached."""
        batch = list(node.requests())
        held = node.blocks
        i = parent.children.index(node)
        for side in (
            [(c, True) for c in parent.children[i - 1 :: -1]] if i else [],
            [(c, False) for c in parent.children[i + 1 :]],
        ):
            held, _ = self._take_in(batch, held, side)
        batch.sort(key=lambda r: r.num_scheduled)
        return batch[: self.running_seqs]

    def _climb(self, path: list[LengthNode]) -> tuple[list[Request], LengthNode]:
        """Case 3 as the paper writes it ("search bottom-up further"): from the node at the end
        of `path`, take in its siblings nearest first (left and right in turn, left first at
        equal distance: L-Search and R-Search), then its parent's siblings, and so on up to the
        root, until N_thr requests or M_thr blocks; a sibling that does not fit whole gives
        what fits from its end nearest the batch, and the search stops there. Returns the batch
        and the highest node it reached."""
        node = top = path[-1]
        batch, held = list(node.requests()), node.blocks
        for depth in range(len(path) - 2, -1, -1):
            top, child = path[depth], path[depth + 1]
            i, n = top.children.index(child), len(top.children)
            order = [
                (top.children[j], j < i)  # a left sibling: its longest requests are nearest
                for d in range(1, n)
                for j in (i - d, i + d)
                if 0 <= j < n
            ]
            held, full = self._take_in(batch, held, order)
            if full or len(batch) >= self.min_batch:
                break
        batch.sort(key=lambda r: r.num_scheduled)
        return batch[: self.running_seqs], top

    def _take_in(
        self, batch: list[Request], held: int, siblings: list[tuple[LengthNode, bool]]
    ) -> tuple[int, bool]:
        """Add `siblings` ((node, longest first?), nearest first) to `batch` while it holds
        fewer than N_thr: whole while they fit within M_thr, then what fits of the first that
        does not, from its end nearest the batch. Returns the blocks held and whether a
        sibling did not fit whole (M_thr reached)."""
        for sibling, longest_first in siblings:
            if len(batch) >= self.min_batch:
                break
            if not sibling.count:
                continue
            if held + sibling.blocks <= self.max_blocks:
                batch.extend(sibling.requests())
                held += sibling.blocks
                continue
            for r in sibling.requests(longest_first):
                more = self.tree.blocks_for(r.num_scheduled)
                if held + more > self.max_blocks:
                    break
                batch.append(r)
                held += more
            return held, True
        return held, False

    def _first_come(self) -> list[Request]:
        """The ablation without prefix-aware batching: pooled requests in pool order, within
        M_thr and running_seqs."""
        order = sorted(self.pool_since, key=self.pool_since.get)
        batch, held = [], 0
        for rid in order:
            r = self._pooled(rid)
            held += self.tree.blocks_for(r.num_scheduled)
            if batch and (held > self.max_blocks or len(batch) == self.running_seqs):
                break
            batch.append(r)
        return batch

    # ---- starvation ---------------------------------------------------------------------------
    def _oldest(self, node: LengthNode | None = None) -> Request:
        """The longest-pooled request (of `node`'s subtree)."""
        if node is None:
            return self._pooled(min(self.pool_since, key=self.pool_since.get))
        return min(node.requests(), key=lambda r: self.pool_since[r.request_id])

    def _starved_path(self, now: float) -> list[LengthNode] | None:
        """Root to the deepest internal node over the longest-pooled request whose subtree has
        generated no batch for starvation_s (None: no such node); with `starvation_scope`
        nodes, to the internal node of all that has waited longest past it."""
        if self.starvation_s is None or not self.pool_since:
            return None
        if self.every_node:
            return self._starved_node(now)
        oldest = self._oldest()
        since = self.pool_since[oldest.request_id]
        if now - since < self.starvation_s:
            return None
        path = self.tree.path(oldest.num_scheduled)
        for depth in range(len(path) - 2, -1, -1):
            n = path[depth]
            if now - max(self.stamps.get((n.lo, n.width), since), since) >= self.starvation_s:
                return path[: depth + 1]
        return None

    def _starved_node(self, now: float) -> list[LengthNode] | None:
        """Section 3.5 as written: every internal node's time stamp. A node's wait is since its
        subtree last generated a batch, or since its longest-pooled request entered the pool if
        later; the longest wait past starvation_s wins (the deeper node at equal waits)."""
        oldest: dict[int, float] = {}  # id(node) -> its subtree's longest-pooled entry time
        for rid, since in self.pool_since.items():
            for n in self.tree.path(self._pooled(rid).num_scheduled)[:-1]:
                oldest[id(n)] = min(oldest.get(id(n), since), since)
        best, best_key = None, None
        stack = [[self.tree.root]]
        while stack:
            path = stack.pop()
            n = path[-1]
            if id(n) not in oldest:
                continue
            waited = now - max(self.stamps.get((n.lo, n.width), -math.inf), oldest[id(n)])
            if waited >= self.starvation_s and (best_key is None or (waited, len(path)) > best_key):
                best, best_key = path, (waited, len(path))
            stack.extend(path + [c] for c in n.children or () if c.children and c.count)
        return best

    # ---- what the bench reads -----------------------------------------------------------------
    def switch_fraction(self) -> float:
        """Share of decode iterations whose running batch holds requests of two batches."""
        it = self.stats["iterations"]
        return self.stats["switch_iterations"] / it if it else 0.0
