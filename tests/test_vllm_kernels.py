"""medha's engine on vLLM's CPU kernels (`--kernels vllm`): the same model as on torch's ops,
against transformers on the same weights, through chunking, swapping and pipeline stages."""

import json

import pytest
import torch

from medha.benchmark.logits import prefill_logits
from medha.engine.checkpoint import resolve_model
from medha.engine.errors import EngineError
from medha.engine.layers.vllm_kernels import gemm_runs, loadable, resolve_kernels
from medha.engine.llm import LLM
from medha.engine.model_runner import ModelRunner
from medha.engine.sampling_params import SamplingParams
from medha.scheduler.config import SchedulerConfig
from medha.testing.numerics import (
    assert_greedy_agrees,
    assert_logits_within,
    chunked_logits,
    greedy_reference,
    logit_bound,
)

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def kernel_dtype():
    """bf16, the kernels' usual dtype, where this CPU's oneDNN has it (AVX-512); fp32 on an
    AVX2 CPU, where the engine refuses bf16 on these kernels (test_auto_...)."""
    return "bfloat16" if gemm_runs(torch.bfloat16) else "float32"


@pytest.fixture(scope="module")
def prompts():
    llm = LLM("smollm2", kv_memory_gb=0.01)
    ids = llm.tokenizer.encode(open(__file__).read() * 4)
    return [ids[i * 61 : i * 61 + n] for i, n in enumerate((5, 40, 170, 600))]


@pytest.fixture(scope="module")
def hf():
    """transformers on the same weights: (fp32, bf16)."""
    from transformers import AutoModelForCausalLM

    path = resolve_model("smollm2")
    return tuple(
        AutoModelForCausalLM.from_pretrained(path, dtype=dt).eval()
        for dt in (torch.float32, torch.bfloat16)
    )


def test_auto_takes_vllm_kernels_for_float32_where_the_cpu_serves_it(monkeypatch):
    """A CPU with AVX-512 and no bf16 instructions serves float32 (`--dtype auto`), and there
    vLLM's prepacked GEMMs run it much faster than torch's ops (docs/vllm.md, "Another machine
    kind"): auto takes them where they can run. A CPU with bf16 serves bf16, and float32, asked
    for, stays the exact reference; an AVX2 CPU keeps torch's ops (vLLM's float32 not
    measured there)."""
    from medha.perf import hardware_specs

    # the rule reads the CPU's flags
    ice_lake = "flags\t\t: fpu avx2 avx512f avx512bw avx512_vnni\n"
    assert hardware_specs.cpu_has_avx512(ice_lake) and not hardware_specs.cpu_has_bf16(ice_lake)
    assert not hardware_specs.cpu_has_avx512("flags\t\t: fpu avx2 fma\n")
    monkeypatch.delenv("MEDHA_AUTO_KERNELS", raising=False)
    cpu = torch.device("cpu")
    for avx512, bf16, served in ((True, False, True), (True, True, False), (False, False, False)):
        monkeypatch.setattr(hardware_specs, "cpu_has_avx512", lambda a=avx512: a)
        monkeypatch.setattr(hardware_specs, "cpu_has_bf16", lambda b=bf16: b)
        on_vllm = served and loadable()
        assert resolve_kernels("auto", cpu, torch.float32, 1) == ("vllm" if on_vllm else "torch")
        assert resolve_kernels("auto", cpu, torch.float32, 2) == "torch"  # kvp reads K slots
        assert resolve_kernels("auto", cpu, torch.float32, 1, head_dim=16) == "torch"
        assert resolve_kernels("torch", cpu, torch.float32, 1) == "torch"  # asked for: kept


def test_auto_takes_vllm_kernels_for_bf16_on_a_cpu(monkeypatch):
    monkeypatch.delenv("MEDHA_AUTO_KERNELS", raising=False)  # auto's own rule (.ci/cpu-kinds)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    # decided before the CPU's GEMMs are asked: the same answers on every ISA
    assert resolve_kernels("auto", cpu, torch.float32, 1) == "torch"  # the exact reference
    assert resolve_kernels("auto", cpu, torch.bfloat16, 2) == "torch"  # kvp reads K slots
    assert resolve_kernels("auto", cuda, torch.bfloat16, 1) == "torch"
    assert resolve_kernels("vllm", cpu, torch.float32, 1) == "vllm"  # asked for: kept
    with pytest.raises(EngineError, match="kvp"):
        resolve_kernels("vllm", cpu, torch.bfloat16, 2)
    with pytest.raises(EngineError, match="kernels must be one of"):
        resolve_kernels("onednn", cpu, torch.bfloat16, 1)
    with pytest.raises(EngineError, match="kvp"):
        LLM("smollm2", kernels="vllm", kvp=2, kv_memory_gb=0.01)
    # fp16 by its own kernel: a CPU with AVX512-BF16 and no AVX512-FP16 builds no fp16 GEMM
    fp16 = "vllm" if gemm_runs(torch.float16) else "torch"
    assert resolve_kernels("auto", cpu, torch.float16, 1) == fp16
    if not gemm_runs(torch.bfloat16):  # an AVX2 CPU: torch's ops, and a clear refusal
        assert resolve_kernels("auto", cpu, torch.bfloat16, 1) == "torch"
        with pytest.raises(EngineError, match="no bfloat16 kernel on this CPU"):
            LLM("smollm2", dtype="bfloat16", kernels="vllm", kv_memory_gb=0.01)
        assert LLM("smollm2", dtype="bfloat16", kv_memory_gb=0.01).engine.kernels == "torch"
        return
    assert resolve_kernels("auto", cpu, torch.bfloat16, 1) == "vllm"
    assert LLM("smollm2", dtype="bfloat16", kv_memory_gb=0.01).engine.kernels == "vllm"


def test_medha_auto_kernels_is_what_auto_prefers(monkeypatch, tiny_model):
    """How .ci/cpu-kinds runs every engine it can on vLLM's kernels, float32 included."""
    cpu = torch.device("cpu")
    monkeypatch.setenv("MEDHA_AUTO_KERNELS", "vllm")
    assert resolve_kernels("auto", cpu, torch.float32, 1) == "vllm"  # fp32's GEMM runs anywhere
    assert resolve_kernels("auto", cpu, torch.float32, 2) == "torch"  # not where they cannot run
    assert resolve_kernels("auto", cpu, torch.float32, 1, head_dim=16) == "torch"
    assert LLM("smollm2", dtype="float32", kv_memory_gb=0.01).engine.kernels == "vllm"
    assert LLM(tiny_model, dtype="float32", kv_memory_gb=0.01).engine.kernels == "torch"
    monkeypatch.setenv("MEDHA_AUTO_KERNELS", "torch")
    assert resolve_kernels("auto", cpu, torch.bfloat16, 1) == "torch"
    assert resolve_kernels("vllm", cpu, torch.float32, 1) == "vllm"  # asked for: kept
    monkeypatch.setenv("MEDHA_AUTO_KERNELS", "onednn")
    with pytest.raises(EngineError, match="MEDHA_AUTO_KERNELS must be torch or vllm"):
        resolve_kernels("auto", cpu, torch.bfloat16, 1)


def test_bf16_is_as_close_to_fp32_as_transformers_in_bf16(prompts, hf):
    """bf16 rounds differently in every kernel, so no bf16 engine matches another bit for bit
    (transformers' bf16 and vLLM's kernels differ by up to ~1 logit on 600 tokens), and no bound
    derived beforehand says how far a bf16 model is from the fp32 one. The yardstick is measured
    here, on this CPU: transformers in bf16, whole and in 64-token chunks (two summation orders,
    the larger error of the two), against the fp32 model. vLLM's kernels, whole and chunked,
    must be no further from the fp32 model on average over the logits (within 10%) and over
    each position's worst logit (within 25%: the tail swings more between kernels). Measured,
    mean / mean of the rows' maxima: AVX-512 BF16 EPYC 0.094 / 0.350 (whole and chunked)
    against transformers' 0.108 / 0.388; Sapphire Rapids with AMX, whole, 0.094 / 0.362 against
    0.103 / 0.376. (bench/engine/engine_correctness.py prints the largest differences.)"""
    if not gemm_runs(torch.bfloat16):
        pytest.skip(
            "this CPU's oneDNN has no bf16 GEMM (AVX2 only): the engine refuses bf16 on vLLM's "
            "kernels here, as test_auto_takes_vllm_kernels_for_bf16_on_a_cpu checks"
        )
    f32, bf16 = hf
    ids = prompts[3]
    with torch.inference_mode():
        truth = f32(torch.tensor([ids])).logits[0]
        theirs = [
            (bf16(torch.tensor([ids])).logits[0].float() - truth).abs(),
            (chunked_logits(bf16, ids, 64) - truth).abs(),
        ]
        firsts = [f32(torch.tensor([p])).logits[0, -1].topk(2) for p in prompts]
    mean = max(float(t.mean()) for t in theirs)
    tail = max(float(t.max(1).values.mean()) for t in theirs)
    for chunking in ("none", "static:64"):  # chunks round differently from a whole prefill
        ours = (prefill_logits(chunking, ids, "bfloat16", kernels="vllm") - truth).abs()
        assert float(ours.mean()) <= 1.1 * mean, (chunking, float(ours.mean()), mean)
        assert float(ours.max(1).values.mean()) <= 1.25 * tail, (chunking, tail)
    llm = LLM("smollm2", kv_memory_gb=0.5, dtype="bfloat16", kernels="vllm")
    outs = llm.generate(prompts, GREEDY)  # decodes and prefills in one batch
    clear = [(out, token) for out, (top, token) in zip(outs, firsts) if top[0] - top[1] > 1.0]
    assert clear  # a first token that is no near-tie, which bf16 may break either way
    assert all(out.token_ids[0] == int(token[0]) for out, token in clear)
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outs)
    assert llm.engine.scheduler.blocks.num_used == 0


def test_fp32_on_vllm_kernels_is_close_to_the_reference(prompts):
    """Chunked, on oneDNN's GEMMs and vLLM's attention, every logit within float32 rounding of
    transformers' whole prefill (the bound derived from the computation: numerics.py), and so
    is medha's own engine on torch's ops."""
    ids = prompts[3]
    bound = logit_bound(resolve_model("smollm2"), ids)
    ours = prefill_logits("static:64", ids, "float32", kernels="vllm")
    assert_logits_within(ours, bound.logits, bound.between_two())
    torch_ops = prefill_logits("none", ids, "float32", kernels="torch")
    assert_logits_within(torch_ops, bound.logits, bound.between_two())


def _kernel_prompts(model) -> list[list[int]]:
    from medha.engine.tokenizer import Tokenizer

    ids = Tokenizer(model).encode(open(__file__).read())
    return [ids[i * 37 : i * 37 + n] for i, n in enumerate((5, 11, 40, 96, 170, 260, 400))]


class SwapWatch:
    """Wraps an engine's swap pool: the KV bytes of every block a swap-out takes to the host
    (read from the device before the copy), and, when a swap-in brings that host block back,
    whether the device block it lands in holds the same bytes, in every layer's K and V (the
    kernels' packing included: a block is its slots, whatever their layout inside)."""

    def __init__(self, engine) -> None:
        self.runner, self.pool = engine.runner, engine.swap_blocks
        self.away: dict[int, list[torch.Tensor]] = {}  # host block -> its bytes
        self.returned = 0
        apply = self.pool.apply

        def watched(batch):
            ins = [(h, d) for s in batch.swap_in for h, d in zip(s.host_blocks, s.device_blocks)]
            outs = {
                h: self.block(d)
                for s in batch.swap_out
                for d, h in zip(s.device_blocks, s.host_blocks)
            }
            apply(batch)
            for h, d in ins:
                back = self.block(d)
                for before, after in zip(self.away.pop(h), back, strict=True):
                    same = torch.equal(before.view(torch.uint8), after.view(torch.uint8))
                    assert same, f"host block {h} came back to device block {d} changed"
                self.returned += 1
            self.away.update(outs)

        self.pool.apply = watched

    def block(self, b: int) -> list[torch.Tensor]:
        n = self.runner.block_size
        return [kv[:, b * n : (b + 1) * n].clone() for kv in self.runner.kv_caches]


def _tokens(model, kv_tokens, dtype, new_tokens=GREEDY.max_tokens, watch=False, **engine):
    sched = SchedulerConfig(policy="fcfs", chunking="static:64", **engine.pop("sched", {}))
    greedy = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    cfg = json.load(open(f"{model}/config.json"))
    kv_gb = kv_tokens * ModelRunner.kv_bytes_per_token(cfg, getattr(torch, dtype)) / 2**30
    llm = LLM(model, scheduler=sched, kv_memory_gb=kv_gb, dtype=dtype, **engine)
    assert llm.engine.kernels == engine.get("kernels", llm.engine.kernels)
    swaps = SwapWatch(llm.engine) if watch else None
    outs = [o.token_ids for o in llm.generate(_kernel_prompts(model), greedy)]
    s = llm.engine.scheduler
    assert s.blocks.num_used == 0 and not s.has_unfinished()
    s.check_invariants()
    llm.engine.close()
    return outs, s, swaps


@pytest.mark.parametrize(
    "block_size, kv_tokens, new_tokens",
    [(16, 43 * 16, 16), (32, 22 * 32, 48)],  # the vec16 kernel; the AMX or vec one (the default)
)
def test_swapped_blocks_keep_the_kernels_packing(
    tiny_vllm_model, kernel_dtype, block_size, kv_tokens, new_tokens
):
    """The kernels pack K inside each block: swap moves whole blocks, so KV that went to the
    host and came back holds the same bytes (in the kernels' usual dtype, bf16 where this CPU
    has it), and the tokens are the model's (in float32, where they are decisions that rounding
    cannot change: transformers' greedy continuation, up to a near-tie)."""
    engine = {"kernels": "vllm", "block_size": block_size, "sched": {"preemption_mode": "swap"}}
    _, s, swaps = _tokens(tiny_vllm_model, kv_tokens, kernel_dtype, new_tokens, True, **engine)
    assert s.stats.swap_outs > 0 and s.stats.recomputes == 0 and swaps.returned > 0
    reference = greedy_reference(tiny_vllm_model, _kernel_prompts(tiny_vllm_model), new_tokens)
    outs, s, swaps = _tokens(tiny_vllm_model, kv_tokens, "float32", new_tokens, True, **engine)
    assert s.stats.swap_outs > 0 and s.stats.recomputes == 0 and swaps.returned > 0
    assert_greedy_agrees(outs, reference)


def test_pipeline_stages_run_the_same_kernels(tiny_vllm_model):
    """Two stream-pipeline stages on vLLM's kernels, two batches in flight: the tokens are the
    model's, as one stage's are (float32 decisions against transformers, up to a near-tie)."""
    reference = greedy_reference(tiny_vllm_model, _kernel_prompts(tiny_vllm_model), 16)
    one, _, _ = _tokens(tiny_vllm_model, 1 << 15, "float32", kernels="vllm")
    staged, _, _ = _tokens(tiny_vllm_model, 1 << 15, "float32", kernels="vllm", spp=2)
    assert_greedy_agrees(one, reference)
    assert_greedy_agrees(staged, reference)


def test_auto_keeps_torch_for_head_sizes_the_kernels_lack(tiny_model):
    # the tiny engine model's heads are 16 wide; vLLM's CPU attention has no kernel for that
    assert LLM(tiny_model, dtype="bfloat16", kv_memory_gb=0.01).engine.kernels == "torch"
    with pytest.raises(EngineError, match="head sizes"):
        LLM(tiny_model, dtype="bfloat16", kernels="vllm", kv_memory_gb=0.01)


def test_rope_kernel_rotates_as_torch_does_past_the_first_table():
    """vLLM's rotary kernel, from the model's table (grown on demand past its first 8,192
    positions), rotates q and k as torch's path does, on the 2-D views of the fused q/k/v
    output the model hands it."""
    from medha.engine.layers.rotary import PackedRope, TorchRope

    model = LLM("smollm2", dtype="float32", kernels="vllm", kv_memory_gb=0.01).engine.runner.model
    heads, kv_heads, d = 9, 3, 64
    positions = torch.tensor([0, 5, 4095, 8191, 9000])
    model._grow_rope_table(int(positions.max()) + 1)
    qkv = torch.randn(5, (heads + 2 * kv_heads) * d)
    cos, sin = model.rotary.cos_sin(positions, torch.float32)
    want = TorchRope.of(cos, sin, heads + kv_heads, kv_heads)(qkv, heads, kv_heads, d)
    got = PackedRope(5, positions, model.cos_sin_cache)(qkv, heads, kv_heads, d)
    assert got.data_ptr() == qkv.data_ptr()  # in place, on the fused output
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
