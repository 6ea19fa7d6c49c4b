"""Medha Algorithms 1 and 2: chunks sized by a time budget, with space sharing for long prefills.

Each prefill, in policy order, gets the largest chunk whose batch still has a predicted time
within the iteration budget (binary search on the predictor). A fixed time budget is all that
adaptive chunking needs: as a long request's KV grows, each of its tokens costs more attention,
so the same budget buys smaller chunks. A batch that carries the decode of a request with its
own, tighter TPOT target gets a budget of at most that target (Packer.batch_budget_s).
"""

from __future__ import annotations

from collections.abc import Collection

from medha.core.request import Request
from medha.perf.chunking_price import isolated_chunk
from medha.scheduler.batch_builder import BatchBuilder
from medha.scheduler.packers.base_packer import PACKERS, Packer
from medha.scheduler.replica_rules import is_long


@PACKERS.register("adaptive")
class AdaptivePacker(Packer):
    default_policy = "lars"

    def pack(self, now: float, queue: Collection[Request], builder: BatchBuilder) -> None:
        cfg = self.config
        budget = self.batch_budget_s(builder, queue)  # who waits on the step bounds it
        if not builder.is_empty and builder.time_with_chunk(1, 0) > budget:
            # no chunk fits (one token of a fresh prompt is the least any takes): the loop
            # below would stop at its first request, and the queue is left unordered
            return
        has_long, threshold = False, self.rules.long_threshold
        for r in queue:
            long = is_long(r, threshold)  # after its look-up: a prefix hit makes it short
            if long and has_long:
                continue  # two long prefills would split the budget and both fall behind
            limit = budget
            if long and cfg.space_sharing and cfg.multi_prefill and len(queue) > 1:
                # A long prefill with slack to spare takes a smaller share of the iteration,
                # leaving the rest to the requests behind it; one with no slack takes it all,
                # and so does one with nobody behind it (an arrival joins the next iteration
                # whatever this one holds, so a share kept free for nobody is only lost), or
                # with multi-prefill off, where no other prefill may join its batch (the
                # decodes are in already): yielding there only slowed the long prefill down.
                # rho as the lars key reads it (--lars-slack): one notion of relative slack
                # for order and share, as in the paper (Algorithm 2 with s / w_total)
                rho = r.relative_slack(now, cfg.lars.slack)
                share = 1.0 - min(max(rho, 0.0), cfg.rho_max)
                limit = min(budget, builder.timer.time() + share * budget)
            n = self._largest_chunk(builder, r, limit)
            if n == 0:
                if builder.is_empty:
                    # Nothing fits, not even one token of the top request: run a minimum chunk
                    # anyway so that it progresses (the one case that exceeds the budget).
                    n = min(r.num_unscheduled, cfg.min_chunk_tokens)
                elif builder.time_with_chunk(1, 0) > budget:
                    break  # even a fresh one-token prefill no longer fits
                else:
                    continue  # a request with less KV may still fit
            added = builder.add_prefill(r, n)
            if added and long:
                has_long = True
            if added and not cfg.multi_prefill:
                break

    @staticmethod
    def _largest_chunk(builder: BatchBuilder, r: Request, limit: float) -> int:
        kv = r.num_scheduled
        hi = min(r.num_unscheduled, builder.room_tokens)
        if builder.time_with_chunk(hi, kv) <= limit:
            return hi
        if builder.time_with_chunk(1, kv) > limit:
            return 0
        lo = 1  # invariant: lo fits, hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if builder.time_with_chunk(mid, kv) <= limit:
                lo = mid
            else:
                hi = mid
        return lo

    def plan_isolated(self, kv_offset: int, remaining: int) -> int:
        # The work w_r that slack and default deadlines are read from: a prefill's steps at
        # the iteration budget, what it gets whenever anyone else is on the replica. Alone it
        # runs arrival-wait steps and finishes sooner; planning with those made long
        # deadlines tighter than any loaded replica meets (EDF lost 5.6 points in Fig. 13's
        # setting, docs/reproductions.md).
        return isolated_chunk(
            self.predictor,
            self.iteration_budget_s,
            kv_offset,
            remaining,
            self.config.min_chunk_tokens,
        )
