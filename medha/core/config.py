"""Typed configuration; every field's help text is what the CLI shows."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from medha.utils.dataclass_cli import from_flat
from medha.utils.registry import unknown_name

PREEMPTION_MODES = ("recompute", "swap", "auto")
# Prefix caching (medha/scheduler/prefix_cache.py): none, device KV only, or device KV with a
# host-memory tier that blocks evicted from the device go to.
PREFIX_CACHE_MODES = ("off", "device", "device+host")
# What LARS divides a request's slack by (Request.relative_slack): the prefill work still ahead,
# w(t), or the whole prefill's, w_total (the paper's formula).
LARS_SLACK_MODES = ("remaining", "total")
# The scheduler's policies and chunking modes, by name. Each is implemented by one module of
# medha/scheduler/policies (or packers) that registers under that name; the names are listed
# here, below the scheduler, so that a config is checked without importing what it configures
# (tests/test_policies.py and test_packer.py keep the lists and the registries equal).
POLICY_NAMES = ("fcfs", "edf", "lrs", "lars", "srpt", "deferred", "aligned", "priority", "pla")
CHUNKING_MODES = ("none", "static", "adaptive")
# How a request's batches pass through the spp pipeline stages of a replica: stream (Medha's
# SPP: the next chunk of a prefill follows the previous one a stage behind) or microbatch (vLLM's
# and Sarathi's pipeline parallelism: a request waits until its batch leaves the last stage, and
# other requests' batches fill the stages meanwhile).
PIPELINE_MODES = ("stream", "microbatch")
_CHUNKING_TAKES_ARGUMENT = ("static",)  # static:N, a token budget


# A prefill counts as long from a quarter of the model's context, and at most from this many
# prompt tokens (see default_long_threshold).
LONG_THRESHOLD_CAP = 32768


def default_long_threshold(max_model_len: int) -> int:
    """Prompt tokens from which a request counts as long, for a context of `max_model_len`:
    min(32768, max_model_len / 4). The one default of the scheduler's long_prefill_threshold
    (at most one long prefill per batch, space sharing), the simulator's per-class metrics
    (which follow the scheduler's resolved threshold) and `medha bench`'s class tables (from
    the server's max_model_len in /v1/models)."""
    return min(LONG_THRESHOLD_CAP, max(1, max_model_len // 4))


# The groups of SchedulerConfig's fields, in the order `--help` shows them. The field names stay
# flat (they are Python keyword arguments and flags); the group says which part of the scheduler
# or which policy a field belongs to.
SCHEDULER = "scheduler"
CHUNKING = "chunking and budget"
KV_MEMORY = "KV memory and preemption"
DEFERRED = "deferred policy"
ALIGNED = "aligned policy"
PRIORITY = "priority policy"
PLA = "pla policy"
SCHEDULER_GROUPS = (SCHEDULER, CHUNKING, KV_MEMORY, DEFERRED, ALIGNED, PRIORITY, PLA)


def _help(group: str, text: str, **extra) -> dict:
    return {"group": group, "help": text, **extra}


def parse_chunking(spec: str) -> tuple[str, int | None]:
    """'adaptive' | 'none' | 'static:N' -> (chunking mode, N)."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"chunking must be none, static:N or adaptive, got {spec!r}")
    name, _, arg = spec.partition(":")
    if name not in CHUNKING_MODES:
        raise ValueError(f"unknown chunking {spec!r}; expected none, static:N or adaptive")
    if name in _CHUNKING_TAKES_ARGUMENT:
        if not arg.isdigit() or int(arg) < 1:
            raise ValueError(
                f"chunking {spec!r}: static chunking needs a positive token budget, e.g. static:512"
            )
        return name, int(arg)
    if arg:
        raise ValueError(f"chunking {spec!r}: {name} takes no argument")
    return name, None


def _positive_ints(obj, names: tuple[str, ...], prefix: str = "") -> None:
    """Each of `names` (attributes of `obj`; a flag's name is `prefix` + it) is None or an
    integer >= 1."""
    for name in names:
        value = getattr(obj, name)
        if value is not None and not (isinstance(value, int) and value >= 1):
            raise ValueError(f"{prefix}{name} must be a positive integer, got {value!r}")


def _positive_seconds(
    obj, names: tuple[str, ...], prefix: str = "", what: str = "a positive number"
) -> None:
    """Each of `names` is None or a finite number > 0."""
    for name in names:
        value = getattr(obj, name)
        if value is not None and not (
            isinstance(value, (int, float)) and math.isfinite(value) and value > 0
        ):
            raise ValueError(f"{prefix}{name} must be {what}, got {value!r}")


@dataclass
class DeferredSettings:
    """The deferred policy's settings (medha/scheduler/policies/deferred_policy.py)."""

    departure_threshold: int = field(
        default=1,
        metadata=_help(
            DEFERRED,
            "deferred policy: admit new prefills only once this many requests (K) have left the "
            "running batch since the last admission; 1 is ordinary continuous batching",
        ),
    )
    batch_cap: int | None = field(
        default=None,
        metadata=_help(
            DEFERRED,
            "deferred policy: most requests in the running batch (C), admitted and not yet "
            "finished; at most max_num_seqs (default: max_num_seqs)",
        ),
    )

    def __post_init__(self) -> None:
        _positive_ints(self, ("departure_threshold", "batch_cap"))


@dataclass
class AlignedSettings:
    """The aligned policy's settings (flags --aligned-*; aligned_policy.py). Defaults are
    AlignedServe's (Section 4.1) where it gives them."""

    min_batch: int = field(
        default=36,
        metadata=_help(
            ALIGNED,
            "aligned policy: N_thr, fewest requests a length range must hold to become a batch "
            "on its own (Algorithm 1; the paper's 36); sparser ranges take in their siblings",
        ),
    )
    memory_fraction: float = field(
        default=0.4,
        metadata=_help(
            ALIGNED,
            "aligned policy: M_thr, most of the decode device's KV blocks one generated batch may "
            "hold (Algorithm 1; the paper's 0.4)",
        ),
    )
    starvation_s: float | None = field(
        default=30.0,
        metadata=_help(
            ALIGNED,
            "aligned policy: a length subtree that has generated no batch for this long while "
            "holding a pooled request gets the next batch (Section 3.5; the paper gives no "
            "value: 30 s is the longest TTFT it reports without the rule)",
        ),
    )
    decode_blocks: int | None = field(
        default=None,
        metadata=_help(
            ALIGNED,
            "aligned policy: KV blocks of the decode device that the running batch lives in; "
            "the replica's cache beyond them stands for the host KV pool (default: the whole "
            "cache, no pool)",
        ),
    )
    running_seqs: int | None = field(
        default=None,
        metadata=_help(
            ALIGNED,
            "aligned policy: most requests in the running batch (default: max_num_seqs, which "
            "then also bounds the pool)",
        ),
    )
    prefetch: bool = field(
        default=True,
        metadata=_help(
            ALIGNED,
            "aligned policy: GPU prefetch: batches move into and out of the decode device over "
            "NVLink from the prefill device's buffers; off, over PCIe from host memory",
        ),
    )
    switch_on_room: bool = field(
        default=False,
        metadata=_help(
            ALIGNED,
            "aligned policy: switch to the candidate batch whenever the running batch has room "
            "and no buffered request (Section 3.4's case 2 read literally); default: only once "
            "the running batch is too small to saturate the device, fewer than N_thr requests "
            "(Sections 3.2-3.3)",
        ),
    )
    batching: str = field(
        default="dfs",
        metadata=_help(
            ALIGNED,
            "aligned policy: how pooled requests become batches: dfs (prefix-aware, Algorithm 1) "
            "or fcfs (pool order; the paper's ablation without prefix-aware batching)",
        ),
    )

    def __post_init__(self) -> None:
        _positive_seconds(self, ("starvation_s",), "aligned_")
        _positive_ints(self, ("min_batch", "decode_blocks", "running_seqs"), "aligned_")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(
                f"aligned_memory_fraction must lie in (0, 1], got {self.memory_fraction!r}"
            )
        if self.batching not in ("dfs", "fcfs"):
            raise ValueError(f"aligned_batching must be dfs or fcfs, got {self.batching!r}")


@dataclass
class PrioritySettings:
    """The priority policy's settings (flags --priority-*; priority_policy.py)."""

    base: str = field(
        default="fcfs",
        metadata=_help(
            PRIORITY,
            "priority policy: the policy that orders requests within a class (REALTIME > HIGH > "
            "NORMAL > LOW); any other policy name",
        ),
    )

    # SLO-risk preemption, after the article on Orca/Sarathi scheduling (seed 001): its complete
    # scheduler preempts at 15 ms of TBT slack and stops at 30 ms; its shorter sketch says 10
    # and 20 ms.
    slo_risk: bool = field(
        default=False,
        metadata=_help(
            PRIORITY,
            "priority policy: before a batch forms, preempt running NORMAL and LOW decodes "
            "(LOW first, then those with the fewest tokens generated) while a REALTIME or HIGH "
            "decode's predicted TBT slack is below --priority-slo-risk-slack-s, until it is "
            "back above --priority-slo-risk-resume-s; the victims come back when there is room",
        ),
    )
    slo_risk_slack_s: float = field(
        default=0.015,
        metadata=_help(
            PRIORITY,
            "priority policy: TBT slack (s) below which a REALTIME or HIGH decode is at risk "
            "(its TPOT target minus the time since its last token and the predicted next step)",
        ),
    )
    slo_risk_resume_s: float = field(
        default=0.030,
        metadata=_help(
            PRIORITY,
            "priority policy: TBT slack (s) that SLO-risk preemption restores before it stops",
        ),
    )

    def __post_init__(self) -> None:
        if self.base not in POLICY_NAMES:
            raise unknown_name("policy", self.base, POLICY_NAMES)
        if self.base == "priority":
            raise ValueError("priority_base must name another policy, got 'priority'")
        for name in ("slo_risk_slack_s", "slo_risk_resume_s"):
            if getattr(self, name) is None:
                raise ValueError(f"priority_{name} must be a positive number, got None")
        _positive_seconds(self, ("slo_risk_slack_s", "slo_risk_resume_s"), "priority_")
        if self.slo_risk_resume_s < self.slo_risk_slack_s:
            raise ValueError(
                f"priority_slo_risk_resume_s ({self.slo_risk_resume_s}) must be at least "
                f"priority_slo_risk_slack_s ({self.slo_risk_slack_s})"
            )


PLA_MODES = ("sla", "awd", "token-max")


@dataclass
class PlaSettings:
    """The pla policy's settings (flags --pla-*; pla_policy.py). The paper (She et al.) gives
    the captured graph grid and a 0.4 s TTFT SLO, no value for the thresholds below; the
    defaults are ours, each said why. The boundary L_m they set is also the pla dispatcher's
    (medha/dispatch/config.py has the dispatcher's own settings)."""

    boundary_tokens: int | None = field(
        default=None,
        metadata=_help(
            PLA,
            "pla policy and dispatcher: prefills of fewer new tokens than this are short "
            "(default: L_m(H) from the paper's T_comp / T_mem model, calibrated to the model "
            "and device, H the prefix-cached history)",
        ),
    )
    memory_intercept: bool = field(
        default=True,
        metadata=_help(
            PLA,
            "pla: calibrate T_mem with the weights' read as a constant term (off: the "
            "paper's T_mem = g_w L + g_r H as written, which puts L_m^prefill at 0 on GPUs)",
        ),
    )
    mode: str = field(
        default="sla",
        metadata=_help(
            PLA,
            "pla: sla (W = min(W_SLA, W_GR) at every decision), awd (Algorithm 1's W and D "
            "updates alone) or token-max (deadline-free: a short batch goes once its padded "
            "tokens reach --pla-token-max-tokens)",
        ),
    )
    adaptive: bool = field(
        default=True,
        metadata=_help(
            PLA, "pla: adapt W and D (off: wait --pla-w-max-s for the deepest captured depth)"
        ),
    )
    slack_s: float = field(
        default=0.01,
        metadata=_help(
            PLA,
            "pla: sigma, dispatch the short batch at once when its smallest slack "
            "DDL - (t + S) falls to this (s; about one short batch)",
        ),
    )
    delta_s: float = field(
        default=0.01,
        metadata=_help(PLA, "pla: delta, the safety margin of W_SLA (s)"),
    )
    w_min_s: float = field(default=0.0, metadata=_help(PLA, "pla: W_min (s)"))
    w_max_s: float = field(
        default=0.05,
        metadata=_help(PLA, "pla: W_max (s): the longest waiting window (an eighth of 0.4 s)"),
    )
    t_max_s: float = field(
        default=0.1,
        metadata=_help(PLA, "pla: T_max, the longest head-of-line wait of a short request (s)"),
    )
    rate_floor: float = field(
        default=1.0,
        metadata=_help(PLA, "pla: epsilon, the least short arrival rate in W_GR (1/s)"),
    )
    memory_tokens: int = field(
        default=16384,
        metadata=_help(
            PLA,
            "pla: M, the token budget of a short batch padded to its graph shape (SGLang's "
            "default max_prefill_tokens)",
        ),
    )
    long_batch: str = field(
        default="one",
        metadata=_help(
            PLA,
            "pla: one (the paper: a long-prefill batch advances a single request, in chunks of "
            "the packer's size) or all (long requests share a batch, as a unified queue's do)",
        ),
    )
    token_max_tokens: int = field(
        default=8192,
        metadata=_help(
            PLA,
            "pla: M_s, token-max mode: a short batch goes once it holds this many padded "
            "tokens (SGLang's default chunked prefill size)",
        ),
    )

    def __post_init__(self) -> None:
        _positive_seconds(self, ("w_max_s", "t_max_s"), "pla_")
        _positive_ints(self, ("boundary_tokens", "memory_tokens", "token_max_tokens"), "pla_")
        if self.long_batch not in ("one", "all"):
            raise unknown_name("pla_long_batch", self.long_batch, ("one", "all"))
        if self.mode not in PLA_MODES:
            raise unknown_name("pla_mode", self.mode, PLA_MODES)
        for name in ("slack_s", "delta_s", "w_min_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"pla_{name} must be a number >= 0, got {v!r}")
        if self.w_min_s > self.w_max_s:
            raise ValueError(f"pla_w_min_s ({self.w_min_s}) exceeds pla_w_max_s ({self.w_max_s})")
        if not (isinstance(self.rate_floor, (int, float)) and self.rate_floor > 0):
            raise ValueError(f"pla_rate_floor must be positive, got {self.rate_floor!r}")


# SchedulerConfig's groups of one policy's settings, by field name
_SETTINGS = {
    "deferred": DeferredSettings,
    "aligned": AlignedSettings,
    "priority": PrioritySettings,
    "pla": PlaSettings,
}


@dataclass
class SchedulerConfig:
    policy: str | None = field(
        default=None,
        metadata=_help(
            SCHEDULER,
            "who goes first: fcfs, edf, lrs, lars or srpt (default: lars with adaptive chunking; "
            "fcfs with none or static:N, the paper's Orca/vLLM and Sarathi baselines); deferred "
            "is fcfs that admits new prefills only after --departure-threshold departures; "
            "aligned is fcfs that runs decodes of similar prefix length together (AlignedServe); "
            "priority orders by the request's class (REALTIME > HIGH > NORMAL > LOW), then by "
            "--priority-base, and preempts lower classes first; pla splits prefills at a length "
            "boundary into a short and a long queue, runs one class per batch and batches short "
            "prefills by an adaptive wait and depth (PLA-Serve)",
        ),
    )
    chunking: str = field(
        default="adaptive",
        metadata=_help(
            CHUNKING,
            "how many prompt tokens an iteration takes: adaptive (largest chunks that keep the "
            "predicted iteration within the budget), static:N (N-token budget per iteration, "
            "Sarathi) or none (whole prompt in one iteration, non-preemptive)",
        ),
    )
    pipeline: str = field(
        default="stream",
        metadata=_help(
            SCHEDULER,
            "with spp stages, when a request may join another batch: stream (Medha's stream "
            "pipeline: the next chunk of a prefill enters stage 1 while the previous chunk is "
            "still in later stages) or microbatch (vLLM / Sarathi pipeline parallelism: a "
            "request with a batch in flight, prefill chunk or decode, waits until that batch "
            "leaves the last stage; only other requests fill the stages meanwhile)",
            choices=PIPELINE_MODES,
        ),
    )
    multi_prefill: bool = field(
        default=True,
        metadata=_help(
            CHUNKING,
            "let several prefills share an iteration (off: at most one prefill chunk per batch)",
        ),
    )
    space_sharing: bool = field(
        default=True,
        metadata=_help(
            CHUNKING, "a long prefill with slack leaves part of the iteration budget to others"
        ),
    )
    tpot_target_s: float | None = field(
        default=None,
        metadata=_help(
            SCHEDULER,
            "time-per-output-token target (s) counted in SLO attainment, and what the iteration "
            "budget defaults from (default: 0.05 where the predictor prices chunking a "
            "max-length prompt, up to 32K tokens, in 0.05 s steps within 1.5x its time in one "
            "step, as on GPUs; elsewhere, as on CPUs, where a lone decode step takes about that "
            "long, the smallest budget that prices it within 1.1x)",
        ),
    )
    iteration_budget_s: float | None = field(
        default=None,
        metadata=_help(
            CHUNKING,
            "iteration time budget (s): adaptive chunking keeps each batch's predicted time within "
            "it, and pla keeps one iteration of slack for the other class's batch (default: the "
            "TPOT target; with spp stages, spp/(spp+1) of it, since a decode may wait one stage "
            "for its next slot). A batch that carries the decode of a request with its own TPOT "
            "target (the API's tpot_slo_s) gets at most that target, scaled the same way",
        ),
    )
    arrival_wait_s: float | None = field(
        default=None,
        metadata=_help(
            CHUNKING,
            "longest step when no decode and no short prefill waits for the next one (a lone "
            "long prefill, or long ones only): how long a request arriving during it may wait. "
            "Default: the budget at which the predictor prices chunking a max-length prompt "
            "within 1.02x, at most half the shortest default TTFT deadline, at least the "
            "iteration budget; the iteration budget itself when that is given",
        ),
    )
    lars_serve_early: bool = field(
        default=True,
        metadata=_help(
            SCHEDULER,
            "lars: serve a short prefill ahead of LARS's order when its work fits within the "
            "slack of every request it passes (none of them is then predicted to miss its "
            "deadline for it; a request already past its deadline does not hold it back); "
            "off: LARS's order alone, which lets short requests wait toward their deadline",
        ),
    )
    lars_slack: str = field(
        default="total",
        metadata=_help(
            SCHEDULER,
            "what LARS's relative slack rho = s / w divides the slack s by, in the lars key and "
            "in space sharing's yield: total (w_total, the whole prefill's work, the paper's "
            "formula: rho stays put while a request is served and falls while it waits) or "
            "remaining (w(t), the prefill work still ahead: a request grows less urgent as it "
            "is served; the paper's illustrative example needs it, Fig. 13 does a little worse "
            "with it: docs/design.md)",
            choices=LARS_SLACK_MODES,
        ),
    )
    rho_max: float = field(
        default=0.4,
        metadata=_help(
            CHUNKING, "most of the budget a long prefill yields to others under space sharing"
        ),
    )
    long_prefill_threshold: int | None = field(
        default=None,
        metadata=_help(
            CHUNKING,
            "prompt tokens from which a prefill counts as long: at most one long prefill per "
            "batch, and space sharing applies to it (default: min(32768, max_model_len / 4))",
        ),
    )
    ttft_deadline_s: float | None = field(
        default=None,
        metadata=_help(
            SCHEDULER,
            "fixed TTFT deadline (s) for requests without their own (default: "
            "max(factor x predicted isolated prefill time, min deadline))",
        ),
    )
    ttft_deadline_factor: float = field(
        default=1.5,
        metadata=_help(
            SCHEDULER, "TTFT deadline as a multiple of the predicted isolated prefill time"
        ),
    )
    min_ttft_deadline_s: float | None = field(
        default=None,
        metadata=_help(
            SCHEDULER,
            "smallest default TTFT deadline (s) (default: 0.5, or two iteration budgets where "
            "that is longer, as on a slow CPU: a request that arrives during a step waits for "
            "it, then runs in its own, so no shorter deadline can be promised)",
        ),
    )
    max_num_seqs: int = field(
        default=256,
        metadata=_help(SCHEDULER, "most sequences (decodes + prefill chunks) in one iteration"),
    )
    max_batch_tokens: int | None = field(
        default=None,
        metadata=_help(
            CHUNKING,
            "most tokens in one iteration (default: no cap; N for static:N, the model context "
            "for none)",
        ),
    )
    min_chunk_tokens: int = field(
        default=32,
        metadata=_help(
            CHUNKING,
            "chunk an otherwise empty iteration still runs when even it exceeds the budget, so "
            "that a request deep into a long context keeps making progress",
        ),
    )
    max_model_len: int | None = field(
        default=None,
        metadata=_help(
            SCHEDULER, "longest context (prompt + output) accepted (default: the model's)"
        ),
    )
    watermark: float = field(
        default=0.01,
        metadata=_help(
            KV_MEMORY, "share of KV blocks new prefill chunks leave free for running decodes"
        ),
    )
    prefill_only_iterations: bool = field(
        default=False,
        metadata=_help(
            CHUNKING,
            "an iteration with prefill work runs prefills only and the decodes wait for the next "
            "one, as in vLLM without chunked prefill (off: prefills share iterations with decodes)",
        ),
    )
    deferred: DeferredSettings = field(
        default_factory=lambda: DeferredSettings(), metadata={"flag_prefix": ""}
    )
    aligned: AlignedSettings = field(
        default_factory=lambda: AlignedSettings(), metadata={"flag_prefix": "aligned_"}
    )
    priority: PrioritySettings = field(
        default_factory=lambda: PrioritySettings(), metadata={"flag_prefix": "priority_"}
    )

    preemption_mode: str = field(
        default="recompute",
        metadata=_help(
            KV_MEMORY,
            "what a request preempted under KV memory pressure loses: recompute (its KV is "
            "dropped and its whole context prefilled again), swap (its KV moves to the host pool "
            "and back, progress kept; recompute when the pool is full) or auto (swap when moving "
            "the KV out and back is predicted cheaper than recomputing it, and the pool has room)",
        ),
    )
    swap_space_gb: float = field(
        default=4.0,
        metadata=_help(
            KV_MEMORY,
            "host memory in GiB per device for swapped-out KV (the host pool), with "
            "--preemption-mode swap or auto",
        ),
    )
    host_kv_blocks: int | None = field(
        default=None,
        metadata=_help(
            KV_MEMORY,
            "host pool size in KV blocks; overrides --swap-space-gb (the engine sets it from its "
            "own KV dtype)",
        ),
    )
    prefix_cache: str | None = field(
        default=None,
        metadata=_help(
            KV_MEMORY,
            "reuse the KV of prompt prefixes earlier requests computed: off, device (full blocks "
            "of a prompt and, once a request finishes, of its answer, identified by a hash of "
            "every token up to their end, stay in device memory until evicted, least recently "
            "used first) or device+host (blocks evicted from the device go to a host-memory "
            "tier and are copied back on a hit when that is predicted cheaper than recomputing "
            "them). Default: device on medha's engine (serve, generate, LLM; off with worker "
            "processes, tp/spp/kvp > 1, which refuse it), vLLM's own cache on --engine vllm "
            "(on unless --prefix-cache off), off in the simulator (its reproduction tables)",
            choices=PREFIX_CACHE_MODES,
        ),
    )
    prefix_cache_outputs: bool = field(
        default=True,
        metadata=_help(
            KV_MEMORY,
            "with a prefix cache, also cache the full blocks of a finished request's answer "
            "(its prompt and generated tokens, as far as their KV was computed) on medha's "
            "engine, so that a chat's next turn, which repeats the answer, reuses it; "
            "--no-prefix-cache-outputs caches prompts only (the simulator, whose requests carry "
            "no generated tokens, caches prompts only either way)",
        ),
    )
    host_cache_gb: float = field(
        default=4.0,
        metadata=_help(
            KV_MEMORY,
            "host memory in GiB per device for the prefix cache's host tier, with "
            "--prefix-cache device+host",
        ),
    )
    host_cache_blocks: int | None = field(
        default=None,
        metadata=_help(
            KV_MEMORY,
            "prefix cache host tier size in KV blocks; overrides --host-cache-gb (the engine "
            "sets it from its own KV dtype)",
        ),
    )
    swap_bandwidth_gbps: float | None = field(
        default=None,
        metadata=_help(
            KV_MEMORY,
            "device-host bandwidth in GB/s per device that swaps are timed with (default: the "
            "hardware's host link: PCIe, 25 GB/s for a100, 50 for h100/h200; the measured copy "
            "bandwidth for cpu)",
        ),
    )

    pla: PlaSettings = field(
        default_factory=lambda: PlaSettings(), metadata={"flag_prefix": "pla_"}
    )

    def __post_init__(self) -> None:
        for name, cls in _SETTINGS.items():  # a group given as a mapping (from YAML, say)
            value = getattr(self, name)
            if isinstance(value, dict):
                setattr(self, name, cls(**value))
            elif not isinstance(value, cls):
                raise ValueError(f"{name} must be {cls.__name__}, got {value!r}")
        if self.policy is not None and self.policy not in POLICY_NAMES:
            raise unknown_name("policy", self.policy, POLICY_NAMES)
        parse_chunking(self.chunking)
        if self.pipeline not in PIPELINE_MODES:
            raise unknown_name("pipeline", self.pipeline, PIPELINE_MODES)
        _positive_seconds(
            self,
            (
                "tpot_target_s",
                "iteration_budget_s",
                "arrival_wait_s",
                "ttft_deadline_s",
                "ttft_deadline_factor",
                "min_ttft_deadline_s",
            ),
        )
        _positive_ints(
            self,
            (
                "max_num_seqs",
                "long_prefill_threshold",
                "min_chunk_tokens",
                "max_batch_tokens",
                "max_model_len",
            ),
        )
        if self.lars_slack not in LARS_SLACK_MODES:
            raise ValueError(
                f"lars_slack must be one of {', '.join(LARS_SLACK_MODES)}, got {self.lars_slack!r}"
            )
        if not 0 <= self.rho_max < 1:
            raise ValueError(f"rho_max must lie in [0, 1), got {self.rho_max!r}")
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must lie in [0, 1), got {self.watermark!r}")
        # Every admitted request decodes in every iteration only if the cap fits in one.
        deferred = self.deferred
        if deferred.batch_cap is not None and deferred.batch_cap > self.max_num_seqs:
            raise ValueError(
                f"batch_cap ({deferred.batch_cap}) exceeds max_num_seqs "
                f"({self.max_num_seqs}): raise max_num_seqs too"
            )
        if deferred.departure_threshold > self.running_cap:
            raise ValueError(
                f"departure_threshold ({deferred.departure_threshold}) exceeds the "
                f"batch cap ({self.running_cap}): no batch could lose that many"
            )
        self._check_kv_memory()

    def _check_kv_memory(self) -> None:
        # the swap pool's and the prefix cache's host memory: a mode, GiB, or blocks
        for name, modes in (
            ("preemption_mode", PREEMPTION_MODES),
            ("prefix_cache", PREFIX_CACHE_MODES),
        ):
            value = getattr(self, name)
            # (prefix_cache None: the default of whoever runs the scheduler, see its help)
            if value not in modes and not (name == "prefix_cache" and value is None):
                raise ValueError(
                    f"{name} must be one of {', '.join(modes)}, got {getattr(self, name)!r}"
                )
        for name in ("swap_space_gb", "host_cache_gb"):
            gb = getattr(self, name)
            if not (isinstance(gb, (int, float)) and math.isfinite(gb) and gb >= 0):
                raise ValueError(f"{name} must be a number >= 0, got {gb!r}")
        for name in ("host_kv_blocks", "host_cache_blocks"):
            n = getattr(self, name)
            if n is not None and not (isinstance(n, int) and n >= 0):
                raise ValueError(f"{name} must be an integer >= 0, got {n!r}")
        _positive_seconds(self, ("swap_bandwidth_gbps",), what="a positive number")

    @classmethod
    def from_flat(cls, **settings) -> SchedulerConfig:
        """A config from the flat setting names of its flags, YAML keys and vLLM's
        additional config (`pla_wait_s` for `pla.wait_s`); ValueError for an unknown one."""
        return from_flat(cls, settings)

    @property
    def running_cap(self) -> int:
        """C: most requests admitted at once under the deferred policy."""
        return self.deferred.batch_cap or self.max_num_seqs

    def ttft_allowed_s(self, own_s: float | None, work_s: float) -> float:
        """The TTFT (s after arrival) a request is allowed: its own target `own_s`, else the
        configured one, else max(factor x `work_s`, the least), `work_s` its predicted prefill
        time alone. The scheduler admits by it; the dispatchers predict by it."""
        floor = self.min_ttft_deadline_s or MIN_TTFT_DEADLINE_S
        return own_s or self.ttft_deadline_s or max(self.ttft_deadline_factor * work_s, floor)

    @property
    def is_resolved(self) -> bool:
        """Whether `resolve_config` (medha/scheduler/config_defaults.py) has filled in the
        hardware-dependent defaults."""
        return None not in (
            self.tpot_target_s,
            self.iteration_budget_s,
            self.arrival_wait_s,
            self.min_ttft_deadline_s,
            self.max_model_len,
            self.long_prefill_threshold,
            self.prefix_cache,
        )


# The least TTFT deadline under the default deadlines (ttft_deadline_factor x a request's
# prefill time alone): 0.5 s, or two iteration budgets where that is longer
# (medha/scheduler/config_defaults.py resolves min_ttft_deadline_s from it).
MIN_TTFT_DEADLINE_S = 0.5


def iteration_budget(tpot_target_s: float, spp: int = 1) -> float:
    """The iteration time budget that keeps a token within `tpot_target_s`. With stream
    pipelining (spp stages) a decode that returns just after stage 1 was refilled waits for the
    next slot, one stage time, so the budget leaves room for it: spp/(spp+1) of the target.
    Without pipelining a batch returns exactly when the next one starts: the whole target."""
    return tpot_target_s if spp == 1 else tpot_target_s * spp / (spp + 1)
