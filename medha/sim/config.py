"""The cluster a simulation runs (`medha simulate` flags): a module of its own so that building
the CLI's parser imports neither the scheduler nor numpy."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from medha.utils.dataclass_cli import from_flat
from medha.utils.registry import unknown_name

# The dispatchers by name, each implemented by one module of medha/sim/dispatchers that registers
# under it: listed here so that a config is checked without importing the dispatchers (and the
# scheduler and numpy they bring); tests/test_simulator.py keeps the list and the registry equal.
DISPATCHER_NAMES = ("round_robin", "least_work", "pla")
PLA_DISPATCHER = "pla dispatcher"


def _help(text: str) -> dict:
    return {"group": PLA_DISPATCHER, "help": text}


PLA_AGGREGATORS = ("p90", "mean", "max")


@dataclass
class PlaDispatcherSettings:
    """The pla dispatcher's settings (flags --pla-*; medha/sim/dispatchers/pla_dispatcher.py):
    the instance-pressure controller of PLA-Serve's Algorithm 2. The paper names the
    parameters and the P90 aggregate, no values; the defaults are ours. Its short/long boundary
    L_m is the pla policy's (SchedulerConfig.pla)."""

    long_instances: int | None = field(
        default=None,
        metadata=_help(
            "pla dispatcher: instances that start in the long-prefill pool, the rest serve short "
            "prefills (default: max(1, replicas / 4))",
        ),
    )
    queue_unit_s: float = field(
        default=0.4,
        metadata=_help(
            "pla dispatcher: seconds of queued prefill work that make q = 1 (the paper's 0.4 s "
            "TTFT SLO; a fixed unit, so that q still counts without deadlines)"
        ),
    )
    weight_queue: float = field(
        default=1.0,
        metadata=_help(
            "pla dispatcher: alpha, weight of the queue q (queued prefill work / queue unit) "
            "in an instance's pressure psi = alpha q + beta e - gamma u"
        ),
    )
    weight_slo: float = field(
        default=1.0,
        metadata=_help("pla dispatcher: beta, weight of the SLA deviation e (TTFT / deadline)"),
    )
    weight_util: float = field(
        default=0.5,
        metadata=_help(
            "pla dispatcher: gamma, weight of the GPU utilisation u (busy share), subtracted"
        ),
    )
    aggregator: str = field(
        default="p90",
        metadata=_help("pla dispatcher: A, a pool's pressure from its instances': p90, mean, max"),
    )
    tau: float = field(
        default=0.2,
        metadata=_help(
            "pla dispatcher: hysteresis tau: an instance moves to a pool whose pressure "
            "exceeds (1 + tau) x the other's"
        ),
    )
    n_min: int = field(
        default=1, metadata=_help("pla dispatcher: n_min, the fewest instances a pool keeps")
    )
    cooldown_s: float = field(
        default=5.0,
        metadata=_help("pla dispatcher: T_cool, least time (s) between two instance moves"),
    )
    period_s: float = field(
        default=0.5, metadata=_help("pla dispatcher: the control period Delta t (s)")
    )
    window_s: float = field(
        default=2.0,
        metadata=_help(
            "pla dispatcher: requests dispatched this recently (s), or still waiting for their "
            "first token, make up an instance's SLA deviation",
        ),
    )

    def __post_init__(self) -> None:
        for name in ("cooldown_s", "window_s", "period_s", "queue_unit_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"pla_{name} must be a positive number, got {value!r}")
        for name in ("weight_queue", "weight_slo", "weight_util", "tau"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"pla_{name} must be a number >= 0, got {value!r}")
        for name in ("long_instances", "n_min"):
            n = getattr(self, name)
            if n is not None and not (isinstance(n, int) and n >= 1):
                raise ValueError(f"pla_{name} must be a positive integer, got {n!r}")
        if self.aggregator not in PLA_AGGREGATORS:
            raise unknown_name("pla_aggregator", self.aggregator, PLA_AGGREGATORS)


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
                "how requests are spread over replicas: round_robin, least_work, or pla "
                "(PLA-Serve: replicas in a short- and a long-prefill pool, requests routed by "
                "prompt length, an instance-pressure controller moving replicas between the pools; "
                "--pla-* flags)"
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

    @classmethod
    def from_flat(cls, **settings) -> ClusterConfig:
        """A config from the flat setting names of its flags (`pla_window_s` for
        `pla.window_s`); ValueError for an unknown one."""
        return from_flat(cls, settings)

    def __post_init__(self) -> None:
        if isinstance(self.pla, dict):  # given as a mapping (from YAML, say)
            self.pla = PlaDispatcherSettings(**self.pla)
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
