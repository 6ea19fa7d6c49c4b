"""medha/benchmark/harness.py: the flags every bench shares, its percentiles, its tables."""

import argparse
from pathlib import Path

import numpy as np
import pytest

from medha.benchmark.harness import (
    add_common_args,
    dominates,
    goodput,
    markdown_table,
    pareto_front,
    parse_slo,
    percentile,
)


def test_only_the_named_flags_are_added_with_their_defaults():
    ap = add_common_args(argparse.ArgumentParser(), seed=3, num_requests=50)
    args = ap.parse_args([])
    assert (args.seed, args.num_requests) == (3, 50)
    assert not hasattr(args, "out")
    with pytest.raises(SystemExit):
        ap.parse_args(["--out", "x"])


def test_out_is_required_where_the_bench_needs_it():
    ap = add_common_args(argparse.ArgumentParser(), out=...)
    with pytest.raises(SystemExit):
        ap.parse_args([])
    assert ap.parse_args(["--out", "d"]).out == "d"
    assert add_common_args(argparse.ArgumentParser(), out="runs/x").parse_args([]).out == "runs/x"


def test_out_takes_the_type_the_bench_writes_through():
    ap = add_common_args(argparse.ArgumentParser(), out=None, out_type=Path)
    assert ap.parse_args(["--out", "r/x.json"]).out == Path("r/x.json")
    assert ap.parse_args([]).out is None
    plain = add_common_args(argparse.ArgumentParser(), out=None)
    assert plain.parse_args(["--out", "x"]).out == "x"


def test_percentiles_skip_missing_values_and_follow_numpy():
    vals = [4.0, None, 1.0, 3.0, 2.0]
    assert percentile(vals, 50) == 2.5
    assert percentile(vals, 50, method="lower") == 2.0
    assert percentile([None], 99) is None
    rng = np.random.default_rng(0)
    xs = list(rng.random(101))
    assert percentile(xs, 99.9) == float(np.percentile(xs, 99.9))


def test_a_markdown_table_is_its_header_rule_and_rows():
    text = markdown_table(["name", "p99"], [["a", 1.5], ["b", None]])
    assert text.splitlines() == ["| name | p99 |", "|---|---|", "| a | 1.5 |", "| b | None |"]


def test_the_pareto_front_keeps_what_nothing_beats_on_every_measure():
    assert dominates((1.0, 2.0), (1.0, 3.0)) and not dominates((1.0, 3.0), (1.0, 3.0))
    assert not dominates((0.5, 4.0), (1.0, 3.0))  # better on one, worse on the other
    points = {
        "vLLM": (1.00, 13.5),
        "threshold 256": (1.15, 2.3),
        "threshold 512": (1.25, 3.0),  # beaten on both by 256
        "medha": (1.29, 1.1),
        "tie": (1.29, 1.1),  # equal points beat neither
    }
    assert pareto_front(points) == ["vLLM", "threshold 256", "medha", "tie"]


def test_an_slo_is_a_fixed_or_prompt_scaled_ttft_and_a_tpot():
    assert parse_slo("ttft=2,tpot=0.2") == (2.0, 0.0, 0.2)
    assert parse_slo("ttft=1+0.0005*prompt, tpot=0.15") == (1.0, 0.0005, 0.15)
    for bad in ("ttft=2", "ttft=2,tpot=x", "ttft=0,tpot=0.2", "ttft=1+2,tpot=0.2",
                "ttft=nan,tpot=0.2", "ttft=1,tpot=0.2,e2e=3"):  # fmt: skip
        with pytest.raises(argparse.ArgumentTypeError):
            parse_slo(bad)


def test_goodput_counts_the_requests_within_both_targets_per_second(tmp_path: Path):
    rows = [  # status, prompt tokens, TTFT, TPOT
        ("ok", 100, 0.5, 0.1),  # meets both
        ("ok", 100, 0.5, 0.3),  # too slow between tokens
        ("ok", 4000, 2.5, 0.1),  # too late for 2 s, in time for 1 s + 0.5 ms a token
        ("ok", 100, 0.5, ""),  # one token: no TPOT
        ("error", 100, "", ""),
    ]
    (tmp_path / "requests.csv").write_text(
        "status,num_prefill_tokens,ttft_s,tpot_s\n"
        + "".join(",".join(map(str, r)) + "\n" for r in rows)
    )
    assert goodput(tmp_path, parse_slo("ttft=2,tpot=0.2"), 4.0) == 2 / 4
    assert goodput(tmp_path, parse_slo("ttft=1+0.0005*prompt,tpot=0.2"), 4.0) == 3 / 4


def test_a_bench_can_tell_the_server_each_requests_targets():
    """`medha bench --send-slo` sends each request's TTFT target (scaled with its prompt) and
    TPOT target in the medha extension, and judges the request against the same target."""
    from medha.benchmark.config import BenchConfig
    from medha.benchmark.load_generator import _body, _metrics, _Result
    from medha.benchmark.workload import BenchRequest

    req = BenchRequest(index=0, arrival_s=0.0, prompt_len=2000, output_len=4)
    quiet = BenchConfig(url="http://x", workload="prompt=8,output=4", ttft_slo_s=1.0,
                        ttft_slo_per_token_s=5e-4, tpot_slo_s=0.2)  # fmt: skip
    assert "medha" not in _body(quiet, "m", req)
    told = BenchConfig(**{**quiet.__dict__, "send_slo": True})
    assert _body(told, "m", req)["medha"] == {"ttft_slo_s": 2.0, "tpot_slo_s": 0.2}
    deadline_only = BenchConfig(**{**told.__dict__, "send_tpot_slo": False})
    assert _body(deadline_only, "m", req)["medha"] == {"ttft_slo_s": 2.0}
    # a first token at 1.9 s meets 1 s + 0.5 ms x 2,000 tokens, not 1 s alone
    res = _Result(req, send_s=0.0, chunk_s=[1.9, 2.0, 2.1, 2.2], end_s=2.2, completion_tokens=4)
    got = _metrics(res, told, 0.0, 10_000)
    assert got.ttft_deadline_s == 2.0 and got.ttft_met and got.tpot_met
    flat = BenchConfig(**{**quiet.__dict__, "ttft_slo_per_token_s": 0.0})
    assert not _metrics(res, flat, 0.0, 10_000).ttft_met
    with pytest.raises(ValueError, match="ttft_slo_per_token_s"):
        BenchConfig(**{**quiet.__dict__, "ttft_slo_per_token_s": float("nan")})


def test_a_peer_scheduling_by_priority_is_sent_each_prompts_length_as_its_priority():
    """A tuned vLLM started with `--scheduling-policy priority` (either spelling) gets each
    request's prompt length as vLLM's `priority` (lower runs earlier: the shortest waiting
    prompt first); no other contender does: their requests stay as every run before sent them
    (vLLM 0.32 under fcfs ignores the field; medha's server ignores unknown top-level fields)."""
    from medha.benchmark.config import BenchConfig
    from medha.benchmark.load_generator import _body
    from medha.benchmark.vllm_servers import (
        add_contender_args,
        add_server_args,
        contenders,
        server_flags,
    )
    from medha.benchmark.workload import BenchRequest

    ap = argparse.ArgumentParser()
    add_server_args(ap)
    add_contender_args(ap)
    peers = [
        "--long-prefill-token-threshold 512 --scheduling-policy priority",
        "--scheduling-policy=priority",
        "--scheduling-policy fcfs",
        "--long-prefill-token-threshold 512",
    ]
    args = ap.parse_args(
        ["--model", "m", "--dtype", "float32", "--medha", "{}", "--engine-medha", "{}"]
        + [f"--peer={p}" for p in peers]
    )
    servers = contenders(args, server_flags(args))
    assert len(servers) == 7
    assert sorted(n for n, c in servers.items() if c.priority) == sorted(
        f"vLLM {p}" for p in peers[:2]
    )
    assert servers[f"vLLM {peers[0]}"].command(8000)[-2:] == ["--scheduling-policy", "priority"]
    req = BenchRequest(index=0, arrival_s=0.0, prompt_len=2000, output_len=4)
    cfg = BenchConfig(url="http://x", workload="prompt=8,output=4")
    assert "priority" not in _body(cfg, "m", req)
    ranked = BenchConfig(**{**cfg.__dict__, "send_priority": True})
    assert _body(ranked, "m", req)["priority"] == 2000


def test_a_text_prompt_for_a_front_that_takes_no_token_ids():
    """SGLang's router answers 422 to a /v1/completions prompt of token ids: `endpoint="text"`
    sends the same lengths as words that SmolLM2 tokenizes one token each, the same words for
    the same seed; anything else is refused at once."""
    from medha.benchmark.config import BenchConfig
    from medha.benchmark.load_generator import _body
    from medha.benchmark.route_workloads import WORDS
    from medha.benchmark.workload import BenchRequest

    req = BenchRequest(index=3, arrival_s=0.0, prompt_len=300, output_len=4)
    cfg = BenchConfig(url="http://x", workload="prompt=8,output=4", endpoint="text", seed=7)
    prompt = _body(cfg, "m", req)["prompt"]
    assert isinstance(prompt, str) and len(prompt.split()) == 300
    assert set(prompt.split()) <= set(WORDS)
    assert _body(cfg, "m", req)["prompt"] == prompt
    ids = _body(BenchConfig(**{**cfg.__dict__, "endpoint": "completions"}), "m", req)["prompt"]
    assert len(ids) == 300 and all(isinstance(t, int) for t in ids)
    with pytest.raises(ValueError, match="endpoint"):
        BenchConfig(**{**cfg.__dict__, "endpoint": "generate"})


def test_the_budgets_a_step_log_shows_in_a_span_of_time(tmp_path):
    """What vllm_goodput.py prints of each medha server's run: the iteration budgets its
    batches were planned in between two instants, each with its count, in the order they
    first appeared (a server that resolved its defaults again mid-run shows two)."""
    import json

    from medha.benchmark.step_errors import budgets_between

    log = tmp_path / "steps.jsonl"
    rows = [(1.0, 0.15), (2.0, 0.15), (3.0, 0.05), (4.0, 0.15), (9.0, 0.25)]
    log.write_text("".join(json.dumps({"scheduled_s": t, "budget_s": b}) + "\n" for t, b in rows))
    assert budgets_between(log, 2.0, 4.0) == {0.15: 2, 0.05: 1}
    assert list(budgets_between(log, 2.5, 4.0)) == [0.05, 0.15]
    assert budgets_between(log, 5.0, 8.0) == {}
    assert budgets_between(tmp_path / "none.jsonl", 0.0, 10.0) == {}


def test_a_goodput_runs_load_and_targets_follow_the_machines_pace():
    """bench/vllm/vllm_goodput.py's defaults: rates at 0.35, 0.7 and 1.0 over the trace's mean
    time alone, TTFT within twice that and within 1 s + each prompt's time at the trace's pace.
    At a mean of 1 s they are the AMX Xeon's runs in the docs; a machine 3.8x slower gets a load
    3.8x lighter and targets 3.8x looser, each a spec --slo takes."""
    from medha.benchmark.harness import paced_load, parse_slo

    rates, slos = paced_load(1.0, 2048)
    assert rates == [0.35, 0.7, 1.0]
    assert [parse_slo(s) for s in slos] == [(2.0, 0.0, 0.2), (1.0, 0.00049, 0.2)]
    rates, slos = paced_load(3.8, 2048)
    assert rates == [0.092, 0.18, 0.26]
    assert [parse_slo(s) for s in slos] == [(7.6, 0.0, 0.2), (1.0, 0.0019, 0.2)]
    for alone, mean in ((0.0, 2048), (-1.0, 2048), (float("nan"), 2048), (1.0, 0)):
        with pytest.raises(ValueError):
            paced_load(alone, mean)


def test_the_lengths_timed_are_the_middles_of_the_traces_fifths():
    """One length from each fifth of the trace's prompts, each a length the trace has: their
    times alone average to its mean time alone, which the mean prompt's time alone understates
    where long prompts cost more than their length (attention)."""
    from medha.benchmark.harness import paced_lengths
    from medha.sim.workload.traces import load_trace

    assert paced_lengths(list(range(1, 101))) == [11, 31, 51, 70, 90]
    prompts = [min(e.prompt_len, 8000) for e in load_trace("azure_code")]
    lengths = paced_lengths(prompts)
    assert lengths == sorted(lengths) and set(lengths) <= set(prompts)
    assert lengths[0] < sum(prompts) / len(prompts) < lengths[-1]
    with pytest.raises(ValueError):
        paced_lengths([])


def test_prompts_alone_are_timed_by_their_first_token():
    """The probe behind those defaults: the TTFT of each prompt sent alone, against a stub
    server whose first token comes 0.3 s after each request and its last 2 s after that: the
    time of the first token, not of the answer."""
    from medha.benchmark.harness import times_alone
    from medha.benchmark.stub_backend import stub_backend

    with stub_backend(delay_s=0.3, n_tokens=3, token_delay_s=1.0) as url:
        took = times_alone(url, [500, 40])
    assert len(took) == 2 and all(0.3 <= t < 2.3 for t in took)


def test_a_prompt_alone_whose_answer_streams_no_text_is_an_error(monkeypatch):
    """A probe whose one token streamed no text (a partial character) has no first token to
    time: the probe says so, rather than hand the pace a missing time."""
    import medha.benchmark.load_generator as load_generator
    from medha.benchmark.harness import times_alone

    silent = {"client": {"errors": 0}, "ttft_s": {"p50": None}}
    monkeypatch.setattr(load_generator, "run_bench", lambda cfg, progress: silent)
    with pytest.raises(RuntimeError, match="streamed no text"):
        times_alone("http://x", [100])
