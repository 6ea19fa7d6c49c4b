"""Rotary position embeddings, computed the way transformers computes them (same fp32 ops in
the same order), so that our logits match the reference bit for bit where kernels allow."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from medha.engine.errors import EngineError


def rope_parameters(config: dict) -> tuple[object, dict | None]:
    """(theta, scaling) from either config layout: transformers 5 `rope_parameters`, or
    `rope_theta` + `rope_scaling`; as the config holds them (LlamaArgs checks them)."""
    params = config.get("rope_parameters") or {}
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    scaling = config.get("rope_scaling") or (
        params if params.get("rope_type", "default") not in ("default", None) else None
    )
    return theta, scaling


ROPE_TYPES = ("default", "linear", "llama3")


def rope_type(scaling: dict) -> str:
    return scaling.get("rope_type", scaling.get("type", "default"))


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
    kind = rope_type(scaling)
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise EngineError(
        f"unsupported rope scaling type {kind!r} (supported: {', '.join(ROPE_TYPES)})"
    )


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, head_dim: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        self.register_buffer(
            "inv_freq", inverse_frequencies(head_dim, theta, scaling), persistent=False
        )

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos, sin: [tokens, head_dim]. transformers' formula, kept
    as the reference the tests hold TorchRope to."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return x * cos + _rotate_half(x) * sin


def _signed(sin: torch.Tensor) -> torch.Tensor:
    """sin [tokens, head_dim] with each head's first half negated: rotate_half's sign."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


@dataclass
class TorchRope:
    """One step's rotation on torch's ops, in four kernels for all of q, k and v at once.

    rotate_half(x) = (-x2, x1) is x rolled by half a head with the sign of its first half
    flipped; the sign goes into the sine, so that x * cos + roll(x) * sin' is transformers'
    x * cos + rotate_half(x) * sin, product for product and rounding for rounding in any
    dtype (addcmul would round its sum once, not twice). The tables cover every head of the
    fused q/k/v output, the v heads with cos 1 and sin 0: they pass through unchanged (x * 1
    + y * 0 is x exactly, for finite y), and the three tensors stay one, which the attention
    writes into the KV cache with one copy."""

    tokens: int
    cos: torch.Tensor  # [tokens, heads, head_dim]
    sin: torch.Tensor  # the same, the sign of each head's first half flipped

    @classmethod
    def of(cls, cos: torch.Tensor, sin: torch.Tensor, rotated: int, kept: int) -> TorchRope:
        """cos, sin: [tokens, head_dim] of each token's position; `rotated` heads (q's and
        k's) followed by `kept` heads (v's)."""
        t, dim = cos.shape
        ones = cos.new_ones(1, 1, dim).expand(t, kept, dim)
        signed = _signed(sin)
        return cls(
            t,
            torch.cat((cos[:, None].expand(t, rotated, dim), ones), dim=1),
            torch.cat((signed[:, None].expand(t, rotated, dim), torch.zeros_like(ones)), dim=1),
        )

    def __call__(self, qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int):
        """qkv: [tokens, (heads + 2 kv_heads) * head_dim] -> [tokens, heads + 2 kv_heads,
        head_dim], q and k rotated, a new tensor."""
        x = qkv.view(self.tokens, -1, head_dim)
        return x * self.cos + x.roll(head_dim // 2, -1) * self.sin


@dataclass
class TritonRope:
    """One step's rotation by one Triton kernel a layer, in place on the fused q/k/v output
    (CUDA, torch's kernels: layers/triton_rope.py), TorchRope's arithmetic op for op, over
    tables of one row a token."""

    tokens: int
    cos: torch.Tensor  # [tokens, head_dim]
    sin: torch.Tensor  # the same, the sign of each head's first half flipped

    @classmethod
    def of(cls, cos: torch.Tensor, sin: torch.Tensor) -> TritonRope:
        return cls(cos.shape[0], cos.contiguous(), _signed(sin))

    def __call__(self, qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int):
        """As TorchRope's, in place."""
        from medha.engine.layers.triton_rope import rope_in_place

        rope_in_place(qkv, self.cos, self.sin, heads + kv_heads)
        return qkv.view(self.tokens, -1, head_dim)


@dataclass
class PackedRope:
    """One step's rotation by vLLM's kernel, in place, from the model's table of every
    position's cos and sin (LlamaForCausalLM.use_vllm_kernels)."""

    tokens: int
    positions: torch.Tensor
    cos_sin_cache: torch.Tensor  # [positions, head_dim]: cos of each frequency, then sin

    def __call__(self, qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int):
        """As TorchRope's, in place. q and k stay 2-D for the kernel: it reads rows by their
        stride but heads as contiguous (a 3-D view of the fused q/k/v output rotates wrong)."""
        from medha.engine.layers.vllm_kernels import ops

        q = qkv[:, : heads * head_dim]
        k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim]
        # neox style: the two halves of a head rotate together, as _rotate_half pairs them
        ops().rotary_embedding(self.positions, q, k, head_dim, self.cos_sin_cache, True)
        return qkv.view(self.tokens, -1, head_dim)


Rope = TorchRope | TritonRope | PackedRope
