"""Performance models: what a batch costs on given hardware with a given parallel layout."""

from __future__ import annotations

import math

from medha.perf.hardware_specs import HardwareSpec, get_hardware
from medha.perf.model_specs import ModelSpec, get_model
from medha.perf.parallel_config import ParallelConfig
from medha.perf.predictor import BatchTimer, Predictor

PREDICTOR_HELP = (
    "batch-time model: roofline (analytic), roofline-padded (the same, with "
    "decode attention padded to the batch's longest context), roofline-cta[:GBPS] (the "
    "same, with decode attention no shorter than its longest thread block, one block "
    "streaming at GBPS), roofline-eager (the host's eager launch cost added), roofline-graph "
    "(the same, with CUDA graphs for short prefill batches: PLA-Serve's cost model), "
    "roofline-graph-min (graphs only where faster), profiled (fitted "
    "to the bundled profile of this model and hardware) or profiled:PATH (a "
    "profile written by `medha profile`, or a Vidur CSV table or directory)"
)


def make_predictor(
    spec: str,
    model: ModelSpec | str,
    hardware: HardwareSpec | str,
    parallel: ParallelConfig | None = None,
) -> Predictor:
    # Each kind imports its own module: the fitted one brings numpy and scipy along.
    model = get_model(model) if isinstance(model, str) else model
    hardware = get_hardware(hardware) if isinstance(hardware, str) else hardware
    parallel = parallel or ParallelConfig()
    kind, _, path = spec.partition(":")
    if kind == "roofline" and not path:
        from medha.perf.roofline_predictor import RooflinePredictor

        return RooflinePredictor(model, hardware, parallel)
    if kind == "roofline-padded" and not path:
        from medha.perf.padded_predictor import PaddedRooflinePredictor

        return PaddedRooflinePredictor(model, hardware, parallel)
    if kind == "roofline-cta":
        from medha.perf.cta_predictor import CtaRooflinePredictor

        # roofline-cta:GBPS sets one thread block's streaming rate (GB/s)
        gbps = None
        if path:
            try:
                gbps = float(path)
            except ValueError:
                gbps = None
            if gbps is None or not math.isfinite(gbps) or gbps <= 0:
                raise ValueError(
                    f"predictor {spec!r}: roofline-cta:GBPS takes a positive number of GB/s"
                )
        return CtaRooflinePredictor(model, hardware, parallel, gbps)
    if kind in ("roofline-eager", "roofline-graph", "roofline-graph-min") and not path:
        from medha.perf import graph_predictor as g

        cls = {
            "roofline-eager": g.EagerRooflinePredictor,
            "roofline-graph": g.GraphRooflinePredictor,
            "roofline-graph-min": g.CheaperGraphRooflinePredictor,
        }[kind]
        return cls(model, hardware, parallel)
    if kind == "profiled":
        from medha.perf.profile_data import bundled_profile, load_profile
        from medha.perf.profiled_predictor import ProfiledPredictor

        profile = load_profile(path) if path else bundled_profile(hardware.name, model.name)
        return ProfiledPredictor(model, hardware, parallel, profile)
    raise ValueError(
        f"unknown predictor {spec!r}; expected roofline, roofline-padded, roofline-cta, "
        "roofline-eager, roofline-graph, roofline-graph-min, "
        "profiled or profiled:PATH"
    )


__all__ = [
    "BatchTimer",
    "HardwareSpec",
    "ModelSpec",
    "ParallelConfig",
    "Predictor",
    "PREDICTOR_HELP",
    "get_hardware",
    "get_model",
    "make_predictor",
]
