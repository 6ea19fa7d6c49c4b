"""Per generated token, what the engine does besides the model, at short and long prompts.

    python bench/engine/engine_bookkeeping.py [--prompts 100,6000] [--steps 40] [--model smollm2]

For each prompt length: admit one request, run its prefill, then time `engine.step()` over
`--steps` decodes. The model's work (ModelRunner.forward: embeddings, attention, MLPs; and
ModelRunner.logits) is timed separately and taken out; what is left is the engine's
bookkeeping per token: scheduling, building the step's inputs (`prepare`, timed on its own:
its attention metadata, the decode's mask and slots, grows with the context by design),
sampling, detokenizing, applying the result and building the RequestOutput; `schedule`
(ReplicaScheduler.schedule), `update` (applying the result) and `sample` (both its halves) are
timed on their own too. Prints medians in microseconds and the long/short ratios. Uses only the
public engine API and the runner's methods, so it runs on older commits too
(`PYTHONPATH=<worktree>`).
"""

from __future__ import annotations

import argparse
import statistics
import time

from medha.engine import llm_engine
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
    engine.add_request(
        f"p{prompt_len}",
        None,
        SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True),
        prompt_token_ids=ids,
    )
    while not any(o.new_token_ids for o in engine.step()):  # the prefill, to its first token
        pass
    runner, sched = engine.runner, engine.scheduler
    model = [Timed(runner.forward), Timed(runner.logits)]
    parts = {
        "prepare": Timed(runner.prepare),
        "schedule": Timed(sched.schedule),
        "update": Timed(sched.update),
    }
    # sampling: one function before issue 49, its device half and its host half since
    samplers = [
        n for n in ("sample", "start_sampling", "finish_sampling") if hasattr(llm_engine, n)
    ]
    sampling = {name: Timed(getattr(llm_engine, name)) for name in samplers}
    runner.forward, runner.logits, runner.prepare = model[0], model[1], parts["prepare"]
    sched.schedule, sched.update = parts["schedule"], parts["update"]
    for name, timed in sampling.items():
        setattr(llm_engine, name, timed)
    rows = []
    try:
        for _ in range(steps):
            before_model = sum(t.seconds for t in model)
            before = {k: t.seconds for k, t in parts.items()}
            before_sampling = sum(t.seconds for t in sampling.values())
            t0 = time.perf_counter()
            engine.step()
            total = time.perf_counter() - t0
            m = sum(t.seconds for t in model) - before_model
            row = {k: t.seconds - before[k] for k, t in parts.items()}
            row["sample"] = sum(t.seconds for t in sampling.values()) - before_sampling
            row.update(bookkeeping=total - m, model=m)
            row["rest"] = row["bookkeeping"] - sum(row[k] for k in (*parts, "sample"))
            rows.append(row)
    finally:
        del runner.forward, runner.logits, runner.prepare, sched.schedule, sched.update
        for name, timed in sampling.items():
            setattr(llm_engine, name, timed.fn)
        while engine.has_unfinished():
            engine.step()
    return {
        k: statistics.median(r[k] for r in rows) * (1e3 if k == "model" else 1e6) for k in rows[0]
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
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
    cols = ["bookkeeping", "prepare", "schedule", "update", "sample", "rest"]
    print(
        "| prompt tokens | bookkeeping per token | of it: prepare | schedule | update | "
        "sample | the rest | model (forward + logits) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    med = {n: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for n, rs in results.items()}
    for n, m in med.items():
        print(
            f"| {n} | " + " | ".join(f"{m[k]:.0f} us" for k in cols) + f" | {m['model']:.1f} ms |"
        )
    lo, hi = med[lengths[0]], med[lengths[-1]]
    print(
        f"\n{lengths[-1]} / {lengths[0]} tokens: "
        + ", ".join(f"{k} {hi[k] / lo[k]:.2f}x" for k in cols)
    )


if __name__ == "__main__":
    main()
