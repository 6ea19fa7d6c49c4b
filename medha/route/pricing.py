"""The models the router prices replicas' work with: its own (`--model`, `--predictor`, the
replicas' scheduler config under `--policy`), priced to the longest context a replica reports,
and a replica's own batch-time model and scheduler config where it publishes them (`medha
serve`'s GET /medha/predictor). What the router reads of a replica's answers to learn them:
`published_scheduler`, `capacity_tokens`. The reading itself is the replica set's
(replicas.py)."""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

from medha.route.config import RouteConfig

if TYPE_CHECKING:
    from medha.route.tracked import TrackedReplica

log = logging.getLogger("medha.route")

MAX_CONTEXT = 1 << 24  # tokens: a replica's reported context past this is not believed


def auto_predictor(model: str, hardware: str) -> str:
    """The profile `medha profile` wrote for `model` on `hardware` in medha's cache (the newest),
    else the roofline: what the replicas plan with by default on this machine."""
    from medha.perf.hardware_specs import cache_dir

    root = cache_dir() / "profiles"
    found = sorted(root.glob(f"{model}-{hardware}-*.json"), key=lambda p: p.stat().st_mtime)
    return f"profiled:{found[-1]}" if found else "roofline"


def published_scheduler(description: dict):
    """The scheduler config a replica publishes beside its model (None: none, as older replicas),
    checked as input from the network: DescriptionError for anything `SchedulerConfig` refuses
    or a config whose defaults are not resolved."""
    from medha.perf.published import DescriptionError
    from medha.scheduler.config import SchedulerConfig

    data = description.get("scheduler")
    if data is None:
        return None
    if not isinstance(data, dict):
        raise DescriptionError("scheduler must be an object")
    try:
        config = SchedulerConfig(**data)
    except (TypeError, ValueError) as e:
        raise DescriptionError(f"scheduler: {e}") from None
    if not config.is_resolved:
        raise DescriptionError("scheduler: its defaults are not resolved")
    return config


class Pricing:
    """The router's own model of a replica, and what it learned of the context replicas serve."""

    def __init__(self, config: RouteConfig) -> None:
        from medha.perf import make_predictor
        from medha.scheduler.config import SchedulerConfig
        from medha.scheduler.config_defaults import resolve_config
        from medha.scheduler.packers import replica_prefill_times

        self.config = config
        spec = config.predictor
        if spec == "auto":
            spec = auto_predictor(config.model, config.hardware)
        self.predictor = make_predictor(spec, config.model, config.hardware)
        # The replicas' scheduler config (of it, only --policy is known: the rest are the
        # defaults), resolved as their schedulers resolve it, and the prefill-time walk those
        # read (one function for both); no scheduler is built. The tracked replicas make the
        # policy, which rejects an unknown name.
        self.scheduler_config = scheduler_config = resolve_config(
            SchedulerConfig(policy=config.policy), self.predictor
        )
        self.prefill_times = replica_prefill_times(scheduler_config, self.predictor)
        # the longest context a replica reported (prompts are priced up to it)
        self.context = self.prefill_times.max_len

    def learn_context(self, models: list[dict], tracked: list[TrackedReplica]) -> bool:
        """A replica that serves a longer context than the router's --model (its /v1/models'
        `max_model_len`, as medha serve and vLLM report it): the router prices prompts up to
        it from then on, on every replica (True: it does now)."""
        lengths = [m.get("max_model_len") for m in models]
        longest = max((n for n in lengths if type(n) is int and 0 < n <= MAX_CONTEXT), default=0)
        if longest <= self.context:
            return False
        self.context = longest
        self.prefill_times = self.walk(self.scheduler_config, self.predictor)
        for t in tracked:
            self.price_with(t, t.predictor, t.scheduler_config)
        log.info(
            "a replica serves %d tokens of context: the router prices prompts up to it", longest
        )
        return True

    def walk(self, config, predictor):
        """The prefill-time walk of a replica running `config` on `predictor`, to the
        longest context known."""
        from medha.scheduler.packers import replica_prefill_times

        if config.max_model_len < self.context:
            config = dataclasses.replace(config, max_model_len=self.context)
        return replica_prefill_times(config, predictor)

    def price_with(self, t: TrackedReplica, predictor, config, walk=None) -> None:
        """Replica `t` priced from now on with `predictor` under its scheduler `config`: the
        router's own model shares one walk (`prefill_times`, which a replica added later gets
        too), a replica's published one has its own (`walk`, when the caller made it off the
        event loop)."""
        own = predictor is self.predictor and config is self.scheduler_config
        if walk is None:
            walk = self.prefill_times if own else self.walk(config, predictor)
        t.set_model(predictor, config, walk)

    def price_as_own(self, t: TrackedReplica) -> None:
        """Replica `t` priced with the router's own model again."""
        self.price_with(t, self.predictor, self.scheduler_config)

    def published_model(self, base: dict | None, published, predictor):
        """The model of a replica that publishes its base (`base`: None, it is `predictor`
        still) and perhaps its scheduler config: (predictor, config, walk). Seconds for a
        fitted profile's model: run off the event loop."""
        from medha.perf.published import predictor_from_description
        from medha.scheduler.config import SchedulerConfig
        from medha.scheduler.config_defaults import resolve_config

        if base is not None:
            predictor = predictor_from_description(base)
        # the replica's own config, or resolved as the replica resolves its defaults
        config = published or resolve_config(SchedulerConfig(policy=self.config.policy), predictor)
        return predictor, config, self.walk(config, predictor)


def capacity_tokens(metrics_text: str) -> int | None:
    """A replica's KV capacity in tokens from its /metrics: medha serve's gauge, or vLLM's
    cache_config_info (num_gpu_blocks x block_size)."""
    for line in metrics_text.splitlines():
        if line.startswith("medha_kv_capacity_tokens "):
            return int(float(line.split()[1]))
        if line.startswith("vllm:cache_config_info{"):
            labels = dict(
                kv.split("=", 1)
                for kv in line[line.index("{") + 1 : line.index("}")].split(",")
                if "=" in kv
            )
            try:
                blocks = int(labels["num_gpu_blocks"].strip('"'))
                return blocks * int(labels["block_size"].strip('"'))
            except (KeyError, ValueError):
                return None
    return None
