"""Tensor-parallel worker processes (torch.distributed, gloo): the same tokens and logits as one
process, on SmolLM2 (3 KV heads, split 2 + 1 at tp 2) and on a tiny random Llama."""

import json
import shutil
import time

import pytest
import torch

from medha.core.batch import BatchResult
from medha.core.config import SchedulerConfig
from medha.engine.checkpoint import resolve_model
from medha.engine.errors import EngineError
from medha.engine.llm import LLM
from medha.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0)
# static chunks: the schedule, hence each GEMM's shape, does not depend on timing
SCHED = SchedulerConfig(policy="fcfs", chunking="static:64")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A 2-layer random Llama with SmolLM2's tokenizer, saved as safetensors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    src = resolve_model("smollm2")
    out = tmp_path_factory.mktemp("tiny-llama")
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, out / f.name)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=json.loads((src / "config.json").read_text())["vocab_size"],
                      hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    return str(out)


def _prompts(llm):
    ids = llm.tokenizer.encode(open(__file__).read())
    return [ids[i * 41: i * 41 + n] for i, n in enumerate((3, 17, 90, 230))]


def _prefill_logits(llm, ids):
    engine = llm.engine
    engine.add_request("x", None, SamplingParams(max_tokens=1, temperature=0),
                       prompt_token_ids=ids)
    rows = []
    while engine.has_unfinished():
        batch = engine.scheduler.schedule(time.monotonic())
        logits, _ = engine.runner.execute(batch, {"x": engine._states["x"].context},
                                          engine.scheduler.blocks, all_logits=True)
        rows.append(logits)
        tokens = {"x": 0} if batch.prefills[-1].samples else None
        engine.scheduler.update(batch, BatchResult(0.01, tokens), time.monotonic())
    return torch.cat(rows)


def _run(model, tp):
    llm = LLM(model, kv_memory_gb=0.05, tp=tp, scheduler=SCHED)
    try:
        prompts = _prompts(llm)
        tokens = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        logits = _prefill_logits(llm, prompts[-1])
        assert llm.engine.scheduler.blocks.num_used == 0
        return tokens, logits
    finally:
        llm.engine.close()


@pytest.mark.parametrize("model", ["smollm2", "tiny"])
def test_tp2_matches_one_process(model, tiny_model):
    path = tiny_model if model == "tiny" else model
    tokens1, logits1 = _run(path, 1)
    tokens2, logits2 = _run(path, 2)
    assert tokens2 == tokens1
    assert logits2.shape == logits1.shape
    assert (logits2 - logits1).abs().max().item() <= 1e-4


def test_tp_beyond_the_kv_heads_is_refused(tiny_model):
    with pytest.raises(EngineError, match="KV heads"):
        LLM(tiny_model, kv_memory_gb=0.01, tp=3)
    with pytest.raises(EngineError, match="tp must be a positive integer"):
        LLM(tiny_model, kv_memory_gb=0.01, tp=0)
