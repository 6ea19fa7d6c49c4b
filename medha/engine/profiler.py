"""`medha profile`: measure this machine's iteration times for the fitted predictor.

Every measurement is a real forward pass of the engine's model runner over a synthetic batch
(prefill chunks of n tokens after k cached ones, decodes over KV of given lengths; the shapes
are medha/perf/grid.py's), timed after a warm-up run of the same shape. The result is a medha
JSON profile of whole iterations, which `--predictor profiled:PATH` fits jointly (see
medha/perf/profiled_predictor.py).
"""

from __future__ import annotations

import logging
import random
import statistics
import time

from tqdm import tqdm

from medha.core.batch import Batch, Chunk
from medha.core.request import Request
from medha.perf.grid import Shape
from medha.perf.predictor import Predictor
from medha.perf.profile_data import IterationRow, Profile

log = logging.getLogger("medha.engine")


class ShapeDoesNotFit(RuntimeError):
    """The KV cache (of this layout: with KVP, each group's share) cannot hold a shape's
    contexts: the shape is skipped, not the profile."""


class Profiler:
    def __init__(self, engine, seed: int = 0) -> None:
        """`engine`: an idle LLMEngine (not imported here: the engine imports this module to
        time itself at start)."""
        if engine.has_unfinished():
            raise RuntimeError("profile an idle engine")
        self.engine = engine
        self.rng = random.Random(seed)

    def measure(self, shape: Shape, repeats: int = 2, warm_up: bool = True) -> float:
        """Best of `repeats` timed runs, after one warm-up unless `warm_up` is False (where
        the process has run its kernels already and a shape's first run costs what its
        others do), in seconds."""
        e = self.engine
        bm = e.scheduler.blocks
        vocab = e.runner.args.vocab_size
        held, decodes, prefills = [], [], []

        def chunk(name: str, start: int, num_tokens: int) -> Chunk:
            tokens = start + num_tokens
            r = Request.from_tokens(
                name, 0.0, [self.rng.randrange(3, vocab) for _ in range(tokens)], 1
            )
            held.append(name)
            self._reserve(r, tokens)
            return Chunk(r, start, num_tokens, True, bm.blocks_of(name))

        try:
            prefills = [chunk(f"p{i}", k, n) for i, (n, k) in enumerate(shape.prefills)]
            decodes = [chunk(f"d{i}", kv, 1) for i, kv in enumerate(shape.decode_kv)]
            batch = Batch(0, 0.0, decodes, prefills)
            best = float("inf")
            for attempt in range(repeats + warm_up):
                t0 = time.perf_counter()
                e.execute(batch)
                if attempt or not warm_up:  # the first run warms kernels up for the shape
                    best = min(best, time.perf_counter() - t0)
            return best
        finally:
            for rid in held:
                bm.free(rid)

    def _reserve(self, r: Request, tokens: int) -> None:
        bm = self.engine.scheduler.blocks
        if bm.grow(r.request_id, tokens) < tokens:
            raise ShapeDoesNotFit(
                f"the KV cache cannot hold a {tokens}-token context beside the shape's others "
                "(--kv-memory-gb; with --kvp, each group's share)"
            )

    def run(
        self,
        shapes: list[Shape],
        progress: bool = True,
        budget_s: float | None = None,
        predictor: Predictor | None = None,
        repeats: int = 2,
    ) -> Profile:
        """Time `shapes` in order (`repeats` timed runs each after a warm-up). With `budget_s`,
        stop once the time is spent, and skip a shape whose runs `predictor` says (scaled by
        what the shapes timed so far took against it) would not fit what is left."""
        e = self.engine
        profile = Profile(sources=["medha profile"], model=e.spec.name, hardware=e.device.type)
        start, ratios, skipped = time.perf_counter(), [], []
        bar = tqdm(shapes, desc="profiling", unit="batch", disable=not progress)
        for shape in bar:
            predicted = (
                None if predictor is None else predictor.shape_time(shape.prefills, shape.decode_kv)
            )
            if budget_s is not None:
                left = budget_s - (time.perf_counter() - start)
                if left <= 0:
                    break
                scale = statistics.median(ratios) if ratios else 1.0
                if predicted is not None and (repeats + 1) * predicted * scale > left:
                    continue
            try:
                seconds = self.measure(shape, repeats)
            except ShapeDoesNotFit as e:  # the grid asks what the whole cache holds; a layout
                # (KVP's groups filled one after another) may hold less of one shape
                skipped.append(shape)
                log.info("profile: skipping %s: %s", shape, e)
                continue
            if predicted:
                ratios.append(seconds / predicted)
            profile.iteration_rows.append(IterationRow(1, shape.prefills, shape.decode_kv, seconds))
        bar.close()
        if skipped:
            log.warning(
                "profile: %d of %d shapes skipped, the KV cache cannot hold them (--kv-memory-gb)",
                len(skipped), len(shapes),
            )  # fmt: skip
        return profile
