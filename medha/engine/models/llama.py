"""Llama-family decoder (Llama 2/3, Mistral-style, SmolLM2) over a flattened token batch."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from medha.engine.checkpoint import weight_files
from medha.engine.errors import EngineError
from medha.engine.layers.attention import AttentionMetadata, paged_attention
from medha.engine.layers.norm import RMSNorm
from medha.engine.layers.rotary import PackedRope, Rope, RotaryEmbedding, TorchRope, TritonRope
from medha.engine.models.llama_args import LlamaArgs
from medha.engine.parallel.stage import WHOLE, Stage
from medha.engine.parallel.tensor_parallel import SINGLE, RowParallelLinear, TensorParallel


def gemm_row_padding(rows: int, device: torch.device, exact: bool) -> int:
    """Zero rows to add so that a CPU GEMM's rows come out bitwise as they would in a larger one.

    MKL runs products of fewer than 12 rows that are not a multiple of 4 with other kernels,
    which sum in another order: a prompt prefilled in chunks of 1-3 tokens drifted 1.5e-4 in
    its logits from the whole prefill. Padded to a multiple of 4 the rows are exact (and 2-3
    rows run no slower). A lone decode (one row, `exact` False) stays unpadded: 4 rows cost it
    2-3x in the linears and nothing compares it to a larger batch.
    """
    if device.type != "cpu" or rows >= 12 or rows % 4 == 0 or (rows == 1 and not exact):
        return 0
    return -rows % 4


def packed_row_padding(rows: int) -> int:
    """Zero rows to add so that oneDNN's GEMMs (vLLM's kernels) see few distinct row counts.

    A packed GEMM builds a primitive for each row count it meets (about 0.2 ms each, cached
    per layer): adaptive chunking gives nearly every step a new count, which cost 121 new
    primitives, ~15 ms, in such a step of SmolLM2. Rounded up to 8 sizes per octave (exact
    below 16), the rows repeat, for at most 12.5% more rows (6% on average)."""
    if rows < 16:
        return 0
    step = 1 << (rows.bit_length() - 4)
    return -rows % step


def _pad_rows(x: torch.Tensor, pad: int) -> torch.Tensor:
    return F.pad(x, (0, 0, 0, pad)) if pad else x


def _row_linear(in_local: int, out_features: int, bias: bool, tp: TensorParallel) -> nn.Module:
    # one process: a plain Linear, whose fused bias keeps the outputs bitwise as before
    if tp.size == 1:
        return nn.Linear(in_local, out_features, bias=bias)
    return RowParallelLinear(in_local, out_features, bias, tp)


def linear_add(proj: nn.Module, x: torch.Tensor, residual: torch.Tensor, split: bool):
    """residual + proj(x). A plain Linear without bias adds the residual inside its GEMM (addmm
    accumulates into it, as F.linear adds a bias): one kernel and one pass over the output fewer
    than a GEMM and an add. A row-parallel layer sums across ranks first, then adds; `split`
    (transformers' order, split_projections) rounds the product before adding."""
    if type(proj) is nn.Linear and proj.bias is None and not split:
        return torch.addmm(residual, x, proj.weight.t())
    return residual + proj(x)


def _split_linear(x: torch.Tensor, proj: nn.Linear, sizes: list[int]) -> list[torch.Tensor]:
    """proj(x) as one GEMM per block of `sizes` rows of its weight (views, no copy)."""
    w, b = proj.weight.split(sizes), proj.bias
    return [
        F.linear(x, wi, bi) for wi, bi in zip(w, (None,) * len(w) if b is None else b.split(sizes))
    ]


class LlamaAttention(nn.Module):
    def __init__(self, a: LlamaArgs, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        kv0, kv1 = tp.part(a.num_kv_heads)
        per_kv = a.num_heads // a.num_kv_heads
        self.h, self.kvh, self.d = (kv1 - kv0) * per_kv, kv1 - kv0, a.head_dim
        # q, k and v in one weight and one GEMM (fused as the checkpoint loads): the input is
        # read once, and one launch does the three products
        self.qkv_proj = nn.Linear(
            a.hidden_size, (self.h + 2 * self.kvh) * self.d, bias=a.attention_bias
        )
        self.o_proj = _row_linear(self.h * self.d, a.hidden_size, a.attention_bias, tp)
        self.scale = self.d**-0.5
        self.split = False  # transformers' order of GEMMs and adds (split_projections)

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        if not self.split:
            return self.qkv_proj(x)
        sizes = [self.h * self.d, self.kvh * self.d, self.kvh * self.d]
        return torch.cat(_split_linear(x, self.qkv_proj, sizes), dim=-1)

    def forward(self, x, rope: Rope, kv_cache, meta: AttentionMetadata, residual):
        """residual + attention(x): x may carry padding rows after the step's real tokens."""
        t = rope.tokens
        qkv = self.qkv(x)
        qkv = rope(qkv if qkv.shape[0] == t else qkv[:t], self.h, self.kvh, self.d)
        o = paged_attention(qkv, self.h, kv_cache, meta, self.scale)  # [t, h * d]
        return linear_add(self.o_proj, _pad_rows(o, x.shape[0] - t), residual, self.split)


class LlamaMLP(nn.Module):
    def __init__(self, a: LlamaArgs, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        i0, i1 = tp.part(a.intermediate_size)
        # gate and up in one weight and one GEMM (fused as the checkpoint loads); torch's SiLU
        # and product after it: vLLM's fused silu_and_mul ran 1.5x slower on a 2,048-token
        # chunk on CPU
        self.gate_up_proj = nn.Linear(a.hidden_size, 2 * (i1 - i0), bias=a.mlp_bias)
        self.down_proj = _row_linear(i1 - i0, a.hidden_size, a.mlp_bias, tp)
        self.split = False  # transformers' order of GEMMs and adds (split_projections)

    def forward(self, x, residual):
        if self.split:
            half = self.gate_up_proj.out_features // 2
            gate, up = _split_linear(x, self.gate_up_proj, [half, half])
        else:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return linear_add(self.down_proj, F.silu(gate) * up, residual, self.split)


class LlamaLayer(nn.Module):
    def __init__(self, a: LlamaArgs, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = LlamaAttention(a, tp)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = LlamaMLP(a, tp)

    def forward(self, x, rope, kv_cache, meta, pause: Callable[[], None] | None = None):
        x = self.self_attn(self.input_layernorm(x), rope, kv_cache, meta, x)
        if pause is not None:  # (a paused step: between its attention and its MLP too)
            pause()
        return self.mlp(self.post_attention_layernorm(x), x)


class LlamaForCausalLM(nn.Module):
    """The whole model, or one tensor-parallel shard of one pipeline stage of it."""

    def __init__(self, a: LlamaArgs, tp: TensorParallel = SINGLE, stage: Stage = WHOLE) -> None:
        super().__init__()
        if tp.size > a.num_kv_heads:
            raise EngineError(
                f"tp={tp.size} exceeds the model's {a.num_kv_heads} KV heads: "
                "every rank needs at least one"
            )
        try:
            self.layer_range = stage.layers(a.num_layers)
        except ValueError as e:
            raise EngineError(str(e)) from None
        self.args, self.tp, self.stage = a, tp, stage
        # the first stage embeds the tokens and computes the logits; the last one norms
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size) if stage.first else None
        self.layers = nn.ModuleList(LlamaLayer(a, tp) for _ in self.layer_range)
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps) if stage.last else None
        self.rotary = RotaryEmbedding(a.head_dim, a.rope_theta, a.rope_scaling)
        self.lm_head = (
            None
            if a.tie_word_embeddings or not stage.first
            else nn.Linear(a.hidden_size, a.vocab_size, bias=False)
        )
        self.packed_head = None  # the LM head packed for oneDNN (use_vllm_kernels)
        self.triton_rope = False  # RoPE by one Triton kernel a layer (CUDA's path)
        self.cos_sin_cache = None  # every position's cos | sin, for vLLM's rotary kernel

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        hidden: torch.Tensor | None = None,
        pause: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """The normed final hidden states on the last stage; elsewhere this stage's output,
        the next stage's `hidden` input (the first stage embeds `input_ids` instead).
        `kv_caches`: each layer's K and V heads in one tensor (layers/attention.py).
        `pause`: called after each layer's attention and after each layer but the last (a
        paused step runs other steps there: this one's state is its locals, the KV it wrote
        its own blocks'): config_defaults.pause_points of them a step."""
        x = self.embed_tokens(input_ids) if self.stage.first else hidden
        t = x.shape[0]
        attn = self.layers[0].self_attn if self.layers else None
        if self.cos_sin_cache is not None:  # on vLLM's kernels
            if t:
                self._grow_rope_table(int(positions.max()) + 1)
            rope = PackedRope(t, positions, self.cos_sin_cache)
            x = _pad_rows(x, packed_row_padding(t))
        else:
            cos, sin = self.rotary.cos_sin(positions, x.dtype)
            if attn is None:
                rope = None
            elif self.triton_rope:
                rope = TritonRope.of(cos, sin)
            else:
                rope = TorchRope.of(cos, sin, attn.h + attn.kvh, attn.kvh)
            x = _pad_rows(x, gemm_row_padding(t, x.device, bool(meta.prefills)))
        last = len(self.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            x = layer(x, rope, kv_cache, meta, pause)
            if pause is not None and i < last:
                pause()
        return self.norm(x[:t]) if self.stage.last else x[:t]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        m = hidden.shape[0]
        if self.packed_head is not None:
            return self.packed_head(_pad_rows(hidden, packed_row_padding(m)))[:m].float()
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        pad = gemm_row_padding(m, hidden.device, exact=m > 1)
        return F.linear(_pad_rows(hidden, pad), weight)[:m].float()

    def split_projections(self) -> None:
        """After loading, for bf16/fp16 on a CPU: transformers' order of operations, which the
        bf16 engine's prefill matches logit for logit (tests/test_engine.py): q, k and v as three
        GEMMs and gate and up as two, over views of the fused weights, and the residual added
        after the GEMM's result is rounded. oneDNN's bf16 kernels sum a wider product in
        another order (a 400-token prefill's logits 1.19 off transformers' as one GEMM, 0.0 as
        three, on AMX), and addmm rounds a product and its residual once, not twice."""
        for layer in self.layers:
            layer.self_attn.split = layer.mlp.split = True

    def use_vllm_kernels(self) -> None:
        """After loading: every local linear layer (and the LM head) becomes a oneDNN GEMM on
        prepacked weights, RMSNorm and RoPE vLLM's fused
        kernels (RoPE from a table of cos and sin by position, computed as torch's path
        computes them); attention follows the step's metadata. TP's row-parallel layers stay
        torch's (their sum runs across ranks)."""
        from medha.engine.layers.vllm_kernels import PackedLinear

        self._grow_rope_table(min(8192, self.args.max_position_embeddings))
        for module in list(self.modules()):
            for name, child in list(module.named_children()):
                if type(child) is nn.Linear and child is not self.lm_head:
                    setattr(module, name, PackedLinear(child.weight, child.bias))
                elif isinstance(child, RMSNorm):
                    child.vllm = True
        if self.stage.first:
            head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            self.packed_head = PackedLinear(head, None)

    def _grow_rope_table(self, positions: int) -> None:
        """vLLM's rotary kernel reads cos and sin from a table of positions: it covers the
        largest position seen so far, doubled as steps reach further (a model's own limit, up
        to 2**31 positions, would be gigabytes)."""
        have = 0 if self.cos_sin_cache is None else self.cos_sin_cache.shape[0]
        if positions <= have:
            return
        size = min(max(positions, 2 * have), self.args.max_position_embeddings)
        size = max(size, positions)  # a position past the model's limit still rotates
        dtype = next(self.parameters()).dtype  # the model's (RMSNorm weights stay parameters)
        cos, sin = self.rotary.cos_sin(
            torch.arange(size, device=self.rotary.inv_freq.device), dtype
        )
        half = self.args.head_dim // 2  # the table's halves: cos and sin repeat theirs
        self.cos_sin_cache = torch.cat([cos[:, :half], sin[:, :half]], dim=-1).contiguous()

    # ---- weights -----------------------------------------------------------------------------
    @torch.no_grad()
    def load_checkpoint(self, path: Path, dtype: torch.dtype, device: torch.device) -> None:
        """Load safetensors shard by shard, fusing q/k/v and gate/up as they arrive."""
        from safetensors import safe_open

        params = dict(self.named_parameters())
        pending: dict[str, torch.Tensor] = {}
        loaded: set[str] = set()
        for file in weight_files(path):
            try:
                with safe_open(str(file), framework="pt", device="cpu") as f:
                    for name in f.keys():
                        if self._local_name(name.removeprefix("model.")) is not None:
                            self._place(
                                name, self._read_shard(f, name), params, pending, loaded, file
                            )
            except EngineError:
                raise
            except Exception as e:  # safetensors raises its own error types
                raise EngineError(f"{file}: unreadable safetensors ({e})") from None
        missing = sorted(set(params) - loaded)
        if missing:
            raise EngineError(
                f"{path}: checkpoint lacks {missing[0]}"
                + (f" and {len(missing) - 1} more tensors" if len(missing) > 1 else "")
            )
        self.to(device=device)
        for p in self.parameters():  # buffers (the RoPE frequencies) stay fp32
            p.data = p.data.to(dtype)

    # checkpoint tensors that load as parts of one weight: (the weight, part index, parts)
    _FUSED = {
        "q_proj": ("qkv_proj", 0, 3),
        "k_proj": ("qkv_proj", 1, 3),
        "v_proj": ("qkv_proj", 2, 3),
        "gate_proj": ("gate_up_proj", 0, 2),
        "up_proj": ("gate_up_proj", 1, 2),
    }

    def _local_name(self, name: str) -> str | None:
        """The parameter name in this stage; None for a tensor this rank does not hold
        (another stage's, a tied LM head, RoPE buffers some checkpoints carry)."""
        if "rotary_emb" in name or (name.startswith("lm_head.") and self.lm_head is None):
            return None
        parts = name.split(".")
        if parts[0] == "layers" and len(parts) > 1 and parts[1].isdigit():
            i = int(parts[1])
            if i not in self.layer_range:
                return None
            return ".".join(["layers", str(i - self.layer_range.start), *parts[2:]])
        if (parts[0] == "embed_tokens" and self.embed_tokens is None) or (
            parts[0] == "norm" and self.norm is None
        ):
            return None
        return name

    def _read_shard(self, f, name: str) -> torch.Tensor:
        """Only this rank's slice of a tensor is read from the file."""
        spec = self._shard_spec(name)
        if spec is None:
            return f.get_tensor(name)
        dim, start, end = spec
        piece = f.get_slice(name)
        return piece[start:end] if dim == 0 else piece[:, start:end]

    def _shard_spec(self, name: str) -> tuple[int, int, int] | None:
        """(dim, start, end) of the slice this TP rank keeps, None for a whole tensor."""
        tp, a = self.tp, self.args
        if tp.size == 1:
            return None
        kv0, kv1 = tp.part(a.num_kv_heads)
        per_kv, d = a.num_heads // a.num_kv_heads, a.head_dim
        i0, i1 = tp.part(a.intermediate_size)
        parts = name.split(".")
        module, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", "")
        if module == "q_proj":
            return 0, kv0 * per_kv * d, kv1 * per_kv * d
        if module in ("k_proj", "v_proj"):
            return 0, kv0 * d, kv1 * d
        if module == "o_proj" and kind == "weight":
            return 1, kv0 * per_kv * d, kv1 * per_kv * d
        if module in ("gate_proj", "up_proj"):
            return 0, i0, i1
        if module == "down_proj" and kind == "weight":
            return 1, i0, i1
        return None

    def _place(self, name, tensor, params, pending, loaded, file) -> None:
        name = self._local_name(name.removeprefix("model."))
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in self._FUSED:
            fused, index, count = self._FUSED[parts[-2]]
            target = ".".join(parts[:-2] + [fused, parts[-1]])
            pending[f"{target}#{index}"] = tensor
            keys = [f"{target}#{i}" for i in range(count)]
            if not all(k in pending for k in keys):
                return
            tensor = torch.cat([pending.pop(k) for k in keys], dim=0)
            name = target
        param = params.get(name)
        if param is None:
            raise EngineError(f"{file}: unexpected tensor {name!r} for a Llama model")
        if param.shape != tensor.shape:
            raise EngineError(
                f"{file}: {name} has shape {tuple(tensor.shape)}, the config "
                f"implies {tuple(param.shape)}"
            )
        param.copy_(tensor)
        loaded.add(name)
