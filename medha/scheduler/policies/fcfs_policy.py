from medha.scheduler.policies.base_policy import POLICIES, Policy, SortKey


@POLICIES.register("fcfs")
class FcfsPolicy(Policy):
    summary = "first come, first served: key a_r"

    def sort_key(self, now: float) -> SortKey:
        return lambda r: r.arrival_s
