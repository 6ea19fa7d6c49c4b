"""RoPE in one Triton kernel, in place on the fused q/k/v output (CUDA, torch's kernels).

TorchRope (rotary.py) rotates in four kernels a layer (a product with the cosines, a roll, a
product with the signed sines, a sum) over tables as wide as all of q, k and v; here one
program takes one token's block of q and k heads, reads each head and its half-rolled twin,
and writes x * cos + roll(x) * sin' back where x was: one launch a layer, and tables of one
row a token. The arithmetic is TorchRope's op for op: each product and the sum rounded to the
activation's dtype in turn, no fused multiply-add (so fp32 gives the torch path's bits).

On CPU it runs only in Triton's interpreter (TRITON_INTERPRET=1), for the tests.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

BLOCK_H = 16  # heads a program


@triton.jit
def _rope_in_place(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    stride_t,
    ROTATED: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, HEAD_DIM)
    rolled = (d + HEAD_DIM // 2) % HEAD_DIM  # roll(x, half)[i] = x[i - half]: the other half
    row = qkv_ptr + t.to(tl.int64) * stride_t + heads[:, None] * HEAD_DIM
    live = (heads < ROTATED)[:, None]
    x = tl.load(row + d[None, :], mask=live, other=0.0)
    xr = tl.load(row + rolled[None, :], mask=live, other=0.0)
    cos = tl.load(cos_ptr + t * HEAD_DIM + d)[None, :]
    sin = tl.load(sin_ptr + t * HEAD_DIM + d)[None, :]
    dtype = x.dtype
    a = (x.to(tl.float32) * cos.to(tl.float32)).to(dtype)
    b = (xr.to(tl.float32) * sin.to(tl.float32)).to(dtype)
    tl.store(row + d[None, :], (a.to(tl.float32) + b.to(tl.float32)).to(dtype), mask=live)


_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def rope_in_place(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotated: int) -> None:
    """qkv: [tokens, heads * head_dim], its first `rotated` heads (q's and k's) rotated in
    place; cos, sin: [tokens, head_dim] contiguous, in qkv's dtype, the sine's first half of
    each head negated (TorchRope's sign)."""
    tokens, width = qkv.shape
    dim = cos.shape[1]
    if dim & (dim - 1):
        raise ValueError(f"the Triton RoPE kernel needs a power-of-two head_dim, not {dim}")
    if qkv.device.type != "cuda" and not _INTERPRETED:
        raise RuntimeError("the Triton RoPE kernel runs on CUDA (or under TRITON_INTERPRET=1)")
    if qkv.stride(1) != 1 or rotated * dim > width:
        raise ValueError("qkv must be [tokens, heads * head_dim] with contiguous rows")
    if not tokens:
        return
    grid = (tokens, triton.cdiv(rotated, BLOCK_H))
    _rope_in_place[grid](
        qkv,
        cos,
        sin,
        qkv.stride(0),
        ROTATED=rotated,
        HEAD_DIM=dim,
        BLOCK_H=BLOCK_H,
        enable_fp_fusion=False,
    )
