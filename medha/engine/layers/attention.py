"""Attention over a paged KV cache, for a batch that mixes prefill chunks and decodes.

The cache of one layer is one tensor [2 * kv_heads, num_blocks * block_size, head_dim]: the K
heads, then the V heads (K and V are its two halves, `split_cache`); token t of a request lives
at slot block_table[t // block_size] * block_size + t % block_size. Heads come first so that
gathering a request's blocks yields, for each head, its context as one contiguous
[tokens, head_dim] matrix: the layout the attention matmuls read directly. K and V in one
tensor, in the order of the fused q/k/v output's heads, take the step's new K and V in one
copy, and a lone decode gathers both in one.

Every step first writes the batch's new K/V into their slots, then:
- each prefill chunk attends to its request's whole context so far (the cached prefix and,
  causally, itself): plain causal SDPA for a chunk that starts at position 0; after a prefix,
  on CPU, two unmasked flash calls (all of the prefix, then the chunk causally) merged by their
  log-sum-exps, since a masked SDPA takes the CPU's slow math path; elsewhere SDPA with a
  lower-right causal mask;
- decodes attend in groups of similar context length: a group's blocks are gathered
  (block-sized copies) into one tensor per head, padded to the group's longest context, and
  the padding is masked. A decode alone in its group (a lone request) gathers its slots and
  makes one unmasked SDPA call: a third of the small ops, whose fixed cost is what a lone
  decode's attention is made of.

On CUDA (torch's kernels, one KV group) the decodes take another path: all of them in one
Triton kernel that reads each request's blocks in place (layers/triton_decode.py), with no
gather, no padding and no Python loop over groups or heads, and whose inputs are tensors
only, so that a decode step can be captured in a CUDA graph (engine/cuda_graphs.py). A chunk
after a prefix runs the two flash calls merged by log-sum-exp there too (bf16/fp16: CUDA's
flash kernel has no fp32; an fp32 chunk keeps the masked SDPA).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from medha.engine.layers import vllm_kernels
from medha.engine.parallel.kv_parallel import KvpView, kvp_attention


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
        if (
            buf is None
            or buf.numel() < numel
            or buf.dtype != like.dtype
            or buf.device != like.device
        ):
            buf = torch.empty(
                max(numel, 2 * (buf.numel() if buf is not None else 0)),
                dtype=like.dtype,
                device=like.device,
            )
            self._buffers[name] = buf
        return buf[:numel].view(shape)


@dataclass
class DecodeGroup:
    """Decodes of similar context length, attended together with padding to the longest."""

    row_start: int
    row_end: int
    blocks: torch.Tensor  # [decodes * max_blocks] block ids, padded, flattened
    mask: torch.Tensor  # [1, decodes, 1, max_blocks * block_size] True where valid
    slots: torch.Tensor | None = None  # a lone decode's context slots


@dataclass
class DecodePages:
    """The step's decodes for the Triton kernel: rows 0 .. D-1 of the batch."""

    tables: torch.Tensor  # [D, width] int32 block ids, each row padded
    lens: torch.Tensor  # [D] int32 contexts, the new token included
    splits: int  # context shares per decode (triton_decode.splits_for)

    @classmethod
    def of(cls, tables: torch.Tensor, lens: torch.Tensor, kv_heads: int) -> DecodePages:
        from medha.engine.layers.triton_decode import splits_for

        return cls(tables, lens, splits_for(lens.shape[0], kv_heads, lens.device))


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [tokens] where each new token's K/V goes
    decode_groups: list[DecodeGroup]
    block_size: int
    prefills: list[PrefillSpan]
    workspace: Workspace
    kvp: KvpView | None = None  # with KV-cache parallelism: this group's share of the step
    paged: vllm_kernels.PagedAttention | None = None  # with vLLM's kernels: the step's plan
    pages: DecodePages | None = None  # on CUDA: the decodes for the Triton kernel


def _lower_right_causal(n: int, context: int, device) -> torch.Tensor:
    """Query i (at position context - n + i) may see keys 0 .. context - n + i."""
    q = torch.arange(n, device=device)[:, None] + (context - n)
    k = torch.arange(context, device=device)[None, :]
    return k <= q


def _decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: DecodeGroup,
    block_size: int,
    workspace: Workspace,
    scale: float,
) -> torch.Tensor:
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


def split_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's cache as its K and V halves, each [kv_heads, slots, head_dim] (views)."""
    return kv_cache.chunk(2)


def _lone_decode_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor, scale: float
) -> torch.Tensor:
    """q: [1, heads, d] -> [1, heads * d] over the context at `slots`, nothing to mask: K and V
    gathered in one copy, one SDPA call (what a lone decode's attention costs is its calls)."""
    _, heads, dim = q.shape
    kvh = kv_cache.shape[0] // 2
    # [2, 1, kvh, L, d]: K and V, each 4-D as SDPA's fused CPU kernel takes them
    k, v = kv_cache.index_select(1, slots).view(2, 1, kvh, -1, dim).unbind(0)
    qg = q.view(1, kvh, heads // kvh, dim)  # a KV head's query heads as its query rows
    return F.scaled_dot_product_attention(qg, k, v, scale=scale).view(1, heads * dim)


# The flash kernels that also return each query's log-sum-exp (what merging partial
# attentions needs): the CPU one is absent from some builds, CUDA's takes bf16/fp16 only;
# elsewhere a chunk after a prefix takes the masked SDPA path.
_flash_with_lse = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


# Which kernel a chunk after a prefix takes on CUDA (bf16/fp16): flash (the default) or
# cudnn, for A/B runs on a GPU (bench/gpu/engine_device.py, docs/engine.md "CUDA")
PREFIX_KERNEL_ENV = "MEDHA_PREFIX_KERNEL"


def _cudnn_with_lse(q, k, v, dropout_p, is_causal, scale=None):
    """cuDNN's attention with flash's calling convention: (output, log-sum-exp [..., n])."""
    o, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, dropout_p, is_causal, False, scale=scale
    )[:2]
    return o, lse.reshape(o.shape[:-1])


def _flash_for(q: torch.Tensor):
    if q.device.type == "cpu":
        return _flash_with_lse
    if q.device.type == "cuda" and q.dtype in (torch.bfloat16, torch.float16):
        # flash, not cuDNN's kernel by default: cuDNN was 1.8x faster on one shape (a 2,048-token
        # chunk over a 120,832-token prefix, H200: 7.3 ms a layer against 13.0), but it builds
        # a plan for every new shape, and adaptive chunks bring one nearly every step: a 32K
        # prompt alone took 7.3 s in them against 2.3 s by flash
        if os.environ.get(PREFIX_KERNEL_ENV, "flash") == "cudnn":
            return _cudnn_with_lse
        return torch.ops.aten._scaled_dot_product_flash_attention
    return None


def merge_partials(
    o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
) -> torch.Tensor:
    """Exact softmax attention over the union of two disjoint key sets, from each set's output
    [..., n, d] and log-sum-exp [..., n]."""
    m = torch.maximum(lse1, lse2)
    w1, w2 = (lse1 - m).exp_(), (lse2 - m).exp_()
    return (o1 * w1[..., None] + o2 * w2[..., None]) / (w1 + w2)[..., None]


def _prefix_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    span: PrefillSpan,
    scale: float,
    flash,
) -> torch.Tensor:
    """A chunk after a cached prefix, without a mask: the prefix is visible to every query
    (one flash call, GQA groups folded into the query axis so K/V are not repeated) and the
    chunk sees itself causally (a second flash call); the two are merged exactly.
    q: [n, heads, d]; k, v: [n, kv_heads, d] of the chunk itself."""
    n, heads, dim = q.shape
    kvh = k_cache.shape[0]
    per_kv = heads // kvh
    prefix = span.context_slots[: span.kv_start]
    kp = k_cache.index_select(1, prefix).unsqueeze(0)  # [1, kvh, prefix, d]
    vp = v_cache.index_select(1, prefix).unsqueeze(0)
    qg = q.view(n, kvh, per_kv, dim).permute(1, 2, 0, 3).reshape(1, kvh, per_kv * n, dim)
    o1, lse1 = flash(qg, kp, vp, 0.0, False, scale=scale)[:2]
    o1 = o1.reshape(heads, n, dim)
    lse1 = lse1[..., : per_kv * n].reshape(heads, n)
    qh = q.transpose(0, 1).unsqueeze(0).contiguous()  # [1, heads, n, d]
    ks = k.transpose(0, 1).repeat_interleave(per_kv, 0).unsqueeze(0)
    vs = v.transpose(0, 1).repeat_interleave(per_kv, 0).unsqueeze(0)
    o2, lse2 = flash(qh, ks, vs, 0.0, True, scale=scale)[:2]
    return merge_partials(o1.float(), lse1, o2[0].float(), lse2[0, :, :n]).transpose(0, 1)


def paged_attention(
    qkv: torch.Tensor,
    heads: int,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """qkv: [T, heads + 2 kv_heads, d], the step's q, k and v heads (q and k rotated);
    kv_cache: the layer's [2 kv_heads, slots, d]. Returns [T, heads * d]."""
    t, _, dim = qkv.shape
    kvh = kv_cache.shape[0] // 2
    if meta.paged is None and meta.kvp is None:  # K and V of every new token, in one copy
        kv_cache.index_copy_(1, meta.slot_mapping, qkv[:, heads:].transpose(0, 1))
        groups = meta.decode_groups
        if len(groups) == 1 and groups[0].slots is not None and not meta.prefills:
            return _lone_decode_attention(qkv[:, :heads], kv_cache, groups[0].slots, scale)
    q, k, v = qkv.split([heads, kvh, kvh], dim=1)
    k_cache, v_cache = split_cache(kv_cache)
    if meta.kvp is not None:
        return kvp_attention(q, k, v, k_cache, v_cache, meta.kvp, scale).reshape(t, -1)
    if meta.paged is not None:
        return vllm_kernels.paged_attention(
            q, k, v, k_cache, v_cache, meta.slot_mapping, meta.block_size, meta.paged, scale
        ).reshape(t, -1)
    out = q.new_empty(t, heads, dim)
    if meta.pages is not None:
        from medha.engine.layers.triton_decode import paged_decode

        p = meta.pages
        d_count = p.lens.shape[0]
        paged_decode(
            q[:d_count], k_cache, v_cache, p.tables, p.lens, meta.block_size, scale, p.splits,
            out=out[:d_count],
        )  # fmt: skip
    for g in meta.decode_groups:
        if g.slots is not None:
            out[g.row_start : g.row_end] = _lone_decode_attention(
                q[g.row_start : g.row_end], kv_cache, g.slots, scale
            ).view(1, heads, dim)
            continue
        out[g.row_start : g.row_end] = _decode_attention(
            q[g.row_start : g.row_end], k_cache, v_cache, g, meta.block_size, meta.workspace, scale
        )
    for span in meta.prefills:
        rows = slice(span.token_start, span.token_end)
        flash = _flash_for(q) if span.kv_start > 0 else None
        if flash is not None:
            out[rows] = _prefix_attention(
                q[rows], k[rows], v[rows], k_cache, v_cache, span, scale, flash
            )
            continue
        # contiguous: SDPA's CPU kernels take a pathologically slow path on transposed views
        # when a mask is given
        qp = q[rows].transpose(0, 1).unsqueeze(0).contiguous()
        if span.kv_start == 0:  # the chunk is the whole context so far
            kp = k[rows].transpose(0, 1).unsqueeze(0).contiguous()
            vp = v[rows].transpose(0, 1).unsqueeze(0).contiguous()
            mask, causal = None, True
        else:
            kp = k_cache.index_select(1, span.context_slots).unsqueeze(0)  # [1, kvh, ctx, d]
            vp = v_cache.index_select(1, span.context_slots).unsqueeze(0)
            mask = _lower_right_causal(rows.stop - rows.start, kp.shape[2], q.device)
            causal = False
        o = F.scaled_dot_product_attention(
            qp, kp, vp, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
        )
        out[rows] = o.squeeze(0).transpose(0, 1)
    return out.view(t, heads * dim)
