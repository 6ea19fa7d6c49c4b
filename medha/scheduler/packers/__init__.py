from medha.scheduler.packers.base_packer import (
    PACKERS,
    Packer,
    make_packer,
    replica_policy,
    replica_prefill_times,
)

__all__ = ["PACKERS", "Packer", "make_packer", "replica_policy", "replica_prefill_times"]
