"""KV-cache parallelism: a long request's KV is split along the sequence over KVP groups.

The scheduler's KvpBlockManager gives every block to one group (block b lives in group
b // blocks_per_group), filling a request's group 0 up to `max_tokens_per_kvp_group` tokens,
then group 1, and so on. Each group runs the whole model on every step (the linear layers are
replicated), but attends only over the keys it holds: every query yields a partial output and
its log-sum-exp, the groups exchange them (one all-gather per layer), and each merges them
exactly, as online softmax does. A new token's K/V is written by the group that owns its slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class KvParallel:
    rank: int = 0
    size: int = 1
    group: object = None  # the ranks of this stage and TP slot across the KVP groups
    blocks_per_group: int = 0


SINGLE_GROUP = KvParallel()


@dataclass
class _Sequence:
    rows: slice  # query rows in the batch
    query_pos: torch.Tensor  # [n] positions of those queries
    slots: torch.Tensor  # [m] local cache slots of the keys this group holds
    key_pos: torch.Tensor  # [m] their positions


@dataclass
class KvpView:
    """One step as this group sees it: which new tokens it stores, which keys it reads."""

    write_rows: torch.Tensor
    write_slots: torch.Tensor
    sequences: list[_Sequence]
    kvp: KvParallel


def _local(slots: torch.Tensor, kvp: KvParallel, block_size: int) -> torch.Tensor:
    """Mask of the global `slots` held by this group (slots index the global block ids)."""
    return slots // (kvp.blocks_per_group * block_size) == kvp.rank


def build_view(step, kvp: KvParallel, block_size: int) -> KvpView:
    """`step` is a StepInput prepared with one decode per group (each with its context slots)."""
    offset = kvp.rank * kvp.blocks_per_group * block_size
    mine = _local(step.slot_mapping, kvp, block_size)
    rows = mine.nonzero().flatten()
    sequences = []

    def add(rows: slice, query_pos: torch.Tensor, context: torch.Tensor) -> None:
        held = _local(context, kvp, block_size).nonzero().flatten()
        sequences.append(_Sequence(rows, query_pos, context[held] - offset, held))

    for g in step.decode_groups:
        add(slice(g.row_start, g.row_end), torch.tensor([g.slots.numel() - 1]), g.slots)
    for p in step.prefills:
        add(
            slice(p.token_start, p.token_end),
            torch.arange(p.kv_start, p.kv_start + p.token_end - p.token_start),
            p.context_slots,
        )
    return KvpView(rows, step.slot_mapping[rows] - offset, sequences, kvp)


def _partial(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_pos: torch.Tensor,
    key_pos: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [n, heads, d] over keys k, v [kv_heads, m, d] at `key_pos`, causal by
    position: (output [n, heads, d], log-sum-exp [n, heads]); -inf where a query sees no key."""
    n, heads, dim = q.shape
    kvh = k.shape[0]
    per_kv = heads // kvh
    qg = q.view(n, kvh, per_kv, dim).transpose(0, 1).reshape(kvh, n * per_kv, dim)
    scores = torch.matmul(qg, k.transpose(-1, -2)) * scale  # [kvh, n * per_kv, m]
    visible = (key_pos[None, :] <= query_pos[:, None]).repeat_interleave(per_kv, 0)
    scores.masked_fill_(~visible, float("-inf"))
    lse = torch.logsumexp(scores, -1)  # [kvh, n * per_kv]
    finite = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    out = torch.matmul((scores - finite[..., None]).exp_(), v)  # rows seeing nothing: zeros
    out = out.view(kvh, n, per_kv, dim).transpose(0, 1).reshape(n, heads, dim)
    return out, lse.view(kvh, n, per_kv).transpose(0, 1).reshape(n, heads)


def merge(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """outs [groups, T, heads, d], lses [groups, T, heads] -> exact attention [T, heads, d]."""
    m = lses.max(0).values
    w = (lses - m).exp_()
    return (outs * w[..., None]).sum(0) / w.sum(0)[..., None]


def kvp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    view: KvpView,
    scale: float,
) -> torch.Tensor:
    """q: [T, heads, d]; k, v: [T, kv_heads, d] of the batch's new tokens. Returns [T, heads, d]."""
    k_cache.index_copy_(1, view.write_slots, k[view.write_rows].transpose(0, 1))
    v_cache.index_copy_(1, view.write_slots, v[view.write_rows].transpose(0, 1))
    t, heads, dim = q.shape
    out = q.new_zeros(t, heads, dim)
    lse = q.new_full((t, heads), float("-inf"))
    for seq in view.sequences:
        if seq.slots.numel():
            out[seq.rows], lse[seq.rows] = _partial(
                q[seq.rows],
                k_cache.index_select(1, seq.slots),
                v_cache.index_select(1, seq.slots),
                seq.query_pos,
                seq.key_pos,
                scale,
            )
    mine = torch.cat([out.view(t, -1), lse], dim=1)
    parts = [torch.empty_like(mine) for _ in range(view.kvp.size)]
    dist.all_gather(parts, mine, group=view.kvp.group)
    every = torch.stack(parts)
    return merge(every[..., : heads * dim].view(-1, t, heads, dim), every[..., heads * dim :])
