"""`medha plan`: its input checks, the pruning chains, resuming, and the same answer from
every backend (one process, a process pool, Ray)."""

import json
import math
import os
import subprocess
import sys
from concurrent.futures import Future

import pytest

from medha.plan.search import (
    Backend,
    ChainLog,
    Fixed,
    Runner,
    capacity_chain,
    meets,
    replicas_chain,
)
from medha.plan.slo import parse_slos
from medha.plan.space import SearchSpace, SpaceError

SMALL = [
    "--trace", "azure_conv", "--num-requests", "150", "--model", "llama-3-8b",
    "--hardware", "a100,h100", "--tp", "1,2", "--replicas", "1,2",
    "--schedulers", "lars,fcfs/none", "--capacity-top", "1", "--capacity-steps", "2",
    "--max-rate", "8", "--quiet", "--no-plots",
]  # fmt: skip


def plan(tmp_path, *args, name="out", check=True):
    out = tmp_path / name
    # Without --ray-address the ray backend starts a Ray of its own: RAY_ADDRESS (here a dead
    # one, whatever the user exported) and a running `ray start` cluster are not joined.
    env = {**os.environ, "RAY_ADDRESS": "127.0.0.1:9"}
    proc = subprocess.run(
        [sys.executable, "-m", "medha", "plan", *args, "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
    )
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc, out


# ---- input -------------------------------------------------------------------------------------
def test_slos_parse_and_bad_ones_name_themselves():
    slos = parse_slos("ttft-p99=2, short-ttft-p99=0.5,tpot-p50=0.1")
    assert [(s.klass, s.metric, s.stat, s.target_s) for s in slos] == [
        (None, "ttft", "p99", 2.0),
        ("short", "ttft", "p99", 0.5),
        (None, "tpot", "p50", 0.1),
    ]
    summary = {"ttft_s": {"p99": 1.5}, "by_class": {"short": {"ttft_s": {"p99": 0.7}}}}
    assert slos[0].value(summary) == 1.5 and slos[1].value(summary) == 0.7
    assert slos[2].value(summary) == math.inf  # not reported: never met
    for bad, word in [
        ("ttft-p97=1", "ttft-p97"),
        ("ttft-p99", "ttft-p99"),
        ("ttft-p99=0", "> 0"),
        ("ttft-p99=nan", "> 0"),
        ("ttft-p99=1,ttft-p99=2", "twice"),
        ("", "at least one"),
    ]:
        with pytest.raises(ValueError, match=word):
            parse_slos(bad)


@pytest.mark.parametrize(
    "data, key",
    [
        ({"tpp": [1]}, "tpp"),
        ({"tp": [0]}, "tp"),
        ({"tp": ["two"]}, "tp"),
        ({"tp": [True]}, "tp"),
        ({"replicas": [1, 1]}, "replicas"),
        ({"replicas": []}, "replicas"),
        ({"hardware": ["tpu"]}, "hardware"),
        ({"scheduler": ["lars/bogus"]}, "scheduler"),
        ({"scheduler": ["nope"]}, "scheduler"),
        ({"iteration_budget_s": [-1]}, "iteration_budget_s"),
        ({"iteration_budget_s": ["soon"]}, "iteration_budget_s"),
        ({"dispatcher": ["random"]}, "dispatcher"),
        ({"kv_memory_gb": [float("inf")]}, "kv_memory_gb"),
        ({"max_devices": 0}, "max_devices"),
    ],
)
def test_malformed_space_names_the_key(data, key):
    with pytest.raises(SpaceError) as e:
        SearchSpace.from_mapping(data)
    assert str(e.value).startswith(key), str(e.value)


def test_space_grid_and_chains():
    space = SearchSpace.from_mapping(
        {
            "tp": [1, 2],
            "replicas": [4, 1, 2],
            "scheduler": ["lars", "fcfs/static:512"],
            "iteration_budget_s": ["default", 0.05],
        }  # fmt: skip
    )
    assert space.grid_size == 2 * 3 * 2 * 2
    chains = space.chains()
    assert len(chains) == 2 * 2 * 2
    assert all([p["replicas"] for p in c] == [1, 2, 4] for c in chains)  # ascending
    assert {p["iteration_budget_s"] for c in chains for p in c} == {None, 0.05}


def test_cli_malformed_space_exits_2_naming_the_key(tmp_path):
    bad = tmp_path / "space.yaml"
    bad.write_text("tp: [1, 2]\nreplica: [1, 2]\n")
    proc, _ = plan(tmp_path, "--trace", "azure_conv", "--slo", "ttft-p99=1", "--space",
                   str(bad), check=False)  # fmt: skip
    assert proc.returncode == 2 and "replica:" in proc.stderr, proc.stderr
    proc, _ = plan(tmp_path, "--trace", "azure_conv", "--slo", "ttft-p99=1", "--tp", "1,x",
                   check=False)  # fmt: skip
    assert proc.returncode == 2 and "tp: 'x'" in proc.stderr, proc.stderr
    proc, _ = plan(tmp_path, "--trace", "no-such.csv", "--slo", "ttft-p99=1", check=False)
    assert proc.returncode == 2 and "--trace no-such.csv" in proc.stderr, proc.stderr
    proc, _ = plan(tmp_path, "--trace", "azure_conv", "--slo", "ttft=1", check=False)
    assert proc.returncode == 2 and "'ttft=1'" in proc.stderr, proc.stderr


# ---- chains and the runner, on a model of a simulator -------------------------------------------
class Model(Backend):
    """A stand-in simulator: TTFT p99 = load / capacity, where capacity grows with replicas and
    the load with the rate; counts what it is asked to run."""

    def __init__(self):
        self.calls = []

    def submit(self, fixed, point):
        self.calls.append(point)
        ttft = point["rate"] / (point["replicas"] * point["tp"])
        fut = Future()
        fut.set_result(
            {"requests": {"total": 10, "completed": 10}, "ttft_s": {"p99": ttft}, "by_class": {}}
        )
        return fut


def chain_of(replicas):
    base = dict(hardware="h100", tp=1, spp=1, kvp=1, scheduler="lars", iteration_budget_s=None,
                dispatcher="round_robin", kv_memory_gb=None)  # fmt: skip
    return [{**base, "replicas": n} for n in replicas]


def test_replica_chain_stops_at_the_first_count_that_meets(tmp_path):
    slos = parse_slos("ttft-p99=0.3")
    model, log = Model(), ChainLog([])
    runner = Runner(Fixed("m", "t"), model, tmp_path / "points.jsonl")
    ok = lambda r: meets(r, slos)  # noqa: E731
    runner.run([replicas_chain(chain_of([1, 2, 4, 8, 16]), ok, None, lambda p: 1, log)])
    assert [p["replicas"] for p in model.calls] == [1, 2, 4]  # 1/4 <= 0.3: 8, 16 not run
    assert log.pruned_dominated == 2
    # over budget: the first count that costs too much ends the chain, nothing above it runs
    model2, log2 = Model(), ChainLog([])
    Runner(Fixed("m", "t2"), model2, tmp_path / "p2.jsonl").run(
        [replicas_chain(chain_of([1, 2, 4, 8]), ok, 2.5, lambda p: p["replicas"], log2)]
    )
    assert [p["replicas"] for p in model2.calls] == [1, 2] and log2.pruned_budget == 2


def test_capacity_chain_brackets_the_highest_rate_that_meets(tmp_path):
    slos = parse_slos("ttft-p99=1")
    model, log = Model(), ChainLog([])
    point = chain_of([3])[0]  # meets while rate / 3 <= 1: capacity 3x
    Runner(Fixed("m", "t"), model, tmp_path / "points.jsonl").run(
        [capacity_chain(point, lambda r: meets(r, slos), log, max_rate=64, steps=6)]
    )
    rates = [p["rate"] for p in model.calls]
    assert rates[:2] == [2.0, 4.0]  # doubling stops at the first miss
    assert all(r <= 4.0 for r in rates) and len(rates) == 2 + 6
    assert 2.8 < log.capacity <= 3.0  # within (4/2)^(1/2^6) of the truth, never above it
    assert not log.capacity_capped
    # one that meets every SLO up to --max-rate has capacity "at least" that
    strong, log = Model(), ChainLog([])
    Runner(Fixed("m", "t"), strong, tmp_path / "p2.jsonl").run(
        [capacity_chain(chain_of([100])[0], lambda r: meets(r, slos), log, max_rate=8, steps=6)]
    )
    assert [p["rate"] for p in strong.calls] == [2.0, 4.0, 8.0]
    assert log.capacity == 8.0 and log.capacity_capped


def test_one_replica_is_one_simulation_whatever_the_dispatcher(tmp_path):
    slos = parse_slos("ttft-p99=0.3")
    ok = lambda r: meets(r, slos)  # noqa: E731
    model = Model()
    chains = [
        [{**p, "dispatcher": d} for p in chain_of([1, 2])] for d in ("round_robin", "least_work")
    ]
    runner = Runner(Fixed("m", "t"), model, tmp_path / "points.jsonl")
    runner.run([replicas_chain(c, ok, None, lambda p: 1, ChainLog([])) for c in chains])
    assert sorted((p["replicas"], p["dispatcher"]) for p in model.calls) == [
        (1, "round_robin"),
        (2, "least_work"),
        (2, "round_robin"),
    ]
    assert runner.reused == 1


def test_runner_resumes_from_its_results_file(tmp_path):
    slos = parse_slos("ttft-p99=0.3")
    ok = lambda r: meets(r, slos)  # noqa: E731
    results = tmp_path / "points.jsonl"
    first = Model()
    Runner(Fixed("m", "t"), first, results).run(
        [replicas_chain(chain_of([1, 2, 4, 8]), ok, None, lambda p: 1, ChainLog([]))]
    )
    with results.open("a") as f:
        f.write('{"cut sho')  # an interrupted run's last line
    again, log = Model(), ChainLog([])
    runner = Runner(Fixed("m", "t"), again, results)
    runner.run([replicas_chain(chain_of([1, 2, 4, 8]), ok, None, lambda p: 1, log)])
    assert again.calls == [] and runner.reused == 3 and len(log.simulated) == 3
    # another trace is another plan: nothing reused
    other = Model()
    Runner(Fixed("m", "other"), other, results).run(
        [replicas_chain(chain_of([1, 2]), ok, None, lambda p: 1, ChainLog([]))]
    )
    assert len(other.calls) == 2


def test_pareto_front_keeps_the_best_at_each_cost():
    from medha.plan.report import pareto

    def row(label, cost, ttft):
        return {"label": label, "cost_per_hour": cost, "metrics": {"ttft-p99": ttft},
                "completed": 1, "requests": 1}  # fmt: skip

    rows = [row("a", 1, 5.0), row("b", 1, 3.0), row("c", 2, 4.0), row("d", 2, 1.0),
            row("e", 3, 2.0), row("f", 4, 0.5)]  # fmt: skip
    front = pareto(rows, parse_slos("ttft-p99=1")[0])
    assert [r["label"] for r in front] == ["b", "d", "f"]


# ---- the command, on the real simulator ----------------------------------------------------------
def test_plan_is_the_same_on_every_backend_and_twice(tmp_path):
    answers = []
    for i, backend in enumerate(["serial", "processes", "ray", "serial"]):
        proc, out = plan(
            tmp_path, *SMALL, "--slo", "ttft-p99=0.3,tpot-p99=0.05", "--backend", backend,
            "--workers", "2", name=f"out{i}",
        )  # fmt: skip
        answers.append(json.loads((out / "plan.json").read_text()))
    first = answers[0]
    for other in answers[1:]:
        for key in ("best", "pareto", "capacity", "deployments", "counts"):
            assert other[key] == first[key], key
    c = first["counts"]
    assert (
        c["grid"] == 16
        and c["simulations_run"] == c["simulated_grid_points"] + c["capacity_simulations"]
    )
    assert c["simulated_grid_points"] + c["pruned_more_replicas_than_needed"] == 16
    assert c["same_as_another_point"] == 0
    best = first["best"]
    assert best["meets"] and best["capacity"] >= 1
    cheaper = [d for d in first["deployments"] if d["cost_per_hour"] < best["cost_per_hour"]]
    assert all(not d["meets"] for d in cheaper)
    for d in first["deployments"]:
        m = d["metrics"]
        assert d["meets"] == (m["ttft-p99"] <= 0.3 and m["tpot-p99"] <= 0.05)
    # a rerun into the same directory simulates nothing again
    proc, out = plan(tmp_path, *SMALL, "--slo", "ttft-p99=0.3,tpot-p99=0.05", "--backend",
                     "serial", name="out0")  # fmt: skip
    again = json.loads((out / "plan.json").read_text())
    assert again["counts"]["simulations_run"] == 0 and again["best"] == first["best"]


def test_infeasible_slos_say_which_and_by_how_much(tmp_path):
    proc, out = plan(tmp_path, *SMALL, "--slo", "ttft-p99=0.0001,tpot-p99=10", "--backend",
                     "serial")  # fmt: skip
    result = json.loads((out / "plan.json").read_text())
    assert result["best"] is None
    per = result["infeasible"]["per_slo"]
    assert not per["ttft-p99"]["met_by_some"] and per["ttft-p99"]["miss_factor"] > 1
    assert per["tpot-p99"]["met_by_some"]
    assert "No deployment meets every SLO" in proc.stdout and "ttft-p99 <= 0.0001 s" in proc.stdout
    assert result["infeasible"]["closest"]["label"] in {d["label"] for d in result["deployments"]}
    assert result["counts"]["pruned_more_replicas_than_needed"] == 0  # nothing met: all ran


def test_budget_and_deployments_that_cannot_run(tmp_path):
    proc, out = plan(
        tmp_path, "--trace", "azure_conv", "--num-requests", "100", "--hardware", "a100",
        "--tp", "1,3", "--replicas", "1,2,4", "--schedulers", "lars", "--slo",
        "ttft-p99=0.0001", "--budget", "10", "--backend", "serial", "--quiet", "--no-plots",
    )  # fmt: skip
    result = json.loads((out / "plan.json").read_text())
    c = result["counts"]
    assert all(d["cost_per_hour"] <= 10 for d in result["deployments"])
    assert c["pruned_over_budget"] == 1  # 4 x a100 tp1 (12 US$/h); tp3 stops at its error
    errors = [d for d in result["deployments"] if "error" in d]
    assert errors and all(d["point"]["tp"] == 3 for d in errors) and c["pruned_cannot_run"] >= 1
