"""The paper's machine for deferred prefill: an A100 PCIe at its fixed clocks, and vLLM's CPU
work per iteration, from published numbers only.

The gain of deferring comes from what a prefill iteration costs regardless of its size (the
paper's c_p). A roofline prices the GPU's part of that (kernel launches, the weights read
once); vLLM 0.6.3, the system the paper measured, also spends CPU time on every iteration
(scheduling, building the input tensors, sampling, turning sampled ids into outputs), in series
with the GPU. This module adds that CPU time to any predictor, as measured and published by the
Vidur project for vLLM on an A100, and describes the paper's GPU. Nothing here is fitted to
the paper's results.
"""

from __future__ import annotations

import dataclasses

from medha.perf import HardwareSpec, Predictor, get_hardware
from medha.perf.predictor import WrappedPredictor

# Vidur's published vLLM CPU overheads on an A100 (github.com/microsoft/vidur,
# data/profiling/a100/cpu_overheads.csv, commit 0633efae, MIT licence as
# medha/perf/profiles/LICENSE.vidur): Llama-2-7B (the nearest of its models to an 8B one; the
# CPU work depends on the batch, not the weights) at tp=1. Per batch of n sequences, the means
# in ms of SCHEDULE, SAMPLER_E2E, PREPARE_INPUTS_E2E and PROCESS_MODEL_OUTPUTS: the steps
# Vidur adds to each iteration's GPU time. RAY_COMM_TIME is left out: one GPU uses no Ray.
VIDUR_VLLM_CPU_MS: tuple[tuple[int, float, float, float, float], ...] = (
    (8, 0.16484011, 0.87921048, 0.35205400, 1.58726634),
    (16, 0.28961117, 0.96615892, 0.53065713, 2.96631886),
    (24, 0.39527330, 0.99707686, 0.66173797, 4.08408284),
    (32, 0.51900438, 1.07352960, 0.80672997, 5.40057162),
    (40, 0.60049783, 1.09658937, 0.92757213, 6.59285286),
    (48, 0.69987695, 1.16298071, 1.04849492, 7.75172029),
    (56, 0.77301699, 1.22351280, 1.16626690, 8.20538825),
    (64, 0.85411852, 1.31954225, 1.32310462, 9.06157103),
)


def vllm_cpu_line() -> tuple[float, float]:
    """(fixed s, s per sequence): the least-squares line through Vidur's per-iteration CPU
    time. Measured up to 64 sequences; the paper's batches of 331 and 410 lie beyond, so the
    line is extrapolated there (docs/reproductions.md says what that assumes)."""
    import numpy as np

    n = np.array([r[0] for r in VIDUR_VLLM_CPU_MS], float)
    ms = np.array([sum(r[1:]) for r in VIDUR_VLLM_CPU_MS])
    slope, intercept = np.polyfit(n, ms, 1)
    return float(intercept) * 1e-3, float(slope) * 1e-3


def a100_pcie_paper() -> HardwareSpec:
    """The paper's GPU: an A100 PCIe 80GB with its SM clock held at 1380 MHz and its memory at
    1512 MHz (section 4.1). NVIDIA's datasheet gives the PCIe card 1,935 GB/s at that memory
    clock (medha's `a100` is the SXM card's 2,039 GB/s) and 312 TFLOP/s bf16 at the 1410 MHz
    boost clock, so 1380 MHz gives 312 * 1380 / 1410. The efficiencies are medha's A100 ones."""
    base = get_hardware("a100")
    return dataclasses.replace(
        base,
        name="a100-pcie-1380mhz",
        peak_flops=base.peak_flops * 1380 / 1410,
        mem_bw=1.935e12,
    )


class VllmCpuPredictor(WrappedPredictor):
    """Another predictor's GPU time plus vLLM's CPU time per iteration, fixed_s + per_seq_s
    times the sequences the iteration runs. The inner predictor should carry no iteration
    overhead of its own (see `vllm_predictor`), or it is counted twice.

    `prefill_extra_s` adds a further fixed cost to every iteration that prefills, and only to
    those: it is no measurement but the one knob of the diagnostic run that asks how large the
    paper's fixed prefill cost c_p must have been (bench/paper/sim_deferred_prefill_paper.py). An
    iteration prefills when it holds more tokens than sequences (a decode is one token), which
    misses only prompts of a single token."""

    def __init__(
        self, inner: Predictor, fixed_s: float, per_seq_s: float, prefill_extra_s: float = 0.0
    ) -> None:
        super().__init__(inner)
        self.fixed_s, self.per_seq_s = fixed_s, per_seq_s
        self.prefill_extra_s = prefill_extra_s
        self.name = f"{inner.name}+vllm-cpu"

    def linear_time(self, num_tokens: int, num_seqs: int) -> float:
        if num_tokens <= 0:
            return 0.0
        cpu = self.fixed_s + self.per_seq_s * num_seqs
        if num_tokens > num_seqs:
            cpu += self.prefill_extra_s
        return self.inner.linear_time(num_tokens, num_seqs) + cpu

    def describe(self) -> str:
        extra = (
            f", plus {self.prefill_extra_s * 1e3:g} ms per prefilling iteration (diagnostic)"
            if self.prefill_extra_s
            else ""
        )
        return (
            f"{self.inner.describe()}, plus vLLM's CPU time per iteration "
            f"{self.fixed_s * 1e3:.3f} ms + {self.per_seq_s * 1e3:.4f} ms per sequence "
            f"(Vidur){extra}"
        )


def with_vllm_cpu(predictor: Predictor) -> VllmCpuPredictor:
    """A roofline predictor's model and GPU with vLLM's measured CPU time per iteration in
    place of the roofline's own iteration overhead (other predictors carry an overhead that
    cannot be taken out, so they are refused)."""
    from medha.perf.roofline_predictor import RooflinePredictor

    if type(predictor) is not RooflinePredictor:
        raise ValueError(f"vLLM's CPU time goes on the roofline predictor, not {predictor.name}")
    hw = dataclasses.replace(predictor.hardware, iteration_overhead_s=0.0)
    inner = RooflinePredictor(predictor.model, hw, predictor.parallel)
    return VllmCpuPredictor(inner, *vllm_cpu_line())


def vllm_predictor(
    model: str, hardware: HardwareSpec | None = None, prefill_extra_s: float = 0.0
) -> VllmCpuPredictor:
    """The roofline on the paper's A100 with vLLM's measured CPU time in place of the
    roofline's own 1 ms guess at an iteration's overhead."""
    from medha.perf import ParallelConfig, get_model
    from medha.perf.roofline_predictor import RooflinePredictor

    hw = dataclasses.replace(hardware or a100_pcie_paper(), iteration_overhead_s=0.0)
    inner = RooflinePredictor(get_model(model), hw, ParallelConfig())
    return VllmCpuPredictor(inner, *vllm_cpu_line(), prefill_extra_s=prefill_extra_s)
