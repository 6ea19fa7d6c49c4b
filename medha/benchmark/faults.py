"""Fault injection into a real engine, for tests/test_isolation.py and
bench/engine/engine_fault_injection.py: make the engine raise for one chosen request at one place of
its step. The requests both send (PROMPTS, GREEDY) are here too: the benchmark repeats the
tests' runs."""

from __future__ import annotations

from medha.engine import model_runner
from medha.engine.sampling_params import SamplingParams
from medha.engine.tokenizer import Detokenizer

PLACES = ("inputs", "forward", "sampler", "detokenizer")
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPTS = [
    [(7 * i + 3 * k) % 40000 + 100 for k in range(n)]
    for i, n in enumerate([5, 40, 17, 90, 3, 61, 28, 12])
]


def inject(monkeypatch, llm, where: str, victim: str, prompt: list[int], after: int) -> None:
    """Make the engine raise for request `victim` (and only it) at `where`, from the
    `after`-th time its work passes there."""
    seen = {"n": 0}

    def hits() -> bool:
        seen["n"] += 1
        return seen["n"] > after

    engine, runner = llm.engine, llm.engine.runner
    if where == "inputs":  # the runner reading the victim's tokens and block table
        real_inputs = model_runner.ModelRunner.chunk_inputs

        def chunk_inputs(self, batch):
            for c in (*batch.decodes, *batch.prefills):
                if c.request.request_id == victim and hits():
                    c.block_table = None  # unreadable: this batch's chunk only
            return real_inputs(self, batch)

        monkeypatch.setattr(model_runner.ModelRunner, "chunk_inputs", chunk_inputs)
    elif where == "forward":  # deep in the forward pass, whenever the victim's rows are in it
        real_prepare, real_forward = runner.prepare, runner.forward
        last = {}

        def prepare(batch, *args, **kwargs):
            step, chunks = real_prepare(batch, *args, **kwargs)
            last["step"] = step
            last["ids"] = {c.request.request_id for c in (*batch.decodes, *batch.prefills)}
            return step, chunks

        def forward(step, hidden=None, pause=None):
            if step is last.get("step") and victim in last["ids"] and hits():
                raise RuntimeError("a kernel failed on the victim's shape")
            return real_forward(step, hidden, pause)

        monkeypatch.setattr(runner, "prepare", prepare)
        monkeypatch.setattr(runner, "forward", forward)
    elif where == "sampler":  # non-finite logits in the victim's row
        from medha.engine import step_modes

        real_finish = step_modes.finish_sampling

        def finish_sampling(started, rows, params, generators, request_ids):
            if victim in request_ids and hits():
                # what a NaN anywhere in its logits makes of the row's largest (sampler.py)
                started.wait()
                started.host[0, rows[request_ids.index(victim)]] = float("nan")
            return real_finish(started, rows, params, generators, request_ids)

        monkeypatch.setattr(step_modes, "finish_sampling", finish_sampling)
    elif where == "detokenizer":  # decoding the victim's text
        real_add, real_admit = Detokenizer.add, engine.add_request

        def add(self, token):
            if getattr(self, "victim", False) and hits():
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
            return real_add(self, token)

        def add_request(request_id, *args, **kwargs):
            real_admit(request_id, *args, **kwargs)
            request = engine.scheduler.get(request_id)
            engine._states[request_id].detok.victim = request.prompt_token_ids == prompt

        monkeypatch.setattr(Detokenizer, "add", add)
        monkeypatch.setattr(engine, "add_request", add_request)
