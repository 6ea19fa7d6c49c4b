"""Per generated token, what the engine does besides the model, at short and long prompts.

    python bench/engine_bookkeeping.py [--prompts 100,6000] [--steps 40] [--model smollm2]

For each prompt length: admit one request, run its prefill, then time `engine.step()` over
`--steps` decodes. The model's work (ModelRunner.forward: embeddings, attention, MLPs; and
ModelRunner.logits) is timed separately and taken out; what is left is the engine's
bookkeeping per token: scheduling, building the step's inputs (`prepare`, timed on its own:
its attention metadata, the decode's mask and slots, grows with the context by design),
sampling, detokenizing, applying the result and building the RequestOutput. Prints medians in
microseconds and the long/short ratios. Uses only the public engine API and the runner's
methods, so it runs on older commits too (`PYTHONPATH=<worktree>`).
"""

from __future__ import annotations

import argparse
import statistics
import time

from medha.engine.llm_engine import EngineConfig, LLMEngine
from medha.engine.sampling_params import SamplingParams


class Timed:
    """Wraps a bound method and adds its wall time to `seconds`."""

    def __init__(self, fn) -> None:
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0


def measure(engine: LLMEngine, prompt_len: int, steps: int) -> dict[str, float]:
    vocab = engine.runner.args.vocab_size
    ids = [(7 * i) % (vocab - 3) + 3 for i in range(prompt_len)]
    engine.add_request(f"p{prompt_len}", None, SamplingParams(max_tokens=steps + 4,
                                                              temperature=0, ignore_eos=True),
                       prompt_token_ids=ids)
    while not any(o.new_token_ids for o in engine.step()):  # the prefill, to its first token
        pass
    runner = engine.runner
    model = [Timed(runner.forward), Timed(runner.logits)]
    prepare = Timed(runner.prepare)
    runner.forward, runner.logits, runner.prepare = model[0], model[1], prepare
    rows = []
    try:
        for _ in range(steps):
            before_model, before_prepare = sum(t.seconds for t in model), prepare.seconds
            t0 = time.perf_counter()
            engine.step()
            total = time.perf_counter() - t0
            m = sum(t.seconds for t in model) - before_model
            rows.append((total - m, prepare.seconds - before_prepare, m))
    finally:
        del runner.forward, runner.logits, runner.prepare
        while engine.has_unfinished():
            engine.step()
    return {"bookkeeping_us": statistics.median(r[0] for r in rows) * 1e6,
            "prepare_us": statistics.median(r[1] for r in rows) * 1e6,
            "rest_us": statistics.median(r[0] - r[1] for r in rows) * 1e6,
            "model_ms": statistics.median(r[2] for r in rows) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prompts", default="100,6000", help="comma-separated prompt lengths")
    ap.add_argument("--steps", type=int, default=40, help="decodes timed per prompt")
    ap.add_argument("--repeats", type=int, default=2, help="rounds over the prompt lengths")
    args = ap.parse_args()
    lengths = [int(n) for n in args.prompts.split(",")]
    engine = LLMEngine(EngineConfig(model=args.model, kv_memory_gb=0.5))
    results: dict[int, list[dict]] = {n: [] for n in lengths}
    for _ in range(args.repeats):  # alternate the lengths
        for n in lengths:
            results[n].append(measure(engine, n, args.steps))
    print("| prompt tokens | bookkeeping per token | of it prepare | the rest | model "
          "(forward + logits) |")
    print("|---|---|---|---|---|")
    med = {n: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
           for n, rs in results.items()}
    for n, m in med.items():
        print(f"| {n} | {m['bookkeeping_us']:.0f} us | {m['prepare_us']:.0f} us | "
              f"{m['rest_us']:.0f} us | {m['model_ms']:.1f} ms |")
    lo, hi = med[lengths[0]], med[lengths[-1]]
    print(f"\n{lengths[-1]} / {lengths[0]} tokens: bookkeeping "
          f"{hi['bookkeeping_us'] / lo['bookkeeping_us']:.2f}x, prepare "
          f"{hi['prepare_us'] / lo['prepare_us']:.2f}x, the rest "
          f"{hi['rest_us'] / lo['rest_us']:.2f}x")


if __name__ == "__main__":
    main()
