"""What bench/route/route_slo.py reads off the replicas and the router it runs: their /metrics
(prefix-cache and request counters, the KV capacity, what `medha route` measured), the model a
replica serves, and whether a router passes a request's `medha` object on to the replica.
"""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def samples(url: str) -> list:
    """The samples of a server's /metrics (name, labels, value), by prometheus_client's parser."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def replica_counters(url: str) -> dict:
    out = {"requests": 0.0, "prefix_queries": 0.0, "prefix_hits": 0.0}
    names = {
        "medha_prefix_cache_queries_tokens": "prefix_queries",
        "medha_prefix_cache_hits_tokens": "prefix_hits",
    }
    for sample in samples(url):
        if sample.name == "medha_requests_total":
            out["requests"] += sample.value
        elif sample.name in names:
            out[names[sample.name]] = sample.value
    return out


def router_measures(base: str) -> dict:
    """What `medha route` measured: each replica's speed, its median prediction error, the
    picks that error changed."""
    slowdowns, out = {}, {}
    for sample in samples(base):
        if sample.name == "medha_router_replica_slowdown":
            slowdowns[sample.labels["replica"]] = sample.value
        elif sample.name == "medha_router_prediction_error_seconds":
            out["prediction_error_s"] = sample.value
        elif sample.name == "medha_router_tie_breaks_total":
            out["tie_breaks"] = int(sample.value)
    return out | {"slowdowns": [slowdowns[k] for k in sorted(slowdowns, key=int)] or None}


def replica_kv_tokens(url: str) -> int:
    for sample in samples(url):
        if sample.name == "medha_kv_capacity_tokens":
            return int(sample.value)
    raise RuntimeError(f"{url}/metrics has no medha_kv_capacity_tokens")


def served_model(replica: str) -> str:
    """The replica's model name: what clients must send (SGLang's router lists "unknown")."""
    return httpx.get(replica + "/v1/models", timeout=10).json()["data"][0]["id"]


def slo_field_forwarded(base: str, model: str) -> dict:
    """Whether the router passes the body's `medha` object on to the replica, per endpoint:
    an invalid target is a 400 from a medha replica, a 200 means it never got there."""
    out = {}
    for ep, extra in (
        ("completions", {"prompt": "route check"}),
        ("chat/completions", {"messages": [{"role": "system", "content": "route check"}]}),
    ):
        body = {"model": model, "max_tokens": 1, "medha": {"ttft_slo_s": -1}} | extra
        status = httpx.post(f"{base}/v1/{ep}", json=body, timeout=60).status_code
        out[ep] = status == 400
    return out
