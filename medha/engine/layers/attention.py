"""Attention over a paged KV cache, for a batch that mixes prefill chunks and decodes.

The cache of one layer is two tensors [kv_heads, num_blocks * block_size, head_dim] (K, V);
token t of a request lives at slot block_table[t // block_size] * block_size + t % block_size.
KV heads come first so that gathering a request's blocks yields, for each head, its context as
one contiguous [tokens, head_dim] matrix: the layout the attention matmuls read directly.

Every step first writes the batch's new K/V into their slots, then:
- each prefill chunk attends to its request's whole context so far (the cached prefix and,
  causally, itself): SDPA with a lower-right causal mask, or plain `is_causal` for a chunk that
  starts at position 0;
- decodes attend in groups of similar context length: a group's blocks are gathered
  (block-sized copies) into one tensor per head, padded to the group's longest context, and
  the padding is masked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    token_start: int  # rows of this chunk in the flattened batch
    token_end: int
    kv_start: int  # KV offset of its first token
    context_slots: torch.Tensor  # [kv_start + n] cache slots of its whole context


class Workspace:
    """Reusable gather buffers: a fresh multi-megabyte tensor per layer costs more in page
    faults than the copy into it."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        numel = 1
        for s in shape:
            numel *= s
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != like.dtype \
                or buf.device != like.device:
            buf = torch.empty(max(numel, 2 * (buf.numel() if buf is not None else 0)),
                              dtype=like.dtype, device=like.device)
            self._buffers[name] = buf
        return buf[:numel].view(shape)


@dataclass
class DecodeGroup:
    """Decodes of similar context length, attended together with padding to the longest."""

    row_start: int
    row_end: int
    blocks: torch.Tensor  # [decodes * max_blocks] block ids, padded, flattened
    mask: torch.Tensor  # [1, decodes, 1, max_blocks * block_size] True where valid


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [tokens] where each new token's K/V goes
    num_decodes: int  # the first rows of the batch
    decode_groups: list[DecodeGroup]
    block_size: int
    prefills: list[PrefillSpan]
    workspace: Workspace


def _lower_right_causal(n: int, context: int, device) -> torch.Tensor:
    """Query i (at position context - n + i) may see keys 0 .. context - n + i."""
    q = torch.arange(n, device=device)[:, None] + (context - n)
    k = torch.arange(context, device=device)[None, :]
    return k <= q


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      group: DecodeGroup, block_size: int, workspace: Workspace,
                      scale: float) -> torch.Tensor:
    """q: [D, heads, d] -> [D, heads, d], every decode over its own padded context."""
    d_count, heads, dim = q.shape
    kvh = k_cache.shape[0]
    per_kv = heads // kvh
    shape = (kvh, group.blocks.numel(), block_size, dim)
    k = workspace.get("k", shape, k_cache)
    v = workspace.get("v", shape, v_cache)
    for cache, out in ((k_cache, k), (v_cache, v)):
        blocks = cache.view(kvh, -1, block_size, dim)
        for h in range(kvh):  # per head along dim 0: block-sized memcpys
            torch.index_select(blocks[h], 0, group.blocks, out=out[h])
    # [kvh, D, L, d]: each (head, request) context contiguous, no copy beyond the gather
    k, v = k.view(kvh, d_count, -1, dim), v.view(kvh, d_count, -1, dim)
    qg = q.view(d_count, kvh, per_kv, dim).transpose(0, 1)  # [kvh, D, per_kv, d]
    scores = torch.matmul(qg, k.transpose(-1, -2)) * scale  # [kvh, D, per_kv, L]
    scores.masked_fill_(~group.mask, float("-inf"))
    out = torch.matmul(scores.softmax(-1), v)  # [kvh, D, per_kv, d]
    return out.transpose(0, 1).reshape(d_count, heads, dim)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """q: [T, heads, d]; k, v: [T, kv_heads, d]. Returns [T, heads, d]."""
    k_cache.index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
    v_cache.index_copy_(1, meta.slot_mapping, v.transpose(0, 1))
    out = torch.empty_like(q)
    for g in meta.decode_groups:
        out[g.row_start:g.row_end] = _decode_attention(q[g.row_start:g.row_end], k_cache,
                                                       v_cache, g, meta.block_size,
                                                       meta.workspace, scale)
    for span in meta.prefills:
        n = span.token_end - span.token_start
        # contiguous: SDPA's CPU kernels take a pathologically slow path on transposed views
        # when a mask is given
        qp = q[span.token_start:span.token_end].transpose(0, 1).unsqueeze(0).contiguous()
        if span.kv_start == 0:  # the chunk is the whole context so far
            kp = k[span.token_start:span.token_end].transpose(0, 1).unsqueeze(0).contiguous()
            vp = v[span.token_start:span.token_end].transpose(0, 1).unsqueeze(0).contiguous()
            mask, causal = None, True
        else:
            kp = k_cache.index_select(1, span.context_slots).unsqueeze(0)  # [1, kvh, ctx, d]
            vp = v_cache.index_select(1, span.context_slots).unsqueeze(0)
            mask, causal = _lower_right_causal(n, kp.shape[2], q.device), False
        o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, is_causal=causal,
                                           scale=scale, enable_gqa=True)
        out[span.token_start:span.token_end] = o.squeeze(0).transpose(0, 1)
    return out
