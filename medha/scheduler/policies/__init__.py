from medha.scheduler.policies.base_policy import POLICIES, Policy, make_policy

__all__ = ["POLICIES", "Policy", "make_policy"]
