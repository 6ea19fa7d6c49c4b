import json
import math

import numpy as np
import pytest

from medha.sim.workload.generator import (
    LONG_DECODE,
    LONG_DECODE_LOGNORMAL,
    LONG_PREFILL,
    LONG_PREFILL_LOGNORMAL,
    WorkloadConfig,
    build_requests,
    sample_long,
)
from medha.sim.workload.traces import TraceError, load_trace


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_every_format_loads(tmp_path):
    vidur = load_trace(
        write(
            tmp_path,
            "v.csv",
            "arrived_at,num_prefill_tokens,num_decode_tokens\n1.5,10,3\n2.0,20,4\n",
        )
    )
    assert [(e.arrival_s, e.prompt_len, e.output_len) for e in vidur] == [
        (0.0, 10, 3),
        (0.5, 20, 4),
    ]
    azure = load_trace(
        write(
            tmp_path,
            "a.csv",
            "TIMESTAMP,ContextTokens,GeneratedTokens\n"
            "2023-11-16 18:15:46.5,100,5\n"
            "2023-11-16 18:15:48.0,200,6\n",
        )
    )
    assert [e.arrival_s for e in azure] == [0.0, 1.5]
    lengths = load_trace(
        write(tmp_path, "l.csv", "num_prefill_tokens,num_decode_tokens,x\n7,8,9\n")
    )
    assert lengths[0].arrival_s is None and lengths[0].prompt_len == 7
    jsonl = load_trace(
        write(
            tmp_path,
            "j.jsonl",
            '{"timestamp": 1000, "input_length": 5, "output_length": 6}\n\n'
            '{"timestamp": 3500, "input_length": 7, "output_length": 8}\n',
        )
    )
    assert [(e.arrival_s, e.prompt_len) for e in jsonl] == [(0.0, 5), (2.5, 7)]


def test_bundled_traces_load():
    for name in (
        "sharegpt",
        "arxiv",
        "splitwise_conv",
        "splitwise_code",
        "azure_conv",
        "azure_code",
    ):
        assert len(load_trace(name, limit=5)) == 5


@pytest.mark.parametrize(
    "name, text, message",
    [
        (
            "m.csv",
            "arrived_at,num_prefill_tokens\n0,5\n",
            r"m.csv:1: missing column "
            r"'num_decode_tokens'",
        ),
        (
            "n.csv",
            "num_prefill_tokens,num_decode_tokens\n5,3\n-2,4\n",
            r"n.csv:3: num_prefill_tokens='-2' must be at least 1",
        ),
        (
            "x.csv",
            "num_prefill_tokens,num_decode_tokens\n5,lots\n",
            r"x.csv:2: num_decode_tokens='lots' is not a number",
        ),
        (
            "t.csv",
            "arrived_at,num_prefill_tokens,num_decode_tokens\n-1,5,5\n",
            r"t.csv:2: arrived_at='-1' must be a non-negative time",
        ),
        ("f.csv", "num_prefill_tokens,num_decode_tokens\n5.5,3\n", r"f.csv:2: .*whole number"),
        ("u.csv", "prompt,answer\n1,2\n", r"u.csv:1: unrecognised columns"),
        (
            "j.jsonl",
            '{"timestamp": 0, "input_length": 5, "output_length": 1}\n{oops\n',
            r"j.jsonl:2: not valid JSON",
        ),
        (
            "k.jsonl",
            '{"timestamp": 0, "input_length": 5}\n',
            r"k.jsonl:1: missing field "
            r"'output_length'",
        ),
        ("e.csv", "", r"e.csv:1: empty file"),
    ],
)
def test_bad_traces_name_file_and_line(tmp_path, name, text, message):
    with pytest.raises(TraceError, match=message):
        load_trace(write(tmp_path, name, text))


def test_missing_file_lists_bundled_names():
    with pytest.raises(TraceError, match="no such file.*sharegpt"):
        load_trace("/nonexistent/trace.csv")


def test_requests_are_reproducible_and_follow_the_config():
    cfg = WorkloadConfig(trace="sharegpt", qps=2.0, num_requests=400, long_fraction=0.1, seed=7)
    a, b = build_requests(cfg, 1 << 20), build_requests(cfg, 1 << 20)
    assert [(r.arrival_s, r.prompt_len, r.max_tokens) for r in a] == [
        (r.arrival_s, r.prompt_len, r.max_tokens) for r in b
    ]
    longs = [r for r in a if r.prompt_len >= 128 * 1024]
    assert 20 <= len(longs) <= 60  # 10% of 400, give or take sampling
    assert 1.5 < len(a) / a[-1].arrival_s < 2.5  # Poisson at 2 requests/s
    other = build_requests(
        WorkloadConfig(trace="sharegpt", qps=2.0, num_requests=400, seed=8), 1 << 20
    )
    assert [r.prompt_len for r in other] != [r.prompt_len for r in a]


def test_trace_timestamps_and_time_scale():
    base = build_requests(WorkloadConfig(trace="splitwise_conv", num_requests=50), 1 << 20)
    fast = build_requests(
        WorkloadConfig(trace="splitwise_conv", num_requests=50, time_scale=0.5), 1 << 20
    )
    assert fast[-1].arrival_s == pytest.approx(base[-1].arrival_s / 2)
    with pytest.raises(TraceError, match="give --qps"):
        build_requests(WorkloadConfig(trace="sharegpt", num_requests=5), 1 << 20)


def test_long_context_mixture_matches_medha_swe():
    import random

    rng = random.Random(0)
    draws = [sample_long(rng, 1 << 20) for _ in range(20000)]
    prompts, outputs = np.array(draws).T
    assert prompts.min() >= 128 * 1024 and prompts.max() <= 1 << 20
    assert np.percentile(prompts, 50) == pytest.approx(393_000, rel=0.03)
    assert np.percentile(prompts, 90) == pytest.approx(839_000, rel=0.03)
    assert np.percentile(outputs, 50) == pytest.approx(518, rel=0.03)
    assert np.percentile(outputs, 90) == pytest.approx(808, rel=0.03)


def truncated_lognormal(p50: float, p90: float, low: float, high: float):
    """(mu, sigma) of a log-normal that, truncated to [low, high], has the given P50 and P90."""
    from scipy.optimize import fsolve
    from scipy.stats import norm

    a, b = math.log(low), math.log(high)

    def quantile(q, mu, s):
        lo, hi = norm.cdf((a - mu) / s), norm.cdf((b - mu) / s)
        return math.exp(mu + s * norm.ppf(lo + q * (hi - lo)))

    def equations(params):
        mu, s = params[0], abs(params[1]) + 1e-9
        return [math.log(quantile(0.5, mu, s) / p50), math.log(quantile(0.9, mu, s) / p90)]

    mu, s = fsolve(equations, [math.log(p50), math.log(p90 / p50) / 1.2816])
    return float(mu), abs(float(s))


def test_the_stored_long_context_parameters_solve_the_quantiles():
    for spec, stored in (
        (LONG_PREFILL, LONG_PREFILL_LOGNORMAL),
        (LONG_DECODE, LONG_DECODE_LOGNORMAL),
    ):
        assert truncated_lognormal(**spec) == pytest.approx(stored, rel=1e-6)


def test_requests_beyond_the_context_are_refused(tmp_path):
    path = write(tmp_path, "big.csv", "num_prefill_tokens,num_decode_tokens\n5000,10\n")
    with pytest.raises(TraceError, match="exceed the model context of 4096"):
        build_requests(WorkloadConfig(trace=str(path), qps=1.0, num_requests=1), 4096)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(qps=0), "qps"),
        (dict(arrival="burst"), "arrival"),
        (dict(long_fraction=1.5), "long_fraction"),
        (dict(num_requests=0), "num_requests"),
    ],
)
def test_bad_workload_config(kwargs, field):
    with pytest.raises(ValueError, match=field):
        WorkloadConfig(**kwargs)


def test_jsonl_round_trip(tmp_path):
    rows = [{"timestamp": 10 * i, "input_length": 3 + i, "output_length": 2} for i in range(4)]
    path = write(tmp_path, "t.jsonl", "\n".join(json.dumps(r) for r in rows))
    reqs = build_requests(WorkloadConfig(trace=str(path)), 1 << 20)
    assert [r.arrival_s for r in reqs] == pytest.approx([0, 0.01, 0.02, 0.03])


def test_a_jsonl_trace_may_carry_token_ids_for_the_prefix_cache(tmp_path):
    rows = [
        {"timestamp": 0, "input_length": 4, "output_length": 2, "token_ids": [5, 6, 7, 8]},
        {"timestamp": 5, "input_length": 2, "output_length": 2},
    ]
    path = write(tmp_path, "t.jsonl", "\n".join(json.dumps(r) for r in rows))
    reqs = build_requests(WorkloadConfig(trace=str(path)), 1 << 20)
    assert [r.prompt_token_ids for r in reqs] == [[5, 6, 7, 8], None]
    for bad in ([5, 6, 7], [5, 6, 7, -1], [5, 6, 7, True], "5 6 7 8"):
        rows[0]["token_ids"] = bad
        path = write(tmp_path, "bad.jsonl", json.dumps(rows[0]))
        with pytest.raises(TraceError, match="token_ids"):
            load_trace(str(path))


def test_long_scale_stretches_only_the_long_prompts():
    base = WorkloadConfig(trace="sharegpt", qps=1.0, num_requests=400, long_fraction=0.1)
    one = build_requests(base, 1 << 22)
    two = build_requests(WorkloadConfig(**{**base.__dict__, "long_scale": 2.0}), 1 << 22)
    longs = 0
    for a, b in zip(one, two):
        assert (a.arrival_s, a.max_tokens) == (b.arrival_s, b.max_tokens)
        if a.prompt_len >= LONG_PREFILL["low"]:
            longs += 1
            assert b.prompt_len == 2 * a.prompt_len
        else:
            assert b.prompt_len == a.prompt_len
    assert longs >= 20
    with pytest.raises(ValueError, match="long_scale"):
        WorkloadConfig(trace="sharegpt", qps=1.0, long_scale=0)
