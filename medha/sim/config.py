"""The cluster a simulation runs (`medha simulate` flags): a module of its own so that building
the CLI's parser imports neither the scheduler nor numpy."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ClusterConfig:
    model: str = field(default="llama-3-8b", metadata={"help": "model spec"})
    hardware: str = field(default="a100", metadata={"help": "device: a100, h100, h200 or cpu"})
    predictor: str = field(
        default="roofline",
        metadata={
            "help": (
                "batch-time model: roofline, roofline-padded (decode attention padded to the "
                "batch's longest context), profiled (bundled profile) or profiled:PATH"
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

    def __post_init__(self) -> None:
        if not isinstance(self.replicas, int) or self.replicas < 1:
            raise ValueError(f"replicas must be a positive integer, got {self.replicas!r}")
        # imported here, not above: the dispatchers bring the scheduler and numpy along
        from medha.sim.dispatchers import DISPATCHERS

        DISPATCHERS.get(self.dispatcher)
        if self.kv_memory_gb is not None and not self.kv_memory_gb > 0:
            raise ValueError(f"kv_memory_gb must be positive, got {self.kv_memory_gb!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must lie in (0, 1], got {self.gpu_memory_utilization!r}"
            )
