"""The scheduler's configuration: SchedulerConfig, what every policy, packer and the KV
arbiter read, with each policy's own settings as a group of it (medha/scheduler/policies/
config.py). Every field's help text is what the CLI shows. Its hardware-dependent defaults are
filled in by `resolve_config` (config_defaults.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from medha.core.config import (
    CHUNKING,
    KV_MEMORY,
    MIN_TTFT_DEADLINE_S,
    PIPELINE_MODES,
    POLICY_NAMES,
    PREEMPTION_MODES,
    PREFIX_CACHE_MODES,
    SCHEDULER,
    check_positive_ints,
    check_positive_seconds,
    help_metadata,
    parse_chunking,
)
from medha.scheduler.policies.config import (
    AlignedSettings,
    DeferredSettings,
    LarsSettings,
    PlaSettings,
    PrioritySettings,
)
from medha.utils.dataclass_cli import from_flat
from medha.utils.registry import unknown_name

# SchedulerConfig's groups of one policy's settings, by field name
_SETTINGS = {
    "lars": LarsSettings,
    "deferred": DeferredSettings,
    "aligned": AlignedSettings,
    "priority": PrioritySettings,
    "pla": PlaSettings,
}


@dataclass
class SchedulerConfig:
    policy: str | None = field(
        default=None,
        metadata=help_metadata(
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
        metadata=help_metadata(
            CHUNKING,
            "how many prompt tokens an iteration takes: adaptive (largest chunks that keep the "
            "predicted iteration within the budget), static:N (N-token budget per iteration, "
            "Sarathi) or none (whole prompt in one iteration, non-preemptive)",
        ),
    )
    pipeline: str = field(
        default="stream",
        metadata=help_metadata(
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
        metadata=help_metadata(
            CHUNKING,
            "let several prefills share an iteration (off: at most one prefill chunk per batch)",
        ),
    )
    space_sharing: bool = field(
        default=True,
        metadata=help_metadata(
            CHUNKING, "a long prefill with slack leaves part of the iteration budget to others"
        ),
    )
    tpot_target_s: float | None = field(
        default=None,
        metadata=help_metadata(
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
        metadata=help_metadata(
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
        metadata=help_metadata(
            CHUNKING,
            "longest step when no decode and no short prefill waits for the next one (a lone "
            "long prefill, or long ones only): how long a request arriving during it may wait. "
            "Default: the budget at which the predictor prices chunking a max-length prompt "
            "within 1.02x, at most half the shortest default TTFT deadline, at least the "
            "iteration budget; the iteration budget itself when that is given",
        ),
    )
    pause_steps: bool | None = field(
        default=None,
        metadata=help_metadata(
            CHUNKING,
            "let the executor pause a step of long prefills between two of its layers, to run "
            "first a step for whoever waits (a short prompt that arrived, a decode whose next "
            "token is due), then resume it: nobody waits for a long prefill's step, so it runs "
            "in steps as long as the arrival wait (sized for its chunking price), and the "
            "decodes beside it come at their TPOT in steps of their own (docs/design.md, "
            "'Paused steps'). Default: on with adaptive chunking where the executor can pause "
            "(medha's engine in one process on a CPU) and the policy forms batches by the "
            "packer alone (not deferred, aligned or pla); off in the simulator's event loop "
            "and on vLLM",
        ),
    )
    overload_steps: bool = field(
        default=True,
        metadata=help_metadata(
            CHUNKING,
            "under overload, when every request decoding and every short one waiting is past "
            "its TTFT deadline, run the step to the arrival wait as if nobody waited on it: "
            "the queue drains sooner, and the late requests' tokens come at up to the arrival "
            "wait apart (off: a late decode waits on the step like any other; "
            "docs/design.md, 'The iteration budget')",
        ),
    )
    lars: LarsSettings = field(
        default_factory=lambda: LarsSettings(), metadata={"flag_prefix": "lars_"}
    )
    rho_max: float = field(
        default=0.4,
        metadata=help_metadata(
            CHUNKING, "most of the budget a long prefill yields to others under space sharing"
        ),
    )
    long_prefill_threshold: int | None = field(
        default=None,
        metadata=help_metadata(
            CHUNKING,
            "prompt tokens from which a prefill counts as long: at most one long prefill per "
            "batch, and space sharing applies to it (default: min(32768, max_model_len / 4))",
        ),
    )
    ttft_deadline_s: float | None = field(
        default=None,
        metadata=help_metadata(
            SCHEDULER,
            "fixed TTFT deadline (s) for requests without their own (default: "
            "max(factor x predicted isolated prefill time, min deadline))",
        ),
    )
    ttft_deadline_factor: float = field(
        default=1.5,
        metadata=help_metadata(
            SCHEDULER, "TTFT deadline as a multiple of the predicted isolated prefill time"
        ),
    )
    min_ttft_deadline_s: float | None = field(
        default=None,
        metadata=help_metadata(
            SCHEDULER,
            "smallest default TTFT deadline (s) (default: 0.5, or two iteration budgets where "
            "that is longer, as on a slow CPU: a request that arrives during a step waits for "
            "it, then runs in its own, so no shorter deadline can be promised)",
        ),
    )
    max_num_seqs: int = field(
        default=256,
        metadata=help_metadata(
            SCHEDULER, "most sequences (decodes + prefill chunks) in one iteration"
        ),
    )
    max_batch_tokens: int | None = field(
        default=None,
        metadata=help_metadata(
            CHUNKING,
            "most tokens in one iteration (default: no cap; N for static:N, the model context "
            "for none)",
        ),
    )
    min_chunk_tokens: int = field(
        default=32,
        metadata=help_metadata(
            CHUNKING,
            "chunk an otherwise empty iteration still runs when even it exceeds the budget, so "
            "that a request deep into a long context keeps making progress",
        ),
    )
    max_model_len: int | None = field(
        default=None,
        metadata=help_metadata(
            SCHEDULER, "longest context (prompt + output) accepted (default: the model's)"
        ),
    )
    watermark: float = field(
        default=0.01,
        metadata=help_metadata(
            KV_MEMORY, "share of KV blocks new prefill chunks leave free for running decodes"
        ),
    )
    prefill_only_iterations: bool = field(
        default=False,
        metadata=help_metadata(
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
        metadata=help_metadata(
            KV_MEMORY,
            "what a request preempted under KV memory pressure loses: recompute (its KV is "
            "dropped and its whole context prefilled again), swap (its KV moves to the host pool "
            "and back, progress kept; recompute when the pool is full) or auto (swap when moving "
            "the KV out and back is predicted cheaper than recomputing it, and the pool has room)",
        ),
    )
    swap_space_gb: float = field(
        default=4.0,
        metadata=help_metadata(
            KV_MEMORY,
            "host memory in GiB per device for swapped-out KV (the host pool), with "
            "--preemption-mode swap or auto",
        ),
    )
    host_kv_blocks: int | None = field(
        default=None,
        metadata=help_metadata(
            KV_MEMORY,
            "host pool size in KV blocks; overrides --swap-space-gb (the engine sets it from its "
            "own KV dtype)",
        ),
    )
    prefix_cache: str | None = field(
        default=None,
        metadata=help_metadata(
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
        metadata=help_metadata(
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
        metadata=help_metadata(
            KV_MEMORY,
            "host memory in GiB per device for the prefix cache's host tier, with "
            "--prefix-cache device+host",
        ),
    )
    host_cache_blocks: int | None = field(
        default=None,
        metadata=help_metadata(
            KV_MEMORY,
            "prefix cache host tier size in KV blocks; overrides --host-cache-gb (the engine "
            "sets it from its own KV dtype)",
        ),
    )
    swap_bandwidth_gbps: float | None = field(
        default=None,
        metadata=help_metadata(
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
        check_positive_seconds(
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
        check_positive_ints(
            self,
            (
                "max_num_seqs",
                "long_prefill_threshold",
                "min_chunk_tokens",
                "max_batch_tokens",
                "max_model_len",
            ),
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
        check_positive_seconds(self, ("swap_bandwidth_gbps",), what="a positive number")

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
            self.pause_steps,
        )
