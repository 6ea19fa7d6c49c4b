"""Parallel worker processes (torch.distributed, gloo): every tp x spp x kvp layout of up to 4
processes gives the same tokens and logits as one process, on SmolLM2 (3 KV heads, split 2 + 1
at tp 2) and on a tiny random Llama."""

import functools
import json
import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from medha.analysis.schedule_match import recording
from medha.core.batch import BatchResult
from medha.engine.checkpoint import resolve_model
from medha.engine.errors import EngineError
from medha.engine.llm import LLM
from medha.engine.sampling_params import SamplingParams
from medha.scheduler.config import SchedulerConfig
from medha.testing.numerics import (
    assert_greedy_agrees,
    assert_logits_within,
    greedy_reference,
    logit_bound,
)

GREEDY = SamplingParams(max_tokens=12, temperature=0)
# static chunks: the schedule, hence each GEMM's shape, does not depend on timing
# the prefix cache off: one process would have it on by default (worker processes have it
# off), and _prefill_logits reruns a prompt generate() ran, which its cache would serve
SCHED = SchedulerConfig(policy="fcfs", chunking="static:64", prefix_cache="off")


TEXT = " ".join(
    f"Report {i}: the harbour of town {i * 7 % 13} saw {i * 3 % 11} ships arrive "
    "before noon, and the market sold fish, bread and oil."
    for i in range(30)
)


def _prompts(llm):
    ids = llm.tokenizer.encode(TEXT)
    return [ids[i * 41 : i * 41 + n] for i, n in enumerate((3, 17, 90, 230))]


def _prefill_logits(llm, ids):
    """Every row's logits of one prefill, and the most KVP groups its KV spanned."""
    engine = llm.engine
    blocks = engine.scheduler.blocks
    engine.add_request("x", None, SamplingParams(max_tokens=1, temperature=0), prompt_token_ids=ids)
    rows, groups = [], 1
    while engine.has_unfinished():
        batch = engine.scheduler.schedule(time.monotonic())
        logits, _ = engine.execute(batch, all_logits=True)
        rows.append(logits)
        groups = max(groups, getattr(blocks, "groups_holding", lambda _: 1)("x"))
        tokens = {"x": 0} if batch.prefills[-1].samples else None
        engine.scheduler.update(batch, BatchResult(0.01, tokens), time.monotonic())
    return torch.cat(rows), groups


@functools.cache
def _run(model, **parallel):
    llm = LLM(model, kv_memory_gb=0.05, scheduler=SCHED, **parallel)
    try:
        prompts = _prompts(llm)
        tokens = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        logits, groups = _prefill_logits(llm, prompts[-1])
        assert llm.engine.scheduler.blocks.num_used == 0
        return tokens, logits, groups
    finally:
        llm.engine.close()


# 64 tokens per KVP group: the 230-token prompt (and the 90-token one) span both groups
KVP = {"kvp": 2, "max_tokens_per_kvp_group": 64}
LAYOUTS = {
    "tp2": {"tp": 2},
    "spp2": {"spp": 2},
    "kvp2": KVP,
    "tp2-spp2": {"tp": 2, "spp": 2},
    "tp2-kvp2": {"tp": 2, **KVP},
    "spp2-kvp2": {"spp": 2, **KVP},
}


@functools.cache
def _references(path: str):
    """transformers' greedy decisions on _prompts, and the rounding bound of the last one's
    prefill (medha/testing/numerics.py)."""
    llm = LLM(path, kv_memory_gb=0.01)
    prompts = _prompts(llm)
    model_dir = str(resolve_model(path))
    return greedy_reference(model_dir, prompts, GREEDY.max_tokens), logit_bound(
        model_dir, prompts[-1]
    )


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model", ["smollm2", "tiny"])
def test_parallel_run_matches_one_process(model, layout, tiny_model):
    path = tiny_model if model == "tiny" else model
    parallel = LAYOUTS[layout]
    reference, bound = _references(path)
    tokens1, logits1, _ = _run(path)
    tokens2, logits2, groups = _run(path, **parallel)
    # the all-reduce adds the ranks' partial sums, and the KVP merge the groups' partial
    # attentions, in orders one process never uses, on other thread counts: both runs agree
    # with transformers' decisions and lie within float32's rounding of each other
    assert_greedy_agrees(tokens1, reference)
    assert_greedy_agrees(tokens2, reference)
    assert groups == parallel.get("kvp", 1)
    assert_logits_within(logits2, logits1, bound.between_two())


def test_impossible_layouts_are_refused(tiny_model):
    with pytest.raises(EngineError, match="KV heads"):
        LLM(tiny_model, kv_memory_gb=0.01, tp=3)
    with pytest.raises(EngineError, match="tp must be a positive integer"):
        LLM(tiny_model, kv_memory_gb=0.01, tp=0)
    with pytest.raises(EngineError, match="spp=3 exceeds the model's 2 layers"):
        LLM(tiny_model, kv_memory_gb=0.01, spp=3)
    with pytest.raises(EngineError, match="kvp must be a positive integer"):
        LLM(tiny_model, kv_memory_gb=0.01, kvp=0)
    with pytest.raises(EngineError, match=r"max_tokens_per_kvp_group \(40\) must be a multiple"):
        LLM(tiny_model, kv_memory_gb=0.01, kvp=2, max_tokens_per_kvp_group=40)


def _spawned_children(pid: int) -> list[int]:
    """Worker processes of `pid` (torch.multiprocessing spawn children)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmd = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and b"spawn_main" in cmd:
            out.append(int(stat.parent.name))
    return out


def _stream_until_error(url: str, killed: list[int], worker: int) -> dict:
    body = {
        "model": "smollm2",
        "prompt": "Once upon a time",
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return event["error"]
            if not killed:  # the request is running: take a rank away under it
                os.kill(worker, signal.SIGKILL)
                killed.append(worker)
    raise AssertionError("the stream ended without an error")


@pytest.mark.server  # starts `medha serve`
def test_a_dead_worker_fails_requests_with_503_and_a_restart_serves_again():
    from test_server import Server

    server = Server("--tp", "2")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        out = client.completions.create(
            model="smollm2", prompt="The capital of France is", max_tokens=4, temperature=0
        )
        assert out.usage.completion_tokens == 4
        workers = _spawned_children(server.proc.pid)
        assert len(workers) == 1
        t0 = time.monotonic()
        error = _stream_until_error(server.url, killed := [], workers[0])
        assert killed and time.monotonic() - t0 < 30  # failed, not hung
        assert error["type"] == "service_unavailable" and "engine failed" in error["message"]
        r = httpx.post(
            server.url + "/v1/completions",
            json={"model": "smollm2", "prompt": "Hi", "max_tokens": 2},
        )
        assert r.status_code == 503 and "engine failed" in r.json()["error"]["message"]
        assert httpx.get(server.url + "/health").status_code == 503
    finally:
        server.stop()
    restarted = Server("--tp", "2")
    try:
        client = openai.OpenAI(base_url=restarted.url + "/v1", api_key="x", max_retries=0)
        again = client.completions.create(
            model="smollm2", prompt="The capital of France is", max_tokens=4, temperature=0
        )
        assert again.choices[0].text == out.choices[0].text
    finally:
        assert restarted.stop() == 0


def test_pipeline_stages_chained_equal_the_whole_model(tiny_model):
    from medha.engine.model_runner import ModelRunner
    from medha.engine.parallel.stage import Stage

    for path in (resolve_model("smollm2"), Path(tiny_model)):
        llm = LLM(str(path), kv_memory_gb=0.02, scheduler=SCHED)
        engine = llm.engine
        cfg = json.loads((path / "config.json").read_text())
        stages = [
            ModelRunner(
                path,
                cfg,
                engine.device,
                engine.dtype,
                engine.scheduler.blocks.num_blocks,
                engine.runner.block_size,
                stage=Stage(i, 2),
                kernels=engine.runner.kernels,  # the engine's own (torch's or vLLM's)
            )
            for i in range(2)
        ]
        half = cfg["num_hidden_layers"] // 2
        assert [len(r.model.layers) for r in stages] == [half, half]
        assert stages[0].model.norm is None and stages[1].model.embed_tokens is None
        engine.add_request(
            "x",
            None,
            SamplingParams(max_tokens=1, temperature=0),
            prompt_token_ids=_prompts(llm)[-1],
        )
        while engine.has_unfinished():
            batch = engine.scheduler.schedule(time.monotonic())
            step, _ = engine.runner.prepare(batch, all_logits=True)
            whole = engine.runner.run(step)
            staged = stages[0].logits(step, stages[1].forward(step, stages[0].forward(step)))
            assert torch.equal(staged, whole)  # the same operations, in the same order
            tokens = {"x": 0} if batch.prefills[-1].samples else None
            engine.scheduler.update(batch, BatchResult(0.01, tokens), time.monotonic())
    with pytest.raises(EngineError, match="pipeline stages for 2 layers"):
        ModelRunner(Path(tiny_model), cfg, engine.device, engine.dtype, 4, 16, stage=Stage(0, 3))


def test_spp_stages_work_on_consecutive_chunks_at_once():
    """Chunk i+1 enters the pipeline while chunk i is still in it: decided by the engine, so
    checked from its decisions (how many batches had completed when each was formed), not
    from the clock; the stages' overlap in time is bench/engine/engine_spp.py's to measure."""
    llm = LLM(
        "smollm2",
        kv_memory_gb=0.05,
        spp=2,
        scheduler=SchedulerConfig(policy="fcfs", chunking="static:128"),
    )
    try:
        ids = llm.tokenizer.encode(TEXT + " " + TEXT)[:1024]
        with recording() as log:
            llm.generate([ids], SamplingParams(max_tokens=1, temperature=0))
        rid = log[0][0][0][0]
        assert [p for p, *_ in log] == [((rid, 128 * i, 128),) for i in range(8)]
        # completed before chunk i: i - 1 once the pipeline is full (i alone would mean no
        # overlap: every chunk waited for the one before it)
        assert [completed for _, _, completed, *_ in log] == [0, 0, 1, 2, 3, 4, 5, 6]
        stages = sorted((b, s) for b, s, *_ in llm.engine.pipeline.stage_times)
        batches = sorted({b for b, _ in stages})
        assert len(batches) == 8 and stages == [(b, s) for b in batches for s in (0, 1)]
    finally:
        llm.engine.close()


@pytest.mark.server  # starts `medha serve`
def test_serve_with_tp_and_kvp_answers_the_openai_client_as_one_process():
    from test_server import Server

    prompt = TEXT[:600]  # about 130 tokens: both KVP groups of 64 tokens hold some
    llm = LLM("smollm2", kv_memory_gb=0.05)
    try:
        expected = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0))[0].text
    finally:
        llm.engine.close()
    server = Server("--tp", "2", "--kvp", "2", "--max-tokens-per-kvp-group", "64")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        out = client.completions.create(model="smollm2", prompt=prompt, max_tokens=8, temperature=0)
        assert out.choices[0].text == expected
        assert len(_spawned_children(server.proc.pid)) == 3
        assert server.wait_idle()["medha_kv_blocks_used"] == 0
    finally:
        assert server.stop() == 0


def test_profile_runs_on_a_parallel_layout(tiny_model, tmp_path):
    import subprocess
    import sys

    from medha.engine.profiler import Profiler
    from medha.perf.grid import grid
    from medha.perf.profile_data import load_profile

    out = tmp_path / "p.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "medha",
            "profile",
            "--model",
            tiny_model,
            "--spp",
            "2",
            "--kvp",
            "2",
            "--max-tokens-per-kvp-group",
            "256",
            "--kv-memory-gb",
            "0.05",
            "--dtype",  # (auto could differ between this process and the CLI's: KV capacity)
            "float32",
            "--quick",
            "--mixed",
            "2",
            "--quiet",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    rows = load_profile(out).iteration_rows
    # the shapes the profiler plans for this engine, each timed once
    llm = LLM(
        tiny_model, kv_memory_gb=0.05, dtype="float32", spp=2, kvp=2, max_tokens_per_kvp_group=256
    )
    try:
        e = llm.engine
        seqs = e.scheduler.config.max_num_seqs
        shapes = grid(e.max_model_len, e.kv_capacity_tokens, 2, 0, quick=True, max_num_seqs=seqs)
        assert [(r.prefills, r.decode_kv) for r in rows] == [
            (s.prefills, s.decode_kv) for s in shapes
        ]
        assert all(r.seconds > 0 for r in rows)
        # a timed run is the whole pipeline's: both stages ran it before the time was taken
        before = len(llm.engine.pipeline.stage_times)
        Profiler(llm.engine).measure(shapes[0], repeats=2)
        ran = [s for _, s, *_ in llm.engine.pipeline.stage_times[before:]]
        assert sorted(ran) == [0, 0, 0, 1, 1, 1]  # a warm-up and two timed runs
    finally:
        llm.engine.close()
