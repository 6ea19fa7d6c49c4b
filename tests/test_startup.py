"""Start-up: what building the CLI's parser and `import medha` import, and the set-up cache
of the fitted predictor and the prefill-time cache (medha/perf/setup_cache.py)."""

import contextlib
import io
import json
import logging
import subprocess
import sys

import pytest

from medha.cli import main
from medha.perf import ParallelConfig, make_predictor
from medha.perf.prefill_time_cache import PrefillTimeCache
from medha.perf.profile_data import IterationRow, Profile, ProfileError
from medha.perf.profiled_predictor import ProfiledPredictor
from medha.scheduler.config import SchedulerConfig
from medha.scheduler.packers import make_packer
from medha.sim.metrics.summary import WALL_CLOCK_KEYS

HEAVY = {"torch", "fastapi", "uvicorn", "httpx", "matplotlib", "pandas", "scipy", "numpy"}


def imported(code: str) -> set[str]:
    """Top-level packages in sys.modules after `code` ran in a fresh interpreter."""
    code += "\nimport sys; print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return set(out.stdout.split())


def test_the_cli_parser_imports_nothing_heavy():
    code = """
import contextlib, io
from medha.cli import main
from medha.scheduler.config import SchedulerConfig
for argv in (["--help"], ["simulate", "--help"], ["serve", "--help"], ["bench", "--help"],
             ["analyze", "deferred-prefill", "--help"], ["demo", "--help"], ["route", "--help"]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        main(argv)
"""
    assert imported(code) & HEAVY == set()


def test_the_router_imports_no_engine():
    """`medha route` runs beside replicas on any machine: no torch, transformers or engine (torch
    made unimportable; its CPU spec is the reference one conftest stores, so nothing is
    measured here, and where nothing is stored the measurement falls back to numpy)."""
    code = """
import sys
sys.modules["torch"] = None
from medha.route.app import Router
from medha.route.config import RouteConfig
Router(RouteConfig(predictor="roofline"), ["http://127.0.0.1:9"])
assert not [m for m in sys.modules if m.startswith("medha.engine")], "the engine"
"""
    assert "transformers" not in imported(code)


def test_import_medha_is_light():
    assert "torch" not in imported("import medha; assert 'LLM' in dir(medha)")


@pytest.mark.engine  # loads the engine, and so torch
def test_medha_exports_the_engine_on_use():
    code = """
import medha
from medha import LLM, LLMEngine, SamplingParams
from medha.engine.llm import LLM as llm_class
assert LLM is llm_class and medha.LLMEngine is LLMEngine
assert SamplingParams(max_tokens=3).max_tokens == 3
try:
    medha.no_such_name
except AttributeError as e:
    assert "no_such_name" in str(e)
else:
    raise AssertionError("no AttributeError")
"""
    assert "torch" in imported(code)


# ---- the set-up cache -------------------------------------------------------------


def simulate(out, *flags) -> dict:
    """`medha simulate` of a few 20K-token prompts, in this process; its summary.json without
    the wall-clock fields, and its requests.csv."""
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        code = main(
            [
                "simulate",
                "--hardware",
                "h100",
                "--trace",
                "synthetic",
                "--prompt-len",
                "20000",
                "--output-len",
                "8",
                "--qps",
                "2",
                "--num-requests",
                "4",
                "--quiet",
                "--no-plots",
                "--overwrite",
                "--out",
                str(out),
                *flags,
            ]
        )
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    for k in WALL_CLOCK_KEYS:
        summary["sim"].pop(k)
    return {"summary": summary, "requests": (out / "requests.csv").read_text()}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache directory; yields the folder the set-up files go to."""
    monkeypatch.setenv("MEDHA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("MEDHA_NO_SETUP_CACHE", raising=False)
    return tmp_path / "cache" / "setup"


def no_walking(monkeypatch):
    def walk(self, num_tokens):
        raise AssertionError(f"walked to {num_tokens} tokens instead of using the cache")

    monkeypatch.setattr(PrefillTimeCache, "_walk_to", walk)


def test_a_second_run_takes_the_walk_from_the_cache_and_gives_the_same_results(
    cache, tmp_path, monkeypatch
):
    cold = simulate(tmp_path / "cold")
    [stored] = cache.iterdir()
    with monkeypatch.context() as m:
        no_walking(m)
        warm = simulate(tmp_path / "warm")
    assert warm == cold
    monkeypatch.setenv("MEDHA_NO_SETUP_CACHE", "1")
    assert simulate(tmp_path / "off") == cold
    assert list(cache.iterdir()) == [stored]


def test_changed_inputs_miss(cache, tmp_path):
    simulate(tmp_path / "out")
    for flags in (
        ("--tpot-target-s", "0.04"),
        ("--predictor", "roofline-padded"),
        ("--spp", "2"),
        ("--hardware", "a100"),
    ):
        before = set(cache.iterdir())
        simulate(tmp_path / "out", *flags)
        assert len(set(cache.iterdir()) - before) == 1, flags


@pytest.mark.parametrize(
    "content", [b"", b'{"chunks": [1, 2', b"[]", b'{"chunks": [0], "cumulative_s": [0.0, 1.0]}']
)
def test_a_corrupt_cache_file_is_a_miss_and_is_replaced(cache, tmp_path, content):
    cold = simulate(tmp_path / "out")
    [path] = cache.iterdir()
    path.write_bytes(content)
    assert simulate(tmp_path / "out") == cold
    assert json.loads(path.read_bytes())["chunks"]


def test_a_cache_that_cannot_be_written_only_costs_time(cache, tmp_path, monkeypatch, caplog):
    cold = simulate(tmp_path / "cold")  # with a cache that can be written
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("MEDHA_CACHE_DIR", str(tmp_path / "a_file"))
    with caplog.at_level(logging.WARNING, logger="medha.perf"):
        assert simulate(tmp_path / "out") == cold
    assert "could not write the set-up cache" in caplog.text  # it tried, and went on
    assert (tmp_path / "a_file").read_text() == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "cache", "cold", "out"]


def test_the_walk_is_the_same_in_any_order_and_restored():
    pred = make_predictor("roofline", "llama-3-8b", "h100")
    plan = make_packer(SchedulerConfig(iteration_budget_s=0.05), pred).plan_isolated
    lengths = [1, 700, 5000, 77_777, 123_456, 300_000]
    up = PrefillTimeCache(pred, plan, 300_000)
    times = [up.time(n) for n in lengths]
    down = PrefillTimeCache(pred, plan, 300_000)
    assert [down.time(n) for n in reversed(lengths)] == times[::-1]
    assert down.boundaries[-1] == 300_000
    part = PrefillTimeCache(pred, plan, 300_000)
    part.time(5000)
    restored = PrefillTimeCache(pred, plan, 300_000)
    restored.restore(json.loads(json.dumps(part.walked())))
    assert restored.boundaries == part.boundaries
    assert [restored.time(n) for n in lengths] == times
    with pytest.raises(ValueError):
        restored.restore({"chunks": [300_001], "cumulative_s": [0.0, 1.0]})


def small_profile() -> Profile:
    """Every kind of row the fitted predictor fits: ops, collectives, whole iterations."""
    truth = make_predictor("roofline", "smollm2", "h100")
    ops = [
        (op, n, 1, truth.op_time(op, n))
        for op in ("mlp_up_proj", "attn_rope")
        for n in range(16, 4096, 97)
    ]
    collectives = [
        ("all_reduce", 2, 2, b, 1e-5 + b / 1e11) for b in range(1 << 10, 1 << 24, 1 << 19)
    ]
    iterations = [
        IterationRow(1, ((n, k),), (k + 1,) * (n % 7), truth.shape_time([(n, k)]))
        for n in range(1, 2048, 61)
        for k in (0, 3000)
    ]
    return Profile(
        sources=["synthetic"], op_rows=ops, collective_rows=collectives, iteration_rows=iterations
    )


def test_the_fitted_predictor_comes_from_the_cache(cache, monkeypatch):
    spec = make_predictor("roofline", "smollm2", "h100")
    profile = small_profile()
    fitted = ProfiledPredictor(spec.model, spec.hardware, spec.parallel, profile)
    [stored] = cache.iterdir()
    shapes = [([(n, k)], [k] * d) for n in (1, 300, 2000) for k in (0, 5000) for d in (0, 9)]
    with monkeypatch.context() as m:
        m.setattr(ProfiledPredictor, "_fit", lambda *a: pytest.fail("fitted again"))
        cached = ProfiledPredictor(spec.model, spec.hardware, spec.parallel, profile)
    assert [cached.shape_time(*s) for s in shapes] == [fitted.shape_time(*s) for s in shapes]
    assert cached.all_reduce_time(1 << 20) == fitted.all_reduce_time(1 << 20)
    assert cached._fits() == fitted._fits()
    stored.write_text('{"ops": {"add": [[1.0], [1.0, 2.0]]}, "all_reduce": null}')
    ProfiledPredictor(spec.model, spec.hardware, spec.parallel, profile)  # a miss: fits again
    assert json.loads(stored.read_text()) == fitted._fits()
    with pytest.raises(ProfileError, match="not tp=2"):  # a miss: this profile has no tp 2
        ProfiledPredictor(spec.model, spec.hardware, ParallelConfig(tp=2), profile)
