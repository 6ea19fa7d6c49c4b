from medha.scheduler.policies.base_policy import POLICIES, Policy, SortKey


@POLICIES.register("lars")
class LarsPolicy(Policy):
    """Length-aware relative slack.

    Dividing the slack by the request's own prefill work puts a long request's few seconds of
    slack on the same footing as a short request's few milliseconds: a long request becomes
    urgent once its slack is small relative to its size, which stops it from starving behind a
    stream of short requests (as under EDF) without letting it convoy them (as under FCFS).
    """

    summary = (
        "length-aware relative slack: key rho_r = s_r / w_r^total, or s_r / w_r(t) with "
        "--lars-slack remaining"
    )

    def sort_key(self, now: float) -> SortKey:
        per = self.config.lars_slack
        return lambda r: r.relative_slack(now, per)
