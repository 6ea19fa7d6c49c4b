"""Paged decode attention in two Triton kernels: each decode's query heads read their request's
K/V blocks where they lie in the cache, through its block table, with no gather and no padding
to the batch's longest context; a second kernel merges the shares of each context.

The cache layout is the torch path's (layers/attention.py): per layer K and V (the halves of
one tensor) of [kv_heads, slots, head_dim], token t of a request at slot
block_table[t // block_size] * block_size + t % block_size. One program takes one (decode, KV
head, split): the KV head's query heads (a GQA group, padded to 16 rows for the matrix unit)
against one contiguous share of the context, with an online softmax over tiles of BLOCK_N
tokens. A context is split into `splits` shares so that a few long decodes still occupy every
multiprocessor; the merge weighs the shares' outputs by their log-sum-exps (an exact softmax
over the union, as merge_partials does on CPU) and writes the result where the caller wants it,
in its dtype: two launches a layer whatever the batch. Every shape it reads is a tensor, not a
Python number: a CUDA graph captured for a batch size replays for any contexts up to the
tables' width.

On CUDA the kernel is compiled. On CPU it runs only in Triton's interpreter, in a process
started with TRITON_INTERPRET=1 (read when this module is imported): that is how the tests
check it against the torch path in float32, on any machine (slow: tests only).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

BLOCK_N = 64  # context tokens per tile


def _paged_decode(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    lens_ptr,
    out_ptr,
    lse_ptr,
    scale,
    stride_qb,
    stride_qh,
    stride_kh,
    stride_ks,
    stride_tb,
    splits,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    IEEE: tl.constexpr,
):
    b = tl.program_id(0)
    kv = tl.program_id(1)
    s = tl.program_id(2)
    heads_total = tl.num_programs(1) * GROUP
    seq_len = tl.load(lens_ptr + b)
    per_split = tl.cdiv(tl.cdiv(seq_len, splits), BLOCK_N) * BLOCK_N
    lo = s * per_split
    hi = tl.minimum(lo + per_split, seq_len)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, HEAD_DIM)
    n = tl.arange(0, BLOCK_N)
    heads = kv * GROUP + g
    in_group = g < GROUP
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=in_group[:, None],
        other=0.0,
    )
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    k_base = k_ptr + kv.to(tl.int64) * stride_kh  # a large cache passes 2**31 elements
    v_base = v_ptr + kv.to(tl.int64) * stride_kh
    for start in range(lo, hi, BLOCK_N):
        t = start + n
        valid = t < hi
        block = tl.load(tables_ptr + b * stride_tb + t // PAGE, mask=valid, other=0)
        slot = block.to(tl.int64) * PAGE + t % PAGE
        offsets = slot[:, None] * stride_ks + d[None, :]
        k = tl.load(k_base + offsets, mask=valid[:, None], other=0.0)
        if IEEE:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        qk = tl.where(valid[None, :], qk * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(qk, 1))
        p = tl.exp(qk - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l_sum = l_sum * alpha + tl.sum(p, 1)
        v = tl.load(v_base + offsets, mask=valid[:, None], other=0.0)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m = m_new
    # an empty share (a context shorter than the splits) leaves l_sum 0: output 0, weight 0
    filled = l_sum > 0
    out = acc / tl.where(filled, l_sum, 1.0)[:, None]
    row = (b * heads_total + heads) * splits + s  # [B, H, splits] row-major
    tl.store(out_ptr + row[:, None] * HEAD_DIM + d[None, :], out, mask=in_group[:, None])
    lse = tl.where(filled, m + tl.log(tl.where(filled, l_sum, 1.0)), float("-inf"))
    tl.store(lse_ptr + row, lse, mask=in_group)


def _merge_shares(
    part_ptr,
    lse_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    splits,
    BLOCK_S: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """One program a (decode, head): its shares' outputs weighted by softmax(lse) (an empty
    share's -inf weighs 0), written in the output's dtype where the output lies."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = b * tl.num_programs(1) + h
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, HEAD_DIM)
    lse = tl.load(lse_ptr + row * splits + s, mask=s < splits, other=float("-inf"))
    w = tl.exp(lse - tl.max(lse, 0))
    w = w / tl.sum(w, 0)
    part = tl.load(
        part_ptr + (row * splits + s)[:, None] * HEAD_DIM + d[None, :],
        mask=(s < splits)[:, None],
        other=0.0,
    )
    out = tl.sum(part * w[:, None], 0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))


# the split count and the table's width are plain arguments, not compile-time ones: an eager
# step's decode count (hence its splits) and widest table vary step by step, and each new
# constant would compile the kernel again (0.3-1 s on an H200, which the first engine of a
# process paid within its first requests' latency)
_kernel = triton.jit(_paged_decode, do_not_specialize=["stride_tb", "splits"])
_merge = triton.jit(_merge_shares, do_not_specialize=["splits"])
MAX_SPLITS = 16  # splits_for's most (the merge's tile of shares)
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def splits_for(decodes: int, kv_heads: int, device: torch.device) -> int:
    """Context shares per decode: enough programs for two per multiprocessor, at most 16."""
    if device.type != "cuda":
        return 2  # the interpreter: still exercises the merge
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(MAX_SPLITS, -(-2 * sms // max(1, decodes * kv_heads))))


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    block_size: int,
    scale: float,
    splits: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [D, heads, d], one row per decode, each head's d contiguous (a view of the fused
    q/k/v output will do: the kernel follows its strides); tables [D, width] int32 block ids;
    lens [D] int32, each decode's context including its new token (already written to the
    cache). Returns [D, heads, d] in q's dtype: `out` if given (any strides, d contiguous),
    written by the second kernel, which merges the shares."""
    count, heads, dim = q.shape
    kvh = k_cache.shape[0]
    if dim & (dim - 1) or dim < 16:
        raise ValueError(f"the Triton decode kernel needs a power-of-two head_dim >= 16, not {dim}")
    if q.device.type != "cuda" and not _INTERPRETED:
        raise RuntimeError("the Triton decode kernel runs on CUDA (or under TRITON_INTERPRET=1)")
    if q.stride(2) != 1:
        q = q.contiguous()
    part = torch.empty(count, heads, splits, dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(count, heads, splits, dtype=torch.float32, device=q.device)
    group = heads // kvh
    _kernel[(count, kvh, splits)](
        q,
        k_cache,
        v_cache,
        tables,
        lens,
        part,
        lse,
        scale,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        tables.stride(0),
        splits,
        GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=dim,
        BLOCK_N=BLOCK_N,
        PAGE=block_size,
        IEEE=q.dtype == torch.float32,
    )
    if out is None:
        out = torch.empty(count, heads, dim, dtype=q.dtype, device=q.device)
    _merge[(count, heads)](
        part,
        lse,
        out,
        out.stride(0),
        out.stride(1),
        splits,
        BLOCK_S=max(2, triton.next_power_of_2(MAX_SPLITS if splits <= MAX_SPLITS else splits)),
        HEAD_DIM=dim,
    )
    return out
