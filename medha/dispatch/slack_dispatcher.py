"""No request left behind, across the cluster: the replica that keeps the smallest relative slack
of every request still waiting for its first token highest.

For each candidate replica the dispatcher predicts when each request it holds that has no first
token yet, and the new one, would get its first token: once the iteration it is running ends
(`ReplicaView.iteration_left_s`), the replica works through their remaining prefill work in
the order its scheduler would (a short prefill under way first, then its policy's key: LARS's
relative slack by default), slowed by the share of each iteration its decodes take
(`ReplicaView.prefill_stretch`; on the router also by the replica's measured speed). A
request's relative slack is the part of its TTFT allowance left at its predicted first token,
(deadline - first token) / (deadline - arrival): 1 for one served at once, 0 at its deadline,
negative past it. Sending the new request to a replica changes only that replica's requests,
so the cluster's smallest relative slack if it goes to replica A is min(A's smallest with it,
every other replica's smallest without it); the dispatcher takes the replica that maximises
this. When a request already late elsewhere decides that minimum for every choice, the
new request's own predicted TTFT decides (then the least outstanding work).

A prediction is only as good as the model of the replica: on the router, choices whose smallest
relative slack lies within the router's measured prediction error of the best one
(`tolerance_s`, the recent median of |first token - predicted|, over the new request's
allowance) are a tie the model cannot break, and the tie goes to the choice that spends the
least replica time on the new request (the one that holds its prefix): that time is what the
next arrival may need (llm-d's "sticky until saturated", with a measured tolerance rather than
a tuned one). A prompt those choices' caches cannot tell apart (none holds any of it, or all
the same part: a new conversation under a shared system prompt), which they spend the same on
(within the tolerance too), goes to the one this dispatcher sent fewest of its last 64 picks:
a conversation's next turns follow its first, and a replica sent more turns decodes more of
them, which stretches every prefill there (the slack of this instant cannot see that; placed
by it alone, new conversations piled up 12 to 5 on the replica free at their start). In the
simulator the model is the truth and the tolerance is 0.

The new request's work on a replica is the prefill of what that replica's prefix cache does not
hold, so cache affinity, queue length and the policy's order meet in one number, with no weight
to tune per workload. Its deadline is the one the replicas would give it (its own TTFT target,
else the scheduler's rule on its whole prefill), the same on every replica.
"""

from __future__ import annotations

import heapq
import math
from collections import deque

from medha.dispatch.base_dispatcher import (
    DISPATCHERS,
    Dispatcher,
    Pending,
    ReplicaView,
    ttft_deadline_s,
)
from medha.scheduler.packers import replica_policy
from medha.scheduler.replica_rules import prefill_order

RECENT_PICKS = 64


def relative_slack(p: Pending, first_token_s: float) -> float:
    allowed = p.deadline_s - p.arrival_s
    return (p.deadline_s - first_token_s) / allowed if allowed > 0 else -math.inf


@DISPATCHERS.register("slack")
class SlackDispatcher(Dispatcher):
    def __init__(self, replicas, cluster, scheduler) -> None:
        super().__init__(replicas, cluster, scheduler)
        self.config = scheduler
        self.policy = replica_policy(scheduler)
        self._long = scheduler.long_prefill_threshold
        # the replicas of the last picks (see the module's docstring: a tie no cache breaks)
        self.recent_picks: deque[int] = deque(maxlen=RECENT_PICKS)

    def predicted_first_tokens(
        self, replica: ReplicaView, pending: list[Pending], now: float
    ) -> tuple[list[tuple[Pending, float]], float]:
        """Each of `pending` with its predicted first-token time on `replica`, in the order
        the replica serves them; and the stretch of its prefill work (its decodes' share)."""
        stretch = replica.prefill_stretch()
        out, t = [], now + replica.iteration_left_s(now)
        for p in prefill_order(self.policy, pending, now, self._long):
            t += p.work_s * stretch
            out.append((p, t))
        return out, stretch

    def pick(self, request, now, candidates=None):
        candidates = candidates or self.replicas
        deadline = ttft_deadline_s(self.config, request, candidates[0])
        before, after, ttft, spent, held = {}, {}, {}, {}, {}
        for r in candidates:
            rid = r.replica_id
            cached = held[rid] = r.cached_tokens(request)
            work = r.prefill_work_s(request, cached)
            # not started: long by its whole prompt until the replica looks it up
            new = Pending(
                request.request_id,
                request.arrival_s,
                deadline,
                work,
                work,
                request.prompt_len,
                priority_rank=request.priority_rank,
                ttft_deadline_s=request.ttft_deadline_s,
            )
            firsts, stretch = self.predicted_first_tokens(r, [*r.pending(now), new], now)
            # the smallest relative slack with the new request (after) and without it
            # (before: those it would go ahead of get their first token its work sooner)
            lowest_with = lowest_without = math.inf
            shift = 0.0
            for p, t in firsts:
                slack = relative_slack(p, t)
                lowest_with = min(lowest_with, slack)
                if p is new:
                    ttft[rid], shift = t, work * stretch
                    spent[rid] = shift
                else:
                    lowest_without = min(lowest_without, relative_slack(p, t - shift))
            after[rid], before[rid] = lowest_with, lowest_without

        # the cluster's smallest relative slack if the request goes to r: r's with it, every
        # other's without it (the two smallest "without" give each in O(1), not O(n) apiece)
        lows = heapq.nsmallest(2, candidates, key=lambda r: before[r.replica_id])
        cluster_min = {
            r.replica_id: min(
                after[r.replica_id],
                min((before[o.replica_id] for o in lows if o is not r), default=math.inf),
            )
            for r in candidates
        }

        def rank(r: ReplicaView) -> tuple:
            return (
                cluster_min[r.replica_id],
                -ttft[r.replica_id],
                -r.outstanding_work_s(),
                -r.replica_id,
            )

        ranked = sorted(candidates, key=rank, reverse=True)  # each rank computed once
        chosen = ranked[0]
        allowed = deadline - request.arrival_s
        self.tie_broken = False
        if self.tolerance_s > 0 and allowed > 0:
            within = cluster_min[chosen.replica_id] - self.tolerance_s / allowed
            tied = [r for r in ranked if cluster_min[r.replica_id] >= within]
            least = min(spent[r.replica_id] for r in tied)
            cheap = [r for r in tied if spent[r.replica_id] <= least + self.tolerance_s]
            better = cheap[0]  # the best ranked of those spending the least (within it)
            if len({held[r.replica_id] for r in cheap}) == 1:  # no cache tells them apart
                sent = self.recent_picks.count
                better = min(cheap, key=lambda r: sent(r.replica_id))
            if better is not chosen:
                chosen = better
                self.tie_broken = True
        self.predicted_first_token_s = ttft[chosen.replica_id]
        self.recent_picks.append(chosen.replica_id)
        return chosen
