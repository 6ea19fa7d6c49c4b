from medha.dispatch.base_dispatcher import DISPATCHERS, Dispatcher, least_work


@DISPATCHERS.register("least_work")
class LeastWorkDispatcher(Dispatcher):
    """The replica with the least outstanding predicted work (ties: the lowest id)."""

    def pick(self, request, now, candidates=None):
        return least_work(candidates or self.replicas)
