"""Analytic predictor: each kernel takes max(compute time, memory time) at sustained rates."""

from __future__ import annotations

import dataclasses
import math
from functools import lru_cache

from medha.perf.hardware_specs import HardwareSpec
from medha.perf.model_specs import ModelSpec
from medha.perf.parallel_config import ParallelConfig
from medha.perf.predictor import Predictor

# The per-layer operations, named as in the Vidur profiles so both predictors share one list.
GEMM_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
ELEMENTWISE_OPS = ("input_layernorm", "attn_rope", "post_attention_layernorm", "mlp_act", "add")
LAYER_OPS = GEMM_OPS + ELEMENTWISE_OPS
TOKEN_OPS = LAYER_OPS + ("emb",)


class RooflinePredictor(Predictor):
    name = "roofline"

    def __init__(self, model: ModelSpec, hardware: HardwareSpec, parallel: ParallelConfig):
        super().__init__(model, hardware, parallel)
        tp = parallel.tp
        # Heads that do not divide evenly are padded: the busiest rank sets the pace.
        self._q_heads = math.ceil(model.num_heads / tp)
        self._kv_heads = math.ceil(model.num_kv_heads / tp)
        self._q = self._q_heads * model.head_dim
        self._kv = self._kv_heads * model.head_dim
        self._inter = math.ceil(model.intermediate_size / tp)
        self._vocab = math.ceil(model.vocab_size / tp)
        self._b = hardware.dtype_bytes
        # A decode's attention is linear in its KV length on both sides of the roofline;
        # precomputing the two lines keeps the per-decode cost at one max().
        hw = hardware
        rows = self._q_heads / self._kv_heads
        eff = hw.attn_eff * rows / (rows + hw.attn_tile_rows)
        layers = model.num_layers
        self._dec_compute = layers * 4.0 * model.head_dim * self._q_heads / (hw.peak_flops * eff)
        self._dec_read = layers * 2 * self._kv * self._b / (hw.mem_bw * hw.mem_eff)
        self._dec_fixed = layers * 2 * self._q * self._b / (hw.mem_bw * hw.mem_eff)
        # With GQA a decode reads more KV bytes than it has FLOPs to spend on them, so its
        # time is the memory line and a group of decodes sums in closed form.
        self._dec_memory_bound = self._dec_read >= self._dec_compute
        # Lookups by batch size repeat constantly during packing; cache them per instance.
        self._token_time = lru_cache(maxsize=1 << 16)(self._token_time_uncached)
        self._seq_time = lru_cache(maxsize=1 << 12)(self._seq_time_uncached)

    def fingerprint(self) -> dict | None:
        cls = type(self)
        return {
            "class": f"{cls.__module__}.{cls.__qualname__}",
            "model": dataclasses.asdict(self.model),
            "hardware": dataclasses.asdict(self.hardware),
            "parallel": dataclasses.asdict(self.parallel),
        }

    # ---- kernels ---------------------------------------------------------------------------
    def _gemm(self, n: int, k: int, m: int) -> float:
        hw, b = self.hardware, self._b
        compute = 2.0 * n * k * m / (hw.peak_flops * hw.gemm_eff)
        memory = (n * k + k * m + n * m) * b / (hw.mem_bw * hw.mem_eff)
        return max(compute, memory) + hw.kernel_overhead_s

    def _stream(self, nbytes: float) -> float:
        hw = self.hardware
        return nbytes / (hw.mem_bw * hw.elementwise_eff) + hw.kernel_overhead_s

    def op_time(self, op: str, n: int) -> float:
        """Seconds of one operation for `n` tokens on one device (per layer, except `emb`)."""
        h, b, q, kv, inter = self.model.hidden_size, self._b, self._q, self._kv, self._inter
        match op:
            case "attn_pre_proj":
                return self._gemm(n, h, q + 2 * kv)
            case "attn_post_proj":
                return self._gemm(n, q, h)
            case "mlp_up_proj":
                return self._gemm(n, h, 2 * inter)  # gate and up fused
            case "mlp_down_proj":
                return self._gemm(n, inter, h)
            case "input_layernorm" | "post_attention_layernorm" | "emb":
                return self._stream(2 * n * h * b)
            case "attn_rope":
                return self._stream(2 * n * (q + kv) * b)
            case "mlp_act":
                return self._stream(3 * n * inter * b)
            case "add":
                return self._stream(3 * n * h * b)
        raise ValueError(f"unknown op {op!r}")

    def all_reduce_time(self, nbytes: float) -> float:
        tp, hw = self.parallel.tp, self.hardware
        if tp == 1:
            return 0.0
        bw, lat = (
            (hw.link_bw, hw.link_latency_s)
            if tp <= hw.devices_per_node
            else (hw.internode_bw, hw.internode_latency_s)
        )
        return 2 * (tp - 1) * lat + 2 * (tp - 1) / tp * nbytes / bw

    def send_recv_time(self, nbytes: float) -> float:
        hw = self.hardware
        inside = self.parallel.tp * self.parallel.spp <= hw.devices_per_node
        bw, lat = (
            (hw.link_bw, hw.link_latency_s) if inside else (hw.internode_bw, hw.internode_latency_s)
        )
        return lat + nbytes / bw

    def _kvp_merge_time(self, n: int, groups: int) -> float:
        """Per layer: broadcast the queries to every group holding KV, gather partial outputs
        with their log-sum-exp, merge. Groups sit on different nodes."""
        if groups == 1:
            return 0.0
        hw = self.hardware
        nbytes = n * self._q * self._b * 2 + n * self._q_heads * 4
        return 2 * hw.internode_latency_s + (groups - 1) * nbytes / hw.internode_bw

    # ---- batch components ---------------------------------------------------------------------
    def _token_time_uncached(self, n: int) -> float:
        m, hw = self.model, self.hardware
        layer = sum(self.op_time(op, n) for op in LAYER_OPS)
        layer += hw.kernel_overhead_s  # the attention kernel's launch; its work is per chunk
        layer += 2 * self.all_reduce_time(n * m.hidden_size * self._b)  # after attention, MLP
        stages = (self.parallel.spp - 1) * self.send_recv_time(
            n * m.hidden_size * self._b / self.parallel.tp
        )
        final_norm = self.op_time("input_layernorm", n)
        return m.num_layers * layer + self.op_time("emb", n) + final_norm + stages

    def _seq_time_uncached(self, s: int) -> float:
        # The LM head runs on the last position of each sequence only.
        logits = self._stream(2 * s * self._vocab * 4)  # fp32 logits: write, then sample
        return self._gemm(s, self.model.hidden_size, self._vocab) + logits

    def linear_time(self, num_tokens: int, num_seqs: int) -> float:
        if num_tokens <= 0:
            return 0.0
        return (
            self._token_time(num_tokens)
            + self._seq_time(num_seqs)
            + self.hardware.iteration_overhead_s
        )

    def _attention_layer(self, n: int, k: int) -> float:
        hw, b, dh = self.hardware, self._b, self.model.head_dim
        flops = 4.0 * n * (k + (n + 1) / 2) * dh * self._q_heads
        nbytes = (2 * n * self._q + 2 * (k + n) * self._kv) * b
        rows = n * self._q_heads / self._kv_heads  # GQA packs a KV head's queries in one tile
        eff = hw.attn_eff * rows / (rows + hw.attn_tile_rows)
        return max(flops / (hw.peak_flops * eff), nbytes / (hw.mem_bw * hw.mem_eff))

    def _split_kv(self, kv_len: int, new_tokens: int) -> tuple[int, int]:
        """(groups holding the request's KV, KV tokens in the busiest group's share).

        Groups fill up to `max_tokens_per_kvp_group` one after another; a context longer than
        all groups together can hold at that size is spread evenly over them."""
        p = self.parallel
        groups = p.kvp_groups(kv_len + new_tokens)
        if groups == 1:
            return 1, kv_len
        return groups, max(min(kv_len, p.max_tokens_per_kvp_group), -(-kv_len // groups))

    def prefill_attention_time(self, num_tokens: int, kv_offset: int) -> float:
        groups, kv = self._split_kv(kv_offset, num_tokens)
        per_layer = self._attention_layer(num_tokens, kv) + self._kvp_merge_time(num_tokens, groups)
        return self.model.num_layers * per_layer

    def decode_attention_total(self, kv_lens: list[int]) -> float:
        if self.parallel.kvp == 1:
            n = len(kv_lens)
            fixed, read = self._dec_fixed, self._dec_read
            if self._dec_memory_bound:
                return n * fixed + read * (sum(kv_lens) + n)
            # decode_attention_time per decode, without a call each (a batch of 256 decodes)
            compute = self._dec_compute
            return sum([max(compute * (k + 1), fixed + read * (k + 1)) for k in kv_lens])
        return super().decode_attention_total(kv_lens)

    def decode_attention_time(self, kv_len: int) -> float:
        if self.parallel.kvp == 1:
            k = kv_len + 1
            return max(self._dec_compute * k, self._dec_fixed + self._dec_read * k)
        groups, kv = self._split_kv(kv_len, 1)
        per_layer = self._attention_layer(1, kv) + self._kvp_merge_time(1, groups)
        return self.model.num_layers * per_layer
