"""The cluster a simulation runs (`medha simulate` flags): a module of its own so that building
the CLI's parser imports neither the scheduler nor numpy."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from medha.dispatch.config import DISPATCHER_NAMES, PlaDispatcherSettings
from medha.utils.dataclass_cli import from_flat
from medha.utils.registry import unknown_name

# The serving systems `medha simulate` models: medha's replicas (the scheduler under test), or
# the LoongServe baseline (medha/sim/baselines/loongserve.py), each its own simulator.
SYSTEM_NAMES = ("medha", "loongserve")
LOONGSERVE = "loongserve baseline"


def _loong_help(text: str) -> dict:
    return {"group": LOONGSERVE, "help": text}


@dataclass
class LoongServeSettings:
    """The LoongServe baseline's settings (flags --loong-*; medha/sim/baselines/loongserve.py):
    a pool of elastic instances, each one TP group of --tp devices, under LoongServe's global
    manager. The defaults, with --tp 2, are the Medha paper's setting (8 instances of TP2 on
    16 A100s, at most 4 instances per prefill); the tolerance and the batch cap are ours
    (docs/simulator.md)."""

    instances: int = field(
        default=8,
        metadata=_loong_help(
            "loongserve: elastic instances, each one TP group of --tp devices (instances x tp "
            "devices in all, filling nodes of the hardware's devices per node in order)"
        ),
    )
    max_degree: int = field(
        default=4,
        metadata=_loong_help(
            "loongserve: most instances one prefill iteration spreads over (elastic sequence "
            "parallelism; the paper's CP-4)"
        ),
    )
    degree_tolerance: float = field(
        default=0.1,
        metadata=_loong_help(
            "loongserve: a prefill takes the fewest instances whose predicted completion is "
            "within this share of the best one the free instances allow"
        ),
    )
    batch_tokens: int = field(
        default=8192,
        metadata=_loong_help(
            "loongserve: queued prompts join the head's prefill iteration, in arrival order, "
            "while the batch holds at most this many tokens (or the head's own, if more)"
        ),
    )
    reserved_short: int = field(
        default=0,
        metadata=_loong_help(
            "loongserve: instances reserved for short requests (Medha Fig. 14's +Reserv: 2); "
            "0 keeps one pool"
        ),
    )
    short_threshold: int = field(
        default=8192,
        metadata=_loong_help("loongserve: prompts shorter than this go to the reserved short pool"),
    )
    backfill: bool = field(
        default=False,
        metadata=_loong_help(
            "loongserve: while the head of the queue waits for instances, later requests may "
            "start on free ones its plan does not take or leaves idle until it starts (EASY "
            "backfilling); off: strict FCFS, the queue waits with its head"
        ),
    )
    prefill_every: int = field(
        default=0,
        metadata=_loong_help(
            "loongserve: start new prefills only in macro iterations, as LoongServe's released "
            "server does: one begins when no request decodes or after this many decode "
            "iterations since the last began (its --max_wait_tokens, 10 in its launch "
            "scripts), and while its prefills run, others start only on free instances and "
            "end before them; 0: a prefill starts whenever its instances are free"
        ),
    )
    ring: str = field(
        default="striped",
        metadata=_loong_help(
            "loongserve: how a prefill's ring attention splits the prompt: striped (token i on "
            "instance i mod degree, every ring step a causal block) or contiguous (the plain "
            "ring, whose last instance does twice a block's work each step: the Medha paper's "
            "Fig. 5b CP; medha/perf/ring_attention.py)"
        ),
    )

    def __post_init__(self) -> None:
        p = self.prefill_every
        if not (isinstance(p, int) and not isinstance(p, bool) and p >= 0):
            raise ValueError(f"loong_prefill_every must be an integer >= 0, got {p!r}")
        for name in ("instances", "max_degree", "batch_tokens", "short_threshold"):
            n = getattr(self, name)
            if not (isinstance(n, int) and not isinstance(n, bool) and n >= 1):
                raise ValueError(f"loong_{name} must be a positive integer, got {n!r}")
        if self.ring not in ("striped", "contiguous"):
            raise ValueError(f"loong_ring must be striped or contiguous, got {self.ring!r}")
        t = self.degree_tolerance
        if not (isinstance(t, (int, float)) and math.isfinite(t) and t >= 0):
            raise ValueError(f"loong_degree_tolerance must be a number >= 0, got {t!r}")
        if not isinstance(self.backfill, bool):
            raise ValueError(f"loong_backfill must be true or false, got {self.backfill!r}")
        k = self.reserved_short
        if not (isinstance(k, int) and not isinstance(k, bool) and 0 <= k < self.instances):
            raise ValueError(
                f"loong_reserved_short must be an integer in [0, loong_instances = "
                f"{self.instances}) (the long pool keeps at least one), got {k!r}"
            )


@dataclass
class ClusterConfig:
    model: str = field(default="llama-3-8b", metadata={"help": "model spec"})
    hardware: str = field(default="a100", metadata={"help": "device: a100, h100, h200 or cpu"})
    predictor: str = field(
        default="roofline",
        metadata={
            "help": (
                "batch-time model: roofline, roofline-padded (decode attention padded to the "
                "batch's longest context), roofline-cta (decode attention no shorter than its "
                "longest thread block), roofline-eager / roofline-graph (the host's eager "
                "launch cost; -graph also CUDA graphs for short prefill batches), profiled "
                "(bundled profile) or profiled:PATH"
            )
        },
    )
    replicas: int = field(
        default=1,
        metadata={"help": ("replicas behind the dispatcher; each has tp x spp x kvp devices")},
    )
    dispatcher: str = field(
        default="round_robin",
        metadata={
            "help": (
                "how requests are spread over replicas (the same classes as `medha route "
                "--dispatcher`): round_robin; least_work (least outstanding predicted work); "
                "prefix (the longest cached prefix among replicas within one least TTFT "
                "deadline of the least work); slack (the replica that keeps the smallest "
                "relative TTFT slack of all waiting requests highest, cache and queue "
                "predicted); pla (PLA-Serve: replicas in a short- and a long-prefill pool, "
                "requests routed by prompt length, an instance-pressure controller moving "
                "replicas between the pools; --pla-* flags)"
            )
        },
    )
    kv_memory_gb: float | None = field(
        default=None,
        metadata={
            "help": (
                "KV cache memory per device in GiB (default: device memory x utilization - weights)"
            )
        },
    )
    gpu_memory_utilization: float = field(
        default=0.9, metadata={"help": ("share of device memory for weights and KV cache")}
    )
    pla: PlaDispatcherSettings = field(
        default_factory=lambda: PlaDispatcherSettings(), metadata={"flag_prefix": "pla_"}
    )
    system: str = field(
        default="medha",
        metadata={
            "help": (
                "the serving system simulated: medha (replicas running the scheduler above) or "
                "loongserve (the LoongServe baseline: elastic sequence parallelism over "
                "--loong-instances TP groups of --tp devices, non-preemptive FCFS; --loong-* "
                "flags; the scheduler flags other than the TTFT deadline and TPOT target, and "
                "--replicas, --dispatcher, --spp, --kvp, do not apply)"
            ),
            "choices": SYSTEM_NAMES,
        },
    )
    loong: LoongServeSettings = field(
        default_factory=lambda: LoongServeSettings(), metadata={"flag_prefix": "loong_"}
    )

    @classmethod
    def from_flat(cls, **settings) -> ClusterConfig:
        """A config from the flat setting names of its flags (`pla_window_s` for
        `pla.window_s`); ValueError for an unknown one."""
        return from_flat(cls, settings)

    def __post_init__(self) -> None:
        if isinstance(self.pla, dict):  # given as a mapping (from YAML, say)
            self.pla = PlaDispatcherSettings(**self.pla)
        if isinstance(self.loong, dict):
            self.loong = LoongServeSettings(**self.loong)
        if self.system not in SYSTEM_NAMES:
            raise unknown_name("system", self.system, SYSTEM_NAMES)
        if self.system == "loongserve":
            # LoongServe's global manager spreads requests itself over its instances
            if self.replicas != 1:
                raise ValueError(
                    "replicas does not apply to the loongserve system: set loong_instances"
                )
            if self.dispatcher != "round_robin":
                raise ValueError(
                    "dispatcher does not apply to the loongserve system (its global manager "
                    "places every request)"
                )
        if not isinstance(self.replicas, int) or self.replicas < 1:
            raise ValueError(f"replicas must be a positive integer, got {self.replicas!r}")
        if self.dispatcher not in DISPATCHER_NAMES:
            raise unknown_name("dispatcher", self.dispatcher, DISPATCHER_NAMES)
        if self.kv_memory_gb is not None and not self.kv_memory_gb > 0:
            raise ValueError(f"kv_memory_gb must be positive, got {self.kv_memory_gb!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must lie in (0, 1], got {self.gpu_memory_utilization!r}"
            )
