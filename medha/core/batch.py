"""What one iteration runs, and what comes back from running it."""

from __future__ import annotations

from dataclasses import dataclass, field

from medha.core.request import Request


@dataclass(slots=True)
class Chunk:
    """`num_tokens` tokens of `request`'s context starting at KV offset `start`.

    `samples` is true when the chunk reaches the end of the context: the model's output at its
    last position becomes the request's next token. Every decode is a one-token sampling chunk.

    With `token_ids` and `block_table` a chunk carries all an engine needs to run it: the
    scheduler sets `block_table` to the request's KV block ids when the batch is formed (the
    block manager's own list, not a copy: it only grows while the request holds it, so a
    decode costs the same at any context length).
    """

    request: Request
    start: int
    num_tokens: int
    samples: bool
    block_table: list[int] | None = None  # None: the executor runs no model (the simulator)

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def token_ids(self) -> list[int]:
        """The tokens this chunk feeds the model, read from the request (their only store)."""
        return self.request.context_token_ids(self.start, self.end)


@dataclass(slots=True)
class KVSwap:
    """One request's KV moved between device and host blocks: block `device_blocks[i]` holds
    the same tokens as `host_blocks[i]` (the request's first len(...) blocks, in order)."""

    request: Request
    device_blocks: list[int]
    host_blocks: list[int]


@dataclass(slots=True)
class Batch:
    batch_id: int
    scheduled_at_s: float
    decodes: list[Chunk] = field(default_factory=list)
    prefills: list[Chunk] = field(default_factory=list)
    predicted_time_s: float = 0.0
    decode_kv_sum: int = 0  # total KV length the decodes attend to
    # Requests whose KV the scheduler dropped while forming this batch (recompute preemption):
    # an engine must forget their cache entries before running it.
    preempted: list[Request] = field(default_factory=list)
    # KV to move before the batch runs, in this order: every swap_in (host -> device), then
    # every swap_out (device -> host). Swap-ins only take device blocks that were free and
    # swap-outs may reuse host blocks that swap-ins emptied, so the order matters; the chunks
    # may write device blocks that swap-outs emptied. A batch may hold swaps and no chunks.
    swap_in: list[KVSwap] = field(default_factory=list)
    swap_out: list[KVSwap] = field(default_factory=list)
    # The prefix cache's host tier: (device block, host block) copies of cached blocks evicted
    # from the device, and (host block, device block) copies of host hits. All copies run in
    # this order: cache_out, swap_in, swap_out, cache_in, so that every read of a device block
    # comes before any write to it (blocks evicted, or freed by a swap-out, may be taken again
    # in the same batch; a swap-in only takes blocks that were free before the batch formed).
    cache_out: list[tuple[int, int]] = field(default_factory=list)
    cache_in: list[tuple[int, int]] = field(default_factory=list)
    swap_time_s: float = 0.0  # predicted time of all the copies, included in predicted_time_s
    # Async scheduling: the next batch was formed while this one ran, counting the tokens this
    # one's sampling chunks produce as placeholders of their requests' contexts (set then, by
    # the request table's `count_placeholders`; False while the batch completes first).
    placeholders: bool = False
    # (pause_steps) Long prefills alone: the executor may pause the batch between two of its
    # layers to run ReplicaScheduler.schedule_beside's batches first, then resume it.
    pausable: bool = False

    @property
    def chunks(self) -> list[Chunk]:
        return self.decodes + self.prefills

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(c.num_tokens for c in self.prefills)

    @property
    def num_seqs(self) -> int:
        return len(self.decodes) + len(self.prefills)

    def __len__(self) -> int:
        return self.num_seqs

    def shape(self) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...]]:
        """What a predictor prices: (num_tokens, kv_offset) of each prefill chunk and the KV
        length each decode attends to."""
        return (
            tuple((c.num_tokens, c.start) for c in self.prefills),
            tuple(c.start for c in self.decodes),
        )

    def describe(self) -> str:
        parts = [f"{len(self.decodes)} decodes"]
        parts += [f"{c.request.request_id}[{c.start}:{c.end}]" for c in self.prefills]
        parts += [f"swap in {s.request.request_id}" for s in self.swap_in]
        parts += [f"swap out {s.request.request_id}" for s in self.swap_out]
        if self.cache_out or self.cache_in:
            parts.append(f"host cache {len(self.cache_out)} out, {len(self.cache_in)} in")
        return f"batch {self.batch_id} ({self.predicted_time_s * 1e3:.1f} ms): " + ", ".join(parts)


@dataclass(slots=True)
class BatchResult:
    """Outcome of running a batch.

    `token_ids` maps request_id to the token sampled for each sampling chunk (an engine fills it;
    a simulator leaves it None). `stopped` names requests whose new token ended them early
    (EOS or a stop string); otherwise a request ends when it reaches max_tokens.
    """

    duration_s: float
    token_ids: dict[str, int] | None = None
    stopped: frozenset[str] = frozenset()
