from medha.dispatch.base_dispatcher import DISPATCHERS, Dispatcher


@DISPATCHERS.register("round_robin")
class RoundRobinDispatcher(Dispatcher):
    """Each replica in turn; one left out of `candidates` (unhealthy, or tried) is passed over."""

    def __init__(self, replicas, cluster, scheduler) -> None:
        super().__init__(replicas, cluster, scheduler)
        self._next = 0

    def pick(self, request, now, candidates=None):
        allowed = None if candidates is None else {r.replica_id for r in candidates}
        n = len(self.replicas)
        for step in range(n):
            replica = self.replicas[(self._next + step) % n]
            if allowed is None or replica.replica_id in allowed:
                self._next = (self._next + step + 1) % n
                return replica
        raise ValueError("no candidate replica")
