"""Global dispatch: which replica a new request goes to.

One dispatcher class serves two fronts: `medha simulate --replicas N --dispatcher X`, where each
replica is a SimReplica over the real scheduler, and `medha route --dispatcher X`, where each is
the router's model of a real server (medha/route/tracked.py), fed by what the router sees: the
requests it sent, their first tokens and ends, the prefix blocks it sent each replica. Both
implement `ReplicaView`, all a dispatcher reads; neither front's internals reach a dispatcher.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Protocol

from medha.core.request import DEFAULT_PRIORITY_RANK, Request
from medha.dispatch.config import DispatchSettings
from medha.perf.predictor import Predictor
from medha.scheduler.config import SchedulerConfig
from medha.utils.registry import Registry


@dataclass(frozen=True, slots=True)
class Pending:
    """A request a replica holds that has not had its first token: what its TTFT still waits
    for, under the names a Request has for what the replica's rules (replica_rules) and its
    policy's key read. `deadline_s` is absolute; `work_s` the predicted prefill time still
    ahead of it, `total_work_s` its whole prefill's (what it had when admitted);
    `num_uncached_tokens` and `started` as the Request's (nothing is cached before it starts:
    a replica looks a request up just before its first chunk)."""

    request_id: str
    arrival_s: float
    deadline_s: float
    work_s: float
    total_work_s: float
    num_uncached_tokens: int
    started: bool = False
    priority_rank: int = DEFAULT_PRIORITY_RANK
    ttft_deadline_s: float | None = None  # its own TTFT deadline, relative, if it set one

    @classmethod
    def of(cls, r: Request) -> Pending:
        """A replica's own request, as it stands."""
        return cls(
            r.request_id,
            r.arrival_s,
            r.deadline_s,
            r.remaining_work_s,
            r.total_work_s,
            r.num_uncached_tokens,
            r.started,
            r.priority_rank,
            r.ttft_deadline_s,
        )

    @property
    def remaining_work_s(self) -> float:
        return self.work_s

    slack = Request.slack
    relative_slack = Request.relative_slack


class ReplicaView(Protocol):
    """What a dispatcher knows of one replica."""

    replica_id: int
    predictor: Predictor
    prefix_caching: bool
    # The replica's resolved scheduler config (its policy and deadline rule).
    scheduler_config: SchedulerConfig

    def outstanding_work_s(self) -> float:
        """Predicted prefill work still ahead plus the decode tokens still to generate."""

    def pending(self, now: float) -> list[Pending]:
        """Its requests still waiting for their first token, with their work left at `now`."""

    def iteration_left_s(self, now: float) -> float:
        """How long a request sent now waits for the iteration the replica is running to end
        (the simulator knows; the router expects half an iteration of what it runs)."""

    def prefill_stretch(self) -> float:
        """Wall seconds a second of its predicted prefill work takes now: its decodes' share
        of each iteration (`DecodeShare`), and on the router what it has measured of the
        replica against its profile (1 in the simulator, where the profile is the truth)."""

    def busy(self) -> bool:
        """Whether it is computing anything now."""

    def cached_tokens(self, request: Request) -> int:
        """Prompt tokens of `request` its prefix cache holds (as far as is known)."""

    def prefill_work_s(self, request: Request, cached: int) -> float:
        """Predicted prefill time of `request` with `cached` prompt tokens already cached."""

    def progress(self, request: Request) -> tuple[float | None, float, bool]:
        """Of `request`, which this replica was given: when it got its first token (None: not
        yet), its absolute TTFT deadline, and whether it has ended."""


def decode_token_s(predictor: Predictor) -> float:
    """Work of one decode token in a typical batch (32 decodes at 4K context): what a token
    still to generate adds to a replica's outstanding work."""
    return predictor.shape_time((), [4096] * 32) / 32


class DecodeShare:
    """How much slower prefill work goes while decodes share the iterations.

    The replica's packer fills each iteration up to its time budget: its decodes, then as much
    of a prefill chunk as fits. A decode beside a chunk costs only its marginal time (the
    weights are read once for the whole batch; its own attention and token), so the stretch is
    budget / (budget - marginal time of the decodes beside a chunk that fills the budget
    alone), never more than 1 / (1 - `MAX_SHARE`): whatever the decodes, a replica's packer
    keeps room for prefill. Priced at the decodes' mean context, by count and context rounded
    to 256 tokens (cached: the router asks at every dispatch)."""

    MAX_SHARE = 0.5

    def __init__(self, predictor: Predictor, budget_s: float | None) -> None:
        self.predictor = predictor
        self.budget_s = budget_s if budget_s and budget_s > 0 else None
        self._chunk = self._full_chunk() if self.budget_s else 0
        self._cache: dict[tuple[int, int], tuple[float, float]] = {}

    def _full_chunk(self) -> int:
        """The largest prefill chunk (of a fresh prompt) that fits the budget alone."""
        p, lo, hi = self.predictor, 1, 1
        while hi < (1 << 20) and p.shape_time([(hi, 0)], ()) <= self.budget_s:
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if p.shape_time([(mid, 0)], ()) <= self.budget_s else (lo, mid)
        return lo

    def _priced(self, contexts: list[int]) -> tuple[float, float]:
        """(stretch, one iteration of these decodes alone)."""
        n, ctx = len(contexts), max(1, 256 * round(sum(contexts) / len(contexts) / 256))
        priced = self._cache.get((n, ctx))
        if priced is None:
            p, decodes = self.predictor, [ctx] * n
            stretch = 1.0
            if self.budget_s is not None:
                chunk = [(self._chunk, 0)]
                marginal = max(0.0, p.shape_time(chunk, decodes) - p.shape_time(chunk, ()))
                stretch = 1.0 / (1.0 - min(self.MAX_SHARE, marginal / self.budget_s))
            priced = self._cache[(n, ctx)] = (stretch, p.shape_time((), decodes))
        return priced

    def stretch(self, contexts: list[int]) -> float:
        return self._priced(contexts)[0] if contexts else 1.0

    def decode_iteration_s(self, contexts: list[int]) -> float:
        """One iteration of these decodes alone."""
        return self._priced(contexts)[1] if contexts else 0.0


class Dispatcher(ABC):
    name: ClassVar[str]

    def __init__(
        self, replicas: list[ReplicaView], cluster: DispatchSettings, scheduler: SchedulerConfig
    ) -> None:
        """`cluster` carries the dispatcher's own settings (the simulator's ClusterConfig, the
        router's BareDispatchSettings); `scheduler` is the deployment's (resolved) scheduler
        config, what every replica runs, for the settings a dispatcher shares with a policy
        (the pla boundary)."""
        self.replicas = replicas
        # The last `pick`'s predicted first-token time (absolute) of its request on the replica
        # it chose, for a dispatcher that predicts one (slack), else None: the router passes it
        # on to the client (x-medha-predicted-ttft-ms), to be checked against what happened.
        self.predicted_first_token_s: float | None = None
        # Seconds of predicted first-token time its caller cannot tell apart: the router's
        # measured prediction error (`medha route` sets it as first tokens come); 0 in the
        # simulator, where the prediction is the truth. A dispatcher that predicts (slack)
        # breaks ties within it by the replica time a choice spends (slack_dispatcher.py).
        self.tolerance_s = 0.0
        self.tie_broken = False  # whether the tolerance changed the last `pick`'s choice

    @abstractmethod
    def pick(
        self, request: Request, now: float, candidates: list[ReplicaView] | None = None
    ) -> ReplicaView:
        """The replica that admits `request`, one of `candidates` (default: every replica;
        the router leaves out the unhealthy ones and those a retry has tried)."""

    # ---- a dispatcher that holds requests and runs on a clock (the simulator; medha route) -----
    # Defaults for a dispatcher that pushes each request to a replica at its arrival. One that
    # keeps queues of its own (pla on several instances: the paper's instances pull from their
    # class's queue) overrides all three.
    control_period_s: float | None = None
    """Every how many seconds `tick` runs, arrivals or not (None: never)."""
    pulls: bool = False
    """Whether `route` holds requests for replicas to `pull` (else it places them)."""

    def route(self, request: Request, now: float) -> ReplicaView | None:
        """Where `request` goes at its arrival: a replica (`pick`'s), or None when the
        dispatcher keeps it until a replica pulls it (`pull`)."""
        return self.pick(request, now)

    def pull(self, ready: list[ReplicaView], now: float) -> dict[int, list[Request]]:
        """The held requests each of `ready` (replicas about to form a batch) takes now, by
        replica id."""
        return {}

    def held(self) -> int:
        """Requests the dispatcher holds (none of them on a replica yet)."""
        return 0

    def drop(self, request_id: str) -> bool:
        """Take a held request back (whether it was held)."""
        return False

    def tick(self, now: float) -> None:
        """The periodic control (every `control_period_s`)."""
        return None


def ttft_deadline_s(config: SchedulerConfig, request: Request, replica: ReplicaView) -> float:
    """`request`'s absolute TTFT deadline as the replicas set it: its own target, else the
    scheduler's rule over its whole prefill alone (the same on every replica)."""
    alone = replica.prefill_work_s(request, 0)
    return request.arrival_s + config.ttft_allowed_s(request.ttft_deadline_s, alone)


def least_work(candidates: list[ReplicaView]) -> ReplicaView:
    """The replica with the least outstanding predicted work (ties: the lowest id)."""
    return min(candidates, key=lambda r: (r.outstanding_work_s(), r.replica_id))


DISPATCHERS: Registry[Dispatcher] = Registry("dispatcher", __package__, suffix="_dispatcher")
