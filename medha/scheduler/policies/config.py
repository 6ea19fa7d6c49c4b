"""Each policy's own settings, beside the policies (as medha/dispatch/config.py holds the
dispatchers'): one dataclass per policy that has any, a group of SchedulerConfig
(medha/scheduler/config.py) whose flags, YAML keys and flat names carry the policy's prefix
(`--pla-wait-s`, `pla_wait_s`, `config.pla.wait_s`). What every policy reads stays in
SchedulerConfig. This module imports no policy and no numpy, so that the CLI's parser builds
from it alone."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from medha.core.config import (
    ALIGNED,
    DEFERRED,
    LARS_SLACK_MODES,
    PLA,
    POLICY_NAMES,
    PRIORITY,
    SCHEDULER,
    check_positive_ints,
    check_positive_seconds,
    help_metadata,
)
from medha.utils.registry import unknown_name


@dataclass
class LarsSettings:
    """The lars policy's settings (flags --lars-*; lars_policy.py). The adaptive packer's space
    sharing reads the same relative slack as LARS's key (`slack`)."""

    serve_early: bool = field(
        default=True,
        metadata=help_metadata(
            SCHEDULER,
            "lars: serve a short prefill ahead of LARS's order when its work fits within the "
            "slack of every request it passes (none of them is then predicted to miss its "
            "deadline for it; a request already past its deadline does not hold it back); "
            "off: LARS's order alone, which lets short requests wait toward their deadline",
        ),
    )
    slack: str = field(
        default="total",
        metadata=help_metadata(
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

    def __post_init__(self) -> None:
        if self.slack not in LARS_SLACK_MODES:
            raise ValueError(
                f"lars_slack must be one of {', '.join(LARS_SLACK_MODES)}, got {self.slack!r}"
            )


@dataclass
class DeferredSettings:
    """The deferred policy's settings (medha/scheduler/policies/deferred_policy.py)."""

    departure_threshold: int = field(
        default=1,
        metadata=help_metadata(
            DEFERRED,
            "deferred policy: admit new prefills only once this many requests (K) have left the "
            "running batch since the last admission; 1 is ordinary continuous batching",
        ),
    )
    batch_cap: int | None = field(
        default=None,
        metadata=help_metadata(
            DEFERRED,
            "deferred policy: most requests in the running batch (C), admitted and not yet "
            "finished; at most max_num_seqs (default: max_num_seqs)",
        ),
    )

    def __post_init__(self) -> None:
        check_positive_ints(self, ("departure_threshold", "batch_cap"))


@dataclass
class AlignedSettings:
    """The aligned policy's settings (flags --aligned-*; aligned_policy.py). Defaults are
    AlignedServe's (Section 4.1) where it gives them."""

    min_batch: int = field(
        default=36,
        metadata=help_metadata(
            ALIGNED,
            "aligned policy: N_thr, fewest requests a length range must hold to become a batch "
            "on its own (Algorithm 1; the paper's 36); sparser ranges take in their siblings",
        ),
    )
    memory_fraction: float = field(
        default=0.4,
        metadata=help_metadata(
            ALIGNED,
            "aligned policy: M_thr, most of the decode device's KV blocks one generated batch may "
            "hold (Algorithm 1; the paper's 0.4)",
        ),
    )
    starvation_s: float | None = field(
        default=30.0,
        metadata=help_metadata(
            ALIGNED,
            "aligned policy: a length subtree that has generated no batch for this long while "
            "holding a pooled request gets the next batch (Section 3.5; the paper gives no "
            "value: 30 s is the longest TTFT it reports without the rule)",
        ),
    )
    decode_blocks: int | None = field(
        default=None,
        metadata=help_metadata(
            ALIGNED,
            "aligned policy: KV blocks of the decode device that the running batch lives in; "
            "the replica's cache beyond them stands for the host KV pool (default: the whole "
            "cache, no pool)",
        ),
    )
    running_seqs: int | None = field(
        default=None,
        metadata=help_metadata(
            ALIGNED,
            "aligned policy: most requests in the running batch (default: max_num_seqs, which "
            "then also bounds the pool)",
        ),
    )
    prefetch: bool = field(
        default=True,
        metadata=help_metadata(
            ALIGNED,
            "aligned policy: GPU prefetch: batches move into and out of the decode device over "
            "NVLink from the prefill device's buffers; off, over PCIe from host memory",
        ),
    )
    switch_on_room: bool = field(
        default=False,
        metadata=help_metadata(
            ALIGNED,
            "aligned policy: switch to the candidate batch whenever the running batch has room "
            "and no buffered request (Section 3.4's case 2 read literally); default: only once "
            "the running batch is too small to saturate the device, fewer than N_thr requests "
            "(Sections 3.2-3.3)",
        ),
    )
    widen: str = field(
        default="parent",
        metadata=help_metadata(
            ALIGNED,
            "aligned policy: case 3 of Algorithm 1, a length range that fits but holds fewer than "
            "N_thr requests: parent (take in its siblings under its parent, the left ones then "
            "the right ones) or climb (the paper's 'search bottom-up further': siblings nearest "
            "first, left and right in turn, then the parent's, up to the root, until N_thr)",
        ),
    )
    starvation_scope: str = field(
        default="oldest",
        metadata=help_metadata(
            ALIGNED,
            "aligned policy: whose time stamps the starvation rule reads: oldest (the subtrees "
            "over the longest-pooled request) or nodes (every internal node's, Section 3.5 as "
            "written: the subtree longest without a batch among those holding pooled requests)",
        ),
    )
    batching: str = field(
        default="dfs",
        metadata=help_metadata(
            ALIGNED,
            "aligned policy: how pooled requests become batches: dfs (prefix-aware, Algorithm 1) "
            "or fcfs (pool order; the paper's ablation without prefix-aware batching)",
        ),
    )

    def __post_init__(self) -> None:
        check_positive_seconds(self, ("starvation_s",), "aligned_")
        check_positive_ints(self, ("min_batch", "decode_blocks", "running_seqs"), "aligned_")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(
                f"aligned_memory_fraction must lie in (0, 1], got {self.memory_fraction!r}"
            )
        for name, allowed in (
            ("batching", ("dfs", "fcfs")),
            ("widen", ("parent", "climb")),
            ("starvation_scope", ("oldest", "nodes")),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"aligned_{name} must be {' or '.join(allowed)}, got {getattr(self, name)!r}"
                )


@dataclass
class PrioritySettings:
    """The priority policy's settings (flags --priority-*; priority_policy.py)."""

    base: str = field(
        default="fcfs",
        metadata=help_metadata(
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
        metadata=help_metadata(
            PRIORITY,
            "priority policy: before a batch forms, preempt running NORMAL and LOW decodes "
            "(LOW first, then those with the fewest tokens generated) while a REALTIME or HIGH "
            "decode's predicted TBT slack is below --priority-slo-risk-slack-s, until it is "
            "back above --priority-slo-risk-resume-s; the victims come back when there is room",
        ),
    )
    slo_risk_slack_s: float = field(
        default=0.015,
        metadata=help_metadata(
            PRIORITY,
            "priority policy: TBT slack (s) below which a REALTIME or HIGH decode is at risk "
            "(its TPOT target minus the time since its last token and the predicted next step)",
        ),
    )
    slo_risk_resume_s: float = field(
        default=0.030,
        metadata=help_metadata(
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
        check_positive_seconds(self, ("slo_risk_slack_s", "slo_risk_resume_s"), "priority_")
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
        metadata=help_metadata(
            PLA,
            "pla policy and dispatcher: prefills of fewer new tokens than this are short "
            "(default: L_m(H) from the paper's T_comp / T_mem model, calibrated to the model "
            "and device, H the prefix-cached history)",
        ),
    )
    memory_intercept: bool = field(
        default=True,
        metadata=help_metadata(
            PLA,
            "pla: calibrate T_mem with the weights' read as a constant term (off: the "
            "paper's T_mem = g_w L + g_r H as written, which puts L_m^prefill at 0 on GPUs)",
        ),
    )
    mode: str = field(
        default="sla",
        metadata=help_metadata(
            PLA,
            "pla: sla (W = min(W_SLA, W_GR) at every decision), awd (Algorithm 1's W and D "
            "updates alone) or token-max (deadline-free: a short batch goes once its padded "
            "tokens reach --pla-token-max-tokens)",
        ),
    )
    adaptive: bool = field(
        default=True,
        metadata=help_metadata(
            PLA, "pla: adapt W and D (off: wait --pla-w-max-s for the deepest captured depth)"
        ),
    )
    slack_s: float = field(
        default=0.01,
        metadata=help_metadata(
            PLA,
            "pla: sigma, dispatch the short batch at once when its smallest slack "
            "DDL - (t + S) falls to this (s; about one short batch)",
        ),
    )
    delta_s: float = field(
        default=0.01,
        metadata=help_metadata(PLA, "pla: delta, the safety margin of W_SLA (s)"),
    )
    w_min_s: float = field(default=0.0, metadata=help_metadata(PLA, "pla: W_min (s)"))
    w_max_s: float = field(
        default=0.05,
        metadata=help_metadata(
            PLA, "pla: W_max (s): the longest waiting window (an eighth of 0.4 s)"
        ),
    )
    t_max_s: float = field(
        default=0.1,
        metadata=help_metadata(
            PLA, "pla: T_max, the longest head-of-line wait of a short request (s)"
        ),
    )
    rate_floor: float = field(
        default=1.0,
        metadata=help_metadata(PLA, "pla: epsilon, the least short arrival rate in W_GR (1/s)"),
    )
    memory_tokens: int = field(
        default=16384,
        metadata=help_metadata(
            PLA,
            "pla: M, the token budget of a short batch padded to its graph shape (SGLang's "
            "default max_prefill_tokens)",
        ),
    )
    long_batch: str = field(
        default="one",
        metadata=help_metadata(
            PLA,
            "pla: one (the paper: a long-prefill batch advances a single request, in chunks of "
            "the packer's size) or all (long requests share a batch, as a unified queue's do)",
        ),
    )
    token_max_tokens: int = field(
        default=8192,
        metadata=help_metadata(
            PLA,
            "pla: M_s, token-max mode: a short batch goes once it holds this many padded "
            "tokens (SGLang's default chunked prefill size)",
        ),
    )

    def __post_init__(self) -> None:
        check_positive_seconds(self, ("w_max_s", "t_max_s"), "pla_")
        check_positive_ints(self, ("boundary_tokens", "memory_tokens", "token_max_tokens"), "pla_")
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
