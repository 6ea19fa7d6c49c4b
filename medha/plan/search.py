"""The plan's simulations: what one point runs, the chains that decide the next point from the
last result, and the backends (one process, a process pool, Ray) that run them.

A chain is a generator: it yields a point, receives that point's result, and decides what to
run next, so pruning is written where it is decided:
- along the replica axis, a deployment that meets every SLO with n replicas ends its chain
  (more replicas cost more and can only do better);
- along the rate axis, the capacity search doubles the trace's rate until an SLO breaks and
  then bisects, since a deployment that misses an SLO at rate r misses it above r.
Chains only see their own results, so the answer does not depend on which worker finishes
first. Every result is appended to the results file as it arrives; a rerun takes the points it
finds there instead of simulating them again.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable, Generator, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass
from pathlib import Path

from medha.plan.slo import METRICS, Slo

Result = dict
Chain = Generator[dict, Result, None]


@dataclass(frozen=True)
class Fixed:
    """What every simulation of one plan shares: the model, the trace and how it is read."""

    model: str
    trace: str
    num_requests: int | None = None
    qps: float | None = None
    long_fraction: float = 0.0
    seed: int = 0
    predictor: str = "roofline"
    long_threshold: int | None = None

    def key(self) -> str:
        return _digest(asdict(self))

    def workload(self, rate: float = 1.0):
        """The trace at `rate` times its own request rate (its qps, or its timestamps)."""
        from medha.sim.workload.generator import WorkloadConfig

        return WorkloadConfig(
            trace=self.trace,
            num_requests=self.num_requests,
            qps=self.qps * rate if self.qps else None,
            time_scale=1.0 if self.qps else 1.0 / rate,
            long_fraction=self.long_fraction,
            seed=self.seed,
        )


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def point_key(point: dict) -> str:
    """One key per distinct simulation: with one replica every dispatcher sends every request
    to it (pla too: a lone replica has no pools), so those points are one."""
    if point["replicas"] == 1:
        point = {**point, "dispatcher": "round_robin"}
    return _digest(point)


def evaluate(fixed: dict, point: dict) -> Result:
    """Simulate one point; a deployment that cannot run (it does not fit, a layout the model
    does not divide into) comes back as {"error": why}, never as an exception."""
    from medha.perf import ParallelConfig
    from medha.plan.space import scheduler_fields
    from medha.scheduler.config import SchedulerConfig
    from medha.sim.config import ClusterConfig
    from medha.sim.runner import RunSpec, simulate

    f = Fixed(**fixed)
    try:
        spec = RunSpec(
            cluster=ClusterConfig(
                model=f.model,
                hardware=point["hardware"],
                predictor=f.predictor,
                replicas=point["replicas"],
                dispatcher=point["dispatcher"],
                kv_memory_gb=point["kv_memory_gb"],
            ),
            parallel=ParallelConfig(tp=point["tp"], spp=point["spp"], kvp=point["kvp"]),
            scheduler=SchedulerConfig(
                **scheduler_fields(point["scheduler"]),
                iteration_budget_s=point["iteration_budget_s"],
            ),
            long_threshold=f.long_threshold,
        )
        summary = simulate(spec, f.workload(point["rate"])).summary
    except (ValueError, RuntimeError) as e:  # RuntimeError: a simulation that stalls
        return {"error": f"{type(e).__name__}: {e}"}
    keep = ("requests", "slo_attainment", "throughput", *METRICS.values())
    out = {k: summary[k] for k in keep if k in summary}
    out["by_class"] = {
        c: {k: v for k, v in d.items() if k in METRICS.values() or k == "count"}
        for c, d in summary["by_class"].items()
    }
    out["sim_wall_s"] = summary["sim"]["wall_s"]
    return out


def meets(result: Result, slos: Iterable[Slo]) -> bool:
    if "error" in result:
        return False
    req = result["requests"]
    if req["completed"] < req["total"]:  # a request left unfinished misses every SLO
        return False
    return all(s.value(result) <= s.target_s for s in slos)


# ---- chains ------------------------------------------------------------------------------------
@dataclass
class ChainLog:
    """What a chain ran and what it skipped, for the report."""

    simulated: list[tuple[dict, Result]]
    pruned_dominated: int = 0
    pruned_budget: int = 0
    pruned_invalid: int = 0
    capacity: float | None = None
    capacity_capped: bool = False  # it still met every SLO at --max-rate: "at least"


def replicas_chain(
    chain: list[dict], ok: Callable[[Result], bool], max_cost, cost, log: ChainLog
) -> Chain:
    """One deployment at ascending replica counts, up to the first that meets every SLO."""
    for i, point in enumerate(chain):
        if max_cost is not None and cost(point) > max_cost:
            log.pruned_budget += len(chain) - i  # replicas ascend: the rest cost more still
            return
        result = yield {**point, "rate": 1.0}
        log.simulated.append((point, result))
        rest = len(chain) - i - 1
        if "error" in result:
            log.pruned_invalid += rest  # does not fit or divide: more replicas change neither
            return
        if ok(result):
            log.pruned_dominated += rest
            return


def capacity_chain(
    point: dict, ok: Callable[[Result], bool], log: ChainLog, max_rate: float, steps: int
) -> Chain:
    """The highest multiple of the trace's rate at which `point` still meets every SLO (it meets
    them at 1x): double until one breaks, then bisect in log space."""
    lo, hi = 1.0, None
    rate = 2.0
    while rate <= max_rate:
        result = yield {**point, "rate": rate}
        log.simulated.append(({**point, "rate": rate}, result))
        if not ok(result):
            hi = rate
            break
        lo, rate = rate, rate * 2
    if hi is None:
        log.capacity_capped = True
    else:
        for _ in range(steps):
            mid = _round(math.sqrt(lo * hi))
            result = yield {**point, "rate": mid}
            log.simulated.append(({**point, "rate": mid}, result))
            lo, hi = (mid, hi) if ok(result) else (lo, mid)
    log.capacity = lo


def capacity_search(
    run_at: Callable[[float], Result],
    ok: Callable[[Result], bool],
    base: float,
    max_rate: float,
    steps: int,
    halvings: int = 4,
) -> tuple[float, bool]:
    """The highest rate (of requests per second, or any other scale) at which `ok(run_at(rate))`
    holds, outside `medha plan`'s grid: the base is halved up to `halvings` times until it
    holds (0.0 if it never does), then `capacity_chain` doubles and bisects from there, up to
    `max_rate`. Returns the rate and whether it still held at `max_rate` (then "at least")."""
    for _ in range(halvings + 1):
        if ok(run_at(base)):
            break
        base /= 2
    else:
        return 0.0, False
    log = ChainLog(simulated=[])
    chain = capacity_chain({}, ok, log, max_rate / base, steps)
    try:
        point = next(chain)
        while True:
            point = chain.send(run_at(base * point["rate"]))
    except StopIteration:
        pass
    return base * log.capacity, log.capacity_capped


def _round(x: float) -> float:
    return float(f"{x:.4g}")  # one key per rate, whatever the float arithmetic gave


# ---- backends ---------------------------------------------------------------------------------
class Backend:
    """Runs evaluate(fixed, point) somewhere and hands back a concurrent.futures.Future."""

    name = "serial"
    workers = 1

    def submit(self, fixed: dict, point: dict) -> Future:
        fut: Future = Future()
        fut.set_result(evaluate(fixed, point))
        return fut

    def close(self) -> None:
        pass


class ProcessBackend(Backend):
    name = "processes"

    def __init__(self, workers: int) -> None:
        import multiprocessing

        self.workers = workers
        # spawn: a fresh interpreter per worker, nothing inherited half-initialised
        self.pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))

    def submit(self, fixed: dict, point: dict) -> Future:
        return self.pool.submit(evaluate, fixed, point)

    def close(self) -> None:
        self.pool.shutdown(cancel_futures=True)


class RayBackend(Backend):
    name = "ray"

    def __init__(self, workers: int, address: str | None) -> None:
        import ray

        if not ray.is_initialized():
            kwargs = dict(include_dashboard=False, log_to_driver=False, logging_level="ERROR")
            if address:
                ray.init(address=address, **kwargs)
            else:  # "local": a fresh instance, never RAY_ADDRESS's or the last `ray start`'s
                ray.init(address="local", num_cpus=workers, **kwargs)
        self.ray = ray
        self.workers = int(ray.cluster_resources().get("CPU", workers))
        self.remote = ray.remote(num_cpus=1)(evaluate)

    def submit(self, fixed: dict, point: dict) -> Future:
        return self.remote.remote(fixed, point).future()

    def close(self) -> None:
        self.ray.shutdown()


def make_backend(kind: str, workers: int | None, address: str | None) -> Backend:
    workers = workers or len(os.sched_getaffinity(0))
    if kind == "auto":
        try:
            import ray  # noqa: F401

            kind = "ray"
        except ImportError:
            kind = "processes" if workers > 1 else "serial"
    if kind == "ray":
        return RayBackend(workers, address)
    if address:
        raise ValueError("--ray-address needs the ray backend")
    if kind == "processes":
        return ProcessBackend(workers)
    if kind == "serial":
        return Backend()
    raise ValueError(f"backend: {kind!r} is not auto, ray, processes or serial")


# ---- the driver -------------------------------------------------------------------------------
class Runner:
    """Drives chains on a backend, taking finished points from the results file first."""

    def __init__(self, fixed: Fixed, backend: Backend, results: Path, progress=None) -> None:
        self.fixed, self.backend, self.results, self.progress = fixed, backend, results, progress
        self.cache: dict[str, Result] = {}
        self.points: dict[str, dict] = {}  # key -> the point, for the results file
        self.simulated = self.reused = 0
        fkey = fixed.key()
        if results.is_file():
            for line in results.read_text().splitlines():
                try:
                    row = json.loads(line)
                except ValueError:
                    continue  # a line cut short when the last run was interrupted
                if isinstance(row, dict) and row.get("fixed") == fkey and "result" in row:
                    self.cache[row["key"]] = row["result"]
        self._fkey = fkey

    def run(self, chains: list[Chain]) -> None:
        fixed = asdict(self.fixed)
        inflight: dict[str, tuple[Future, list[Chain]]] = {}
        with self.results.open("a") as log:

            def advance(chain: Chain, result: Result | None) -> None:
                while True:
                    try:
                        point = chain.send(result)
                    except StopIteration:
                        return
                    key = point_key(point)
                    if key in self.cache:
                        self.reused += 1
                        result = self.cache[key]
                        continue
                    if key in inflight:  # the same simulation, asked for by another chain
                        self.reused += 1
                        inflight[key][1].append(chain)
                    else:
                        inflight[key] = (self.backend.submit(fixed, point), [chain])
                        self.points[key] = point
                    return

            for chain in chains:
                advance(chain, None)
            while inflight:
                done, _ = wait([f for f, _ in inflight.values()], return_when=FIRST_COMPLETED)
                for key in sorted(k for k, (f, _) in inflight.items() if f in done):
                    fut, waiting = inflight.pop(key)
                    result = fut.result()
                    self.cache[key] = result
                    self.simulated += 1
                    row = {"fixed": self._fkey, "key": key, "point": self.points[key]}
                    log.write(json.dumps({**row, "result": result}) + "\n")
                    log.flush()
                    if self.progress is not None:
                        self.progress.update(1)
                    for chain in waiting:
                        advance(chain, result)
