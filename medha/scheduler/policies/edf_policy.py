from medha.scheduler.policies.base_policy import POLICIES, Policy, SortKey


@POLICIES.register("edf")
class EdfPolicy(Policy):
    summary = "earliest deadline first: key a_r + d_r"

    def sort_key(self, now: float) -> SortKey:
        return lambda r: r.deadline_s
