from medha.scheduler.policies.base_policy import POLICIES, Policy, SortKey


@POLICIES.register("lrs")
class LrsPolicy(Policy):
    summary = "least remaining slack: key s_r = a_r + d_r - t - w_r(t)"

    def sort_key(self, now: float) -> SortKey:
        return lambda r: r.slack(now)
