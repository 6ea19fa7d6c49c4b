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
        their turn is what LARS and space sharing arbitrate. One pass.

        A short prefill with more work left than the arrival wait (a few thousand tokens of a
        model whose threshold is 32K, on a slow device) moves ahead of the kept ones like any
        other, but the small ones behind it may pass it too, within its slack, as they pass a
        long one: it would hold a request arriving behind it longer than any step may (issue
        68: on the A100's roofline at half its speed, 8 shorts waited out a 6,000-token prompt
        of Llama-3-8B, short by its 32K threshold, at 10x their time alone). A small one its
        slack does not cover stays behind it, still ahead of the kept ones."""
        if not self.config.lars.serve_early or len(order) < 2:
            return order
        threshold = self.config.long_prefill_threshold or 1 << 62  # (unresolved: none long)
        small = self.config.arrival_wait_s or float("inf")
        early, middle, kept = [], [], []
        # the most work that may still pass every kept request so far, and every one in the
        # middle (ahead of the kept ones, behind the small early ones)
        room_kept = room_middle = float("inf")
        moved = 0.0  # work moved ahead of all the kept requests
        for r in order:
            work, ahead = r.remaining_work_s, moved  # (ahead: what is moved ahead of r so far)
            if is_long(r, threshold) or work > room_kept:
                kept.append(r)
                left = r.slack(now) - ahead
                if left >= 0:  # it can still meet its deadline: whoever passes it must fit
                    room_kept = min(room_kept, left)
                continue
            moved += work
            room_kept -= work
            if work <= small and work <= room_middle:
                early.append(r)
                room_middle -= work
                continue
            middle.append(r)
            left = r.slack(now) - ahead
            if left >= 0:
                room_middle = min(room_middle, left)
        return early + middle + kept
