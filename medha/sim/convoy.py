"""The convoy, replayed: the decisions an executor makes on a machine its model predicts wrong.

The benchmarks' convoy (bench/vllm/vllm_convoy.py, bench/engine/engine_convoy.py): a long prompt,
then short prompts `after_s` later, each with `max_tokens` of output; before it, the same shorts
alone, after a warm-up of them. Here the executor's scheduler plans as it would on a real
server, over the model it would start with (a start-up profile, or the roofline), corrected
online from each batch; the batches take the time `truth` gives them (another model: the
machine as measured, perturbed or scaled), as `medha.sim.replay` runs them, steps paused
between layers where the executor pauses them. Deterministic: no clock is read, and a batch's
jitter comes from a seeded generator. tests/test_machine_kinds.py runs it over every profile
the project holds.
"""

from __future__ import annotations

import dataclasses
import json
import random
import statistics
from dataclasses import dataclass
from pathlib import Path

from medha.core.request import Request
from medha.perf.online_fit import CorrectedPredictor, StepLearner
from medha.perf.predictor import Predictor
from medha.scheduler.block_manager import BlockManager
from medha.scheduler.config import SchedulerConfig
from medha.scheduler.recalibration import RESOLVE_SLICE_STEPS
from medha.scheduler.replica_scheduler import ReplicaScheduler
from medha.sim.replay import replay


class Scaled:
    """`truth` taking `1 / k` of its time: a model of it is then k times off."""

    def __init__(self, truth: Predictor, k: float) -> None:
        self.truth, self.k = truth, k

    def shape_time(self, prefills, decodes=()) -> float:
        return self.truth.shape_time(prefills, decodes) / self.k

    def prefill_step_time(self, n: int, k: int) -> float:
        return self.truth.prefill_step_time(n, k) / self.k


def grid_predictor(path: Path, seed: int | None = None, outlier: float | None = None):
    """The fitted predictor of a start-up grid (a profile of SmolLM2; fp32 where its file name
    says so, else bf16); with `seed`, of the grid timed again: each row off by up to 15%, and
    one of them by `outlier` times where given."""
    from medha.perf import ParallelConfig, get_hardware, get_model
    from medha.perf.profile_data import profile_from_json
    from medha.perf.profiled_predictor import ProfiledPredictor

    data = json.loads(Path(path).read_text())
    if seed is not None:
        rng = random.Random(seed)
        for row in data["iterations"]:
            row["time_ms"] *= 1 + rng.uniform(-0.15, 0.15)
        if outlier is not None:
            data["iterations"][rng.randrange(len(data["iterations"]))]["time_ms"] *= outlier
    cpu = dataclasses.replace(get_hardware("cpu"), dtype_bytes=4 if "fp32" in path.name else 2)
    profile = profile_from_json(data, path.name)
    return ProfiledPredictor(get_model("smollm2"), cpu, ParallelConfig(), profile)


# vLLM's cap on a step's tokens in the convoy benches (medha/benchmark/vllm_servers.py), and the
# block size both engines run the convoy with
VLLM_STEP_TOKENS = 2048
BLOCK_SIZE = 32


@dataclass(frozen=True)
class Convoy:
    long_len: int = 6000
    shorts: int = 8
    short_len: int = 64
    after_s: float = 0.5  # the shorts' arrival after the long prompt's
    max_tokens: int = 16


@dataclass(frozen=True)
class ConvoyResult:
    shorts_ratio: float  # the shorts' median TTFT behind the long prompt over alone
    worst_ratio: float  # the slowest short's TTFT behind it over the median alone
    long_ratio: float  # the long prompt's TTFT over its time alone in the largest steps
    # ... over that plus the shorts' own work (their batches' time alone): what any schedule
    # that serves the shorts while the long prompt prefills gives it at best
    long_over_floor: float
    shorts_behind_s: float  # the shorts' median TTFT behind the long prompt
    long_s: float  # the long prompt's TTFT
    # the most steps of the long prompt without a short one that a short waited through (that
    # started after it arrived, before its first chunk): 0 where none waits out a step of it
    long_steps_waited: int
    config: SchedulerConfig  # the defaults the scheduler ended with


def executor_config(executor: str, **settings) -> SchedulerConfig:
    """The scheduler settings an executor runs the convoy with by default: medha's engine
    pauses its steps (one process, a CPU), vLLM caps a step at VLLM_STEP_TOKENS and pauses
    none."""
    if executor == "engine":
        return SchedulerConfig(**{"pause_steps": True, **settings})
    if executor == "vllm":
        return SchedulerConfig(**{"max_batch_tokens": VLLM_STEP_TOKENS, **settings})
    raise ValueError(f"executor must be engine or vllm, got {executor!r}")


def long_alone_s(truth: Predictor, convoy: Convoy, executor: str) -> float:
    """The long prompt alone in the largest steps its executor runs: one step on medha's
    engine, VLLM_STEP_TOKENS-token steps on vLLM (what plain vLLM gives it)."""
    cap = convoy.long_len if executor == "engine" else VLLM_STEP_TOKENS
    return sum(
        truth.prefill_step_time(min(cap, convoy.long_len - k), k)
        for k in range(0, convoy.long_len, cap)
    )


def run_convoy(
    truth: Predictor,
    model: Predictor,
    config: SchedulerConfig,
    convoy: Convoy = Convoy(),
    learn: bool = True,
    jitter: float = 0.05,
    seed: int = 0,
    warm: bool = True,
    probe: bool = False,
) -> ConvoyResult:
    """The convoy on one scheduler planning with `model` (corrected online from each batch
    unless `learn` is off, as the executors do by default) while batches take `truth`'s time,
    each off by up to `jitter` (relative, seeded). `warm`: the warm-up and the shorts alone
    run first on the same scheduler, as in the benchmarks; else the convoy comes first and
    the shorts alone are replayed on a scheduler of their own. `probe`: before any request,
    the scheduler's learner sees the start-up probe's shapes at `truth`'s time, as medha's
    engine with no profile times them (LLMEngine._probe_start)."""
    run = _Replay(truth, model, config, convoy, learn, jitter, seed, probe)
    sched = run.scheduler()
    if warm:
        run.scenario(sched, "warm-", False)
        alone = run.scenario(sched, "alone-", False)
        shorts_work = run.busy
        behind = run.scenario(sched, "", True)
        waited = run.long_steps_waited()
    else:
        behind = run.scenario(sched, "", True)
        waited = run.long_steps_waited()
        alone = run.scenario(run.scheduler(), "alone-", False)
        shorts_work = run.busy
    alone_s = statistics.median(alone.values())
    shorts = [behind[f"s{i}"] for i in range(convoy.shorts)]
    executor = "engine" if config.max_batch_tokens is None else "vllm"
    long_s = long_alone_s(truth, convoy, executor)
    return ConvoyResult(
        statistics.median(shorts) / alone_s,
        max(shorts) / alone_s,
        behind["long"] / long_s,
        behind["long"] / (long_s + shorts_work),
        statistics.median(shorts),
        behind["long"],
        waited,
        dataclasses.replace(sched.config),
    )


class _Replay:
    """run_convoy's scenarios, replayed one after another on one clock: the schedulers it
    plans with, the batches' seeded times, and what the last scenario's batches were."""

    def __init__(
        self,
        truth: Predictor,
        model: Predictor,
        config: SchedulerConfig,
        convoy: Convoy,
        learn: bool,
        jitter: float,
        seed: int,
        probe: bool,
    ) -> None:
        self.truth, self.model, self.config, self.convoy = truth, model, config, convoy
        self.learn, self.jitter, self.probe = learn, jitter, probe
        self.rng = random.Random(seed)
        self.clock = 0.0  # where the last scenario ended
        self.busy = 0.0  # the last scenario's batches' time alone (truth, no jitter)
        self.arrived = 0.0  # the last scenario's shorts' arrival
        self.steps: list[tuple[float, set[str]]] = []  # each batch of it: its start, prefills

    def batch_time_of(self, prefills, decodes) -> float:
        return self.truth.shape_time(prefills, decodes) * (
            1 + self.rng.uniform(-self.jitter, self.jitter)
        )

    def batch_time(self, batch) -> float:
        return self.batch_time_of(*batch.shape())

    def scheduler(self) -> ReplicaScheduler:
        planner, learner = self.model, None
        if self.learn:
            planner = CorrectedPredictor(self.model)
            learner = StepLearner(planner)
        convoy = self.convoy
        blocks = BlockManager(max(1, 4 * (convoy.long_len + 64) // BLOCK_SIZE), BLOCK_SIZE)
        # (the engine's slices of a re-resolution, counted in chunks: its decisions, here)
        sched = ReplicaScheduler(
            self.config,
            planner,
            blocks,
            block_tables=False,
            learner=learner,
            resolve_slice_steps=RESOLVE_SLICE_STEPS,
        )
        if self.probe and learner is not None:
            sched.probe(self.batch_time_of)
        return sched

    def scenario(self, sched: ReplicaScheduler, tag: str, with_long: bool) -> dict[str, float]:
        convoy = self.convoy
        t0 = self.clock + 1.0
        requests = [
            Request(f"{tag}s{i}", t0 + convoy.after_s, convoy.short_len, convoy.max_tokens)
            for i in range(convoy.shorts)
        ]
        if with_long:
            requests.append(Request(f"{tag}long", t0, convoy.long_len, convoy.max_tokens))
        self.busy, self.arrived = 0.0, t0 + convoy.after_s
        self.steps.clear()
        self.clock = replay(sched, requests, self.batch_time, on_batch=self.record)
        return {r.request_id: r.first_token_s - r.arrival_s for r in requests}

    def record(self, batch, end: float) -> None:
        self.busy += self.truth.shape_time(*batch.shape())
        self.steps.append((batch.scheduled_at_s, {c.request.request_id for c in batch.prefills}))

    def long_steps_waited(self) -> int:
        """Of the behind scenario's steps (`steps`), the most that carried the long prompt
        alone, began after the shorts arrived and before one short's first chunk."""
        worst = 0
        for i in range(self.convoy.shorts):
            name, count = f"s{i}", 0
            for start, ids in sorted(self.steps, key=lambda step: step[0]):
                if name in ids:
                    break
                count += start >= self.arrived and ids == {"long"}
            worst = max(worst, count)
        return worst
