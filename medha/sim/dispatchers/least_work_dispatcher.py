from medha.sim.dispatchers.base_dispatcher import DISPATCHERS, Dispatcher


@DISPATCHERS.register("least_work")
class LeastWorkDispatcher(Dispatcher):
    """The replica with the least outstanding predicted work (ties: the lowest id)."""

    def pick(self, request, now):
        return min(self.replicas, key=lambda r: (r.outstanding_work_s(), r.replica_id))
