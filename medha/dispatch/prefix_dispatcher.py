"""Cache affinity bounded by load.

Among the replicas whose outstanding predicted work is within one least TTFT deadline of the
least loaded one's (the scheduler's `min_ttft_deadline_s`: a replica further behind than that
would cost a short request its whole allowance before it starts), the one whose prefix cache
holds the longest prefix of the prompt's chained block keys; ties go to the least work. The
bound is per candidate, so a hot system prompt every replica holds splits by load, and one that
a single replica holds keeps its requests only while that replica is not overloaded (the
complaint about cache-aware routers: one shared prompt pulls all traffic onto one replica).
"""

from medha.dispatch.base_dispatcher import DISPATCHERS, Dispatcher


@DISPATCHERS.register("prefix")
class PrefixDispatcher(Dispatcher):
    def __init__(self, replicas, cluster, scheduler) -> None:
        super().__init__(replicas, cluster, scheduler)
        self.bound_s = scheduler.min_ttft_deadline_s

    def pick(self, request, now, candidates=None):
        candidates = candidates or self.replicas
        work = {r.replica_id: r.outstanding_work_s() for r in candidates}
        floor = min(work.values())
        eligible = [r for r in candidates if work[r.replica_id] <= floor + self.bound_s]
        return max(
            eligible,
            key=lambda r: (r.cached_tokens(request), -work[r.replica_id], -r.replica_id),
        )
