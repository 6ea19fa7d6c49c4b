from medha.scheduler.policies.base_policy import POLICIES, Policy, SortKey


@POLICIES.register("srpt")
class SrptPolicy(Policy):
    summary = "shortest remaining prefill time: key w_r(t)"

    def sort_key(self, now: float) -> SortKey:
        return lambda r: r.remaining_work_s
