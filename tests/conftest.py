import os
import tempfile

import pytest

# Keep the CPU measurement cache of the test run out of the user's home, shared by all tests.
os.environ.setdefault("MEDHA_CACHE_DIR", tempfile.mkdtemp(prefix="medha-test-cache-"))

from medha.core.config import SchedulerConfig  # noqa: E402
from medha.perf.toy_predictor import FixedCostPredictor  # noqa: E402
from medha.scheduler.block_manager import BlockManager  # noqa: E402
from medha.scheduler.replica_scheduler import ReplicaScheduler  # noqa: E402

TOKEN_S = 1 / 1024  # exact in binary, so toy timelines carry no rounding drift


def toy_scheduler(policy="lars", chunking="adaptive", num_blocks=1 << 16, token_s=TOKEN_S,
                  iteration_s=0.0, blocks: BlockManager | None = None,
                  **config) -> ReplicaScheduler:
    """`blocks` replaces the plain BlockManager of `num_blocks` blocks."""
    config.setdefault("iteration_budget_s", 1 / 16)
    cfg = SchedulerConfig(policy=policy, chunking=chunking, **config)
    return ReplicaScheduler(cfg, FixedCostPredictor(token_s, iteration_s),
                            blocks or BlockManager(num_blocks))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A 2-layer random Llama with SmolLM2's tokenizer: the fast model of the engine tests."""
    from tiny_llama import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def make_toy():
    return toy_scheduler
