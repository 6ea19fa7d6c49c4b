"""A predictor with fixed costs per token and per iteration, for worked examples and tests."""

from __future__ import annotations

from medha.perf.hardware_specs import HardwareSpec
from medha.perf.model_specs import ModelSpec
from medha.perf.parallel_config import ParallelConfig
from medha.perf.predictor import Predictor

TOY_MODEL = ModelSpec(
    "toy",
    num_layers=1,
    hidden_size=64,
    num_heads=1,
    num_kv_heads=1,
    head_dim=64,
    intermediate_size=128,
    vocab_size=256,
    max_context=1 << 20,
)
TOY_HARDWARE = HardwareSpec(
    "toy",
    peak_flops=1e12,
    mem_bw=1e11,
    mem_bytes=1e9,
    dtype_bytes=2,
    link_bw=1e10,
    link_latency_s=0.0,
    internode_bw=1e9,
    internode_latency_s=0.0,
    devices_per_node=1,
    gemm_eff=1.0,
    attn_eff=1.0,
    attn_tile_rows=1,
    mem_eff=1.0,
    elementwise_eff=1.0,
    kernel_overhead_s=0.0,
    iteration_overhead_s=0.0,
)


class FixedCostPredictor(Predictor):
    """Every token costs `token_s`, every iteration `iteration_s`, and attention is free, so a
    request's work is exactly proportional to its length."""

    name = "fixed-cost"

    def __init__(
        self, token_s: float, iteration_s: float = 0.0, model: ModelSpec = TOY_MODEL
    ) -> None:
        super().__init__(model, TOY_HARDWARE, ParallelConfig())
        self.token_s = token_s
        self.iteration_s = iteration_s

    def linear_time(self, num_tokens: int, num_seqs: int) -> float:
        return self.iteration_s + self.token_s * num_tokens if num_tokens > 0 else 0.0

    def prefill_attention_time(self, num_tokens: int, kv_offset: int) -> float:
        return 0.0

    def decode_attention_time(self, kv_len: int) -> float:
        return 0.0
