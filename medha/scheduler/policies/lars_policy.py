from medha.core.request import Request
from medha.scheduler.policies.base_policy import POLICIES, Policy, SortKey
from medha.scheduler.replica_rules import is_long


@POLICIES.register("lars")
class LarsPolicy(Policy):
    """Length-aware relative slack.

    Dividing the slack by the request's own prefill work puts a long request's few seconds of
    slack on the same footing as a short request's few milliseconds: a long request becomes
    urgent once its slack is small relative to its size, which stops it from starving behind a
    stream of short requests (as under EDF) without letting it convoy them (as under FCFS).

    By that key alone a short request with a generous deadline waits behind a long one until
    its own slack runs low, although serving it at once would cost the long one nothing it
    needs: its slack covers the short one's work many times over. With `lars_serve_early` (on
    by default) a short prefill goes ahead of those whose slack its work fits in; LARS's order
    stands wherever it does not (deadlines that conflict).
    """

    summary = (
        "length-aware relative slack: key rho_r = s_r / w_r^total, or s_r / w_r(t) with "
        "--lars-slack remaining; short prefills go first where every request they pass has "
        "the slack for them (--no-lars-serve-early: the key alone)"
    )

    def sort_key(self, now: float) -> SortKey:
        per = self.config.lars.slack
        return lambda r: r.relative_slack(now, per)

    def order_prefills(
        self, first: list[Request], rest: list[Request], now: float
    ) -> list[Request]:
        return self.serve_early(super().order_prefills(first, rest, now), now)

    def serve_early(self, order: list[Request], now: float) -> list[Request]:
        """`order` with each short prefill (not `replica_rules.is_long`) moved ahead of the
        requests before it when its remaining work fits within the slack each of them has left
        after the ones moved ahead before it: none of them is then predicted to miss its
        deadline for it. One already predicted to miss (slack < 0) holds no one back: being
        served later moves no deadline it can still meet. Long prefills keep their place:
        their turn is what LARS and space sharing arbitrate. One pass."""
        if not self.config.lars.serve_early or len(order) < 2:
            return order
        threshold = self.config.long_prefill_threshold or 1 << 62  # (unresolved: none long)
        early, kept = [], []
        spare = float("inf")  # least slack among the kept requests that can still meet theirs
        moved = 0.0  # work of the requests moved ahead of all the kept ones
        for r in order:
            work = r.remaining_work_s
            if not is_long(r, threshold) and moved + work <= spare:
                early.append(r)
                moved += work
                continue
            kept.append(r)
            slack = r.slack(now)
            if slack - moved >= 0:  # it can still meet its deadline behind the early ones
                spare = min(spare, slack)
        return early + kept
