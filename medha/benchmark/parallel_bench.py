"""What bench/paper/sim_parallel_figures.py's figures stand on: `Bench` (predictors built with the
run's one-change settings, a prefill alone on the simulator, a lone decode's time, the models and
predictors each figure used), the predictor wrappers of the one-change runs (`StageOverhead`,
`KvpMerge`), the KVP layout of the paper's Fig. 6 (`kvp_layout`), and the cells' formats.
"""

from __future__ import annotations

import dataclasses

from medha.core.request import Request
from medha.perf import ParallelConfig, Predictor, make_predictor
from medha.perf.hardware_specs import get_hardware
from medha.perf.predictor import WrappedPredictor
from medha.scheduler.config import SchedulerConfig
from medha.sim.metrics.summary import utilization
from medha.sim.simulator import ClusterConfig, Simulator, kv_blocks_per_replica

M = 1_000_000
INFEASIBLE = "x (memory)"  # the paper's red crosses: weights + KV exceed device memory


class StageOverhead(WrappedPredictor):
    """`inner`, with every pipeline stage paying the per-iteration host overhead for every batch
    (the roofline charges it once per batch, as if one host loop drove all stages). A batch's
    time through all stages grows by (spp - 1) x the overhead, so each stage time becomes
    (t - overhead) / spp + overhead."""

    def __init__(self, inner: Predictor) -> None:
        super().__init__(inner)
        self.name = f"{inner.name}+stage-overhead"
        self._extra = (inner.parallel.spp - 1) * inner.hardware.iteration_overhead_s

    def linear_time(self, num_tokens: int, num_seqs: int) -> float:
        t = self.inner.linear_time(num_tokens, num_seqs)
        return t + self._extra if t > 0 else t


class KvpMerge(WrappedPredictor):
    """`inner`, with every layer's KVP merge costing `extra_s` more wherever the request's KV
    spans several groups (the one-change run on the merge's cost)."""

    def __init__(self, inner: Predictor, extra_s: float) -> None:
        super().__init__(inner)
        self.name = f"{inner.name}+kvp-merge-{extra_s * 1e6:g}us"
        self._extra = inner.model.num_layers * extra_s

    def _merge(self, kv_len: int, new: int) -> float:
        return self._extra if self.parallel.kvp_groups(kv_len + new) > 1 else 0.0

    def prefill_attention_time(self, num_tokens: int, kv_offset: int) -> float:
        t = self.inner.prefill_attention_time(num_tokens, kv_offset)
        return t + self._merge(kv_offset, num_tokens)

    def decode_attention_time(self, kv_len: int) -> float:
        return self.inner.decode_attention_time(kv_len) + self._merge(kv_len, 1)

    def decode_attention_total(self, kv_lens: list[int]) -> float:
        # the decodes of a batch merge together: one exchange per layer for all of them
        extra = max((self._merge(k, 1) for k in kv_lens), default=0.0)
        return self.inner.decode_attention_total(kv_lens) + extra


class Bench:
    """One run's settings (predictor, --quick, the prefill figures' iteration budget, the
    one-change runs'), with what the figures share: predictors built with them, memoized
    prefills, and per figure the predictor each model was timed with."""

    def __init__(
        self,
        predictor: str,
        quick: bool,
        budget_s: float = 0.05,
        hardware_set: dict | None = None,
        kvp_merge_s: float = 0.0,
    ) -> None:
        self.predictor = predictor
        self.quick = quick
        self.budget_s = budget_s  # Medha's iteration budget in the prefill figures
        self.hardware_set = hardware_set or {}  # spec fields replaced (one-change runs)
        self.kvp_merge_s = kvp_merge_s
        self._prefills: dict[tuple, tuple[float, float] | None] = {}
        self.used: dict[str, dict[str, str]] = {}  # per figure: model -> predictor

    # ---- building blocks ---------------------------------------------------------------------
    def make(
        self, model: str, hardware: str, parallel: ParallelConfig, stage_overhead: bool = False
    ) -> Predictor:
        hw = dataclasses.replace(get_hardware(hardware), **self.hardware_set)
        p = make_predictor(self.predictor, model, hw, parallel)
        if self.kvp_merge_s:
            p = KvpMerge(p, self.kvp_merge_s)
        return StageOverhead(p) if stage_overhead else p

    def note(self, figure: str, p: Predictor) -> None:
        inner = p
        while isinstance(inner, WrappedPredictor):
            inner = inner.inner
        parts = getattr(inner, "fitted_components", None)
        fitted = [k for k, v in parts().items() if v.startswith("fitted")] if parts else []
        changed = ", ".join(f"{k}={v:g}" for k, v in self.hardware_set.items())
        what = (
            f"{inner.name} on {inner.hardware.name}"
            + (f" ({changed})" if changed else "")
            + (f" (fitted: {', '.join(fitted)}; the rest roofline)" if fitted else "")
        )
        self.used.setdefault(figure, {}).setdefault(inner.model.name, what)

    def capacity(self, model: str, hardware: str, parallel: ParallelConfig) -> int:
        """KV tokens a replica holds (kvp groups together); 0 when the weights do not fit."""
        p = make_predictor("roofline", model, hardware, parallel)
        try:
            return kv_blocks_per_replica(ClusterConfig(hardware=hardware), p).capacity_tokens
        except ValueError:
            return 0

    def prefill(
        self,
        model: str,
        length: int,
        parallel: ParallelConfig,
        stage_overhead: bool = False,
        figure: str = "",
    ) -> tuple[float, float] | None:
        """(TTFT, MFU) of one prefill alone on H100 under Medha's default scheduler; None when
        weights and KV do not fit (memoized: figures 15 and 17b share runs)."""
        key = (model, length, parallel, stage_overhead)
        if key not in self._prefills:
            self._prefills[key] = self._prefill(model, length, parallel, stage_overhead, figure)
        return self._prefills[key]

    def _prefill(self, model, length, parallel, stage_overhead, figure):
        if self.capacity(model, "h100", parallel) < length + 1:
            return None
        p = self.make(model, "h100", parallel, stage_overhead)
        self.note(figure, p)
        sim = Simulator(
            ClusterConfig(model=model, hardware="h100"),
            parallel,
            SchedulerConfig(
                iteration_budget_s=self.budget_s, max_model_len=max(length + 16, 1 << 20)
            ),
            predictor=p,
        )
        r = Request("long", 0.0, length, 1)
        res = sim.run([r])
        hw = p.hardware
        u = utilization(
            res.log,
            p.model,
            hw.dtype_bytes,
            r.ttft_s,
            parallel.world_size,
            1,
            parallel.spp,
            hw.peak_flops,
            hw.mem_bw,
        )
        return r.ttft_s, u["mfu"]

    def decode_s(self, p: Predictor, context: int) -> float:
        """Time of a decode-only batch of one request at `context` tokens, all stages."""
        return p.shape_time((), [context])


def kvp_layout(tp: int, spp: int, kvp: int, context: int) -> ParallelConfig:
    """KVP groups of context / kvp tokens each, joining one after another as the KV grows: the
    paper's Fig. 6 (2M tokens over KVP4: one group to start with, four at the end). An even
    split is also where the block manager's placement (each group but the last holds a share,
    the last the rest) and the predictor's timing (beyond kvp shares, an even spread) agree."""
    return ParallelConfig(tp=tp, spp=spp, kvp=kvp, max_tokens_per_kvp_group=-(-context // kvp))


def length_label(n: int) -> str:
    return f"{n // M}M" if n % M == 0 else f"{n // 1000}K"


def fmt_ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms"


def fmt_s(s: float) -> str:
    return f"{s:.0f} s" if s >= 100 else f"{s:.3g} s"
