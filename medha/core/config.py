"""Typed configuration; every field's help text is what the CLI shows."""

from __future__ import annotations

import math

PREEMPTION_MODES = ("recompute", "swap", "auto")
# Prefix caching (medha/scheduler/prefix_cache.py): none, device KV only, or device KV with a
# host-memory tier that blocks evicted from the device go to.
PREFIX_CACHE_MODES = ("off", "device", "device+host")
# What LARS divides a request's slack by (Request.relative_slack): the prefill work still ahead,
# w(t), or the whole prefill's, w_total (the paper's formula).
LARS_SLACK_MODES = ("remaining", "total")
# The scheduler's policies and chunking modes, by name. Each is implemented by one module of
# medha/scheduler/policies (or packers) that registers under that name; the names are listed
# here, below the scheduler, so that a config is checked without importing what it configures
# (tests/test_policies.py and test_packer.py keep the lists and the registries equal).
POLICY_NAMES = ("fcfs", "edf", "lrs", "lars", "srpt", "deferred", "aligned", "priority", "pla")
CHUNKING_MODES = ("none", "static", "adaptive")
# How a request's batches pass through the spp pipeline stages of a replica: stream (Medha's
# SPP: the next chunk of a prefill follows the previous one a stage behind) or microbatch (vLLM's
# and Sarathi's pipeline parallelism: a request waits until its batch leaves the last stage, and
# other requests' batches fill the stages meanwhile).
PIPELINE_MODES = ("stream", "microbatch")
_CHUNKING_TAKES_ARGUMENT = ("static",)  # static:N, a token budget


# A prefill counts as long from a quarter of the model's context, and at most from this many
# prompt tokens (see default_long_threshold).
LONG_THRESHOLD_CAP = 32768


def default_long_threshold(max_model_len: int) -> int:
    """Prompt tokens from which a request counts as long, for a context of `max_model_len`:
    min(32768, max_model_len / 4). The one default of the scheduler's long_prefill_threshold
    (at most one long prefill per batch, space sharing), the simulator's per-class metrics
    (which follow the scheduler's resolved threshold) and `medha bench`'s class tables (from
    the server's max_model_len in /v1/models)."""
    return min(LONG_THRESHOLD_CAP, max(1, max_model_len // 4))


# The groups of SchedulerConfig's fields, in the order `--help` shows them. The field names stay
# flat (they are Python keyword arguments and flags); the group says which part of the scheduler
# or which policy a field belongs to.
SCHEDULER = "scheduler"
CHUNKING = "chunking and budget"
KV_MEMORY = "KV memory and preemption"
DEFERRED = "deferred policy"
ALIGNED = "aligned policy"
PRIORITY = "priority policy"
PLA = "pla policy"
SCHEDULER_GROUPS = (SCHEDULER, CHUNKING, KV_MEMORY, DEFERRED, ALIGNED, PRIORITY, PLA)


def help_metadata(group: str, text: str, **extra) -> dict:
    return {"group": group, "help": text, **extra}


def parse_chunking(spec: str) -> tuple[str, int | None]:
    """'adaptive' | 'none' | 'static:N' -> (chunking mode, N)."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"chunking must be none, static:N or adaptive, got {spec!r}")
    name, _, arg = spec.partition(":")
    if name not in CHUNKING_MODES:
        raise ValueError(f"unknown chunking {spec!r}; expected none, static:N or adaptive")
    if name in _CHUNKING_TAKES_ARGUMENT:
        if not arg.isdigit() or int(arg) < 1:
            raise ValueError(
                f"chunking {spec!r}: static chunking needs a positive token budget, e.g. static:512"
            )
        return name, int(arg)
    if arg:
        raise ValueError(f"chunking {spec!r}: {name} takes no argument")
    return name, None


def check_positive_ints(obj, names: tuple[str, ...], prefix: str = "") -> None:
    """Each of `names` (attributes of `obj`; a flag's name is `prefix` + it) is None or an
    integer >= 1."""
    for name in names:
        value = getattr(obj, name)
        if value is not None and not (isinstance(value, int) and value >= 1):
            raise ValueError(f"{prefix}{name} must be a positive integer, got {value!r}")


def check_positive_seconds(
    obj, names: tuple[str, ...], prefix: str = "", what: str = "a positive number"
) -> None:
    """Each of `names` is None or a finite number > 0."""
    for name in names:
        value = getattr(obj, name)
        if value is not None and not (
            isinstance(value, (int, float)) and math.isfinite(value) and value > 0
        ):
            raise ValueError(f"{prefix}{name} must be {what}, got {value!r}")


# The least TTFT deadline under the default deadlines (ttft_deadline_factor x a request's
# prefill time alone): 0.5 s, or two iteration budgets where that is longer
# (medha/scheduler/config_defaults.py resolves min_ttft_deadline_s from it).
MIN_TTFT_DEADLINE_S = 0.5


def iteration_budget(tpot_target_s: float, spp: int = 1) -> float:
    """The iteration time budget that keeps a token within `tpot_target_s`. With stream
    pipelining (spp stages) a decode that returns just after stage 1 was refilled waits for the
    next slot, one stage time, so the budget leaves room for it: spp/(spp+1) of the target.
    Without pipelining a batch returns exactly when the next one starts: the whole target."""
    return tpot_target_s if spp == 1 else tpot_target_s * spp / (spp + 1)
