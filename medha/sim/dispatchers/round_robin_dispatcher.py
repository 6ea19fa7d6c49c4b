from medha.sim.dispatchers.base_dispatcher import DISPATCHERS, Dispatcher


@DISPATCHERS.register("round_robin")
class RoundRobinDispatcher(Dispatcher):
    def __init__(self, replicas, cluster, scheduler) -> None:
        super().__init__(replicas, cluster, scheduler)
        self._next = 0

    def pick(self, request, now):
        replica = self.replicas[self._next]
        self._next = (self._next + 1) % len(self.replicas)
        return replica
