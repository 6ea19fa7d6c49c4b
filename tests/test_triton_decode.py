"""CUDA's decode path where no GPU is: the Triton decode and RoPE kernels
(layers/triton_decode.py, layers/triton_rope.py) run in Triton's interpreter on CPU, and the
engine's CUDA path (those kernels, the spare block, the CUDA graphs' padded steps, run eagerly
here, async scheduling) against the torch path in float32.

Triton's interpreter is chosen when triton is imported (TRITON_INTERPRET=1), so each check
runs in a process of its own."""

import json
import os
import subprocess
import sys
from pathlib import Path

from medha.engine.cuda_graphs import capture_sizes

ROOT = Path(__file__).resolve().parents[1]


def run_interpreted(script: str, tmp_path: Path, **env) -> dict:
    out = tmp_path / "out.json"
    proc = subprocess.run(
        [sys.executable, "-c", script, str(out)],
        cwd=ROOT,
        env={
            **os.environ,
            "TRITON_INTERPRET": "1",
            "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            **env,
        },
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


KERNEL = r"""
import json, random, sys
import torch
from medha.engine.layers.triton_decode import paged_decode

torch.manual_seed(0)
errors = {}
for kvh, heads, d, bs in ((3, 9, 64, 16), (2, 8, 32, 32)):
    lens = [1, 15, 16, 17, 63, 64, 65, 200]
    nblocks = sum(-(-n // bs) for n in lens) + 3
    k, v = torch.randn(kvh, nblocks * bs, d), torch.randn(kvh, nblocks * bs, d)
    order = list(range(nblocks))
    random.Random(1).shuffle(order)
    tables, i = [], 0
    for n in lens:
        tables.append(order[i : i + -(-n // bs)])
        i += len(tables[-1])
    width = max(map(len, tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    # q as the engine hands it, a view of the fused q/k/v output; the output a strided view too
    q = torch.randn(len(lens), heads + 2 * kvh, d)[:, :heads]
    for splits in (1, 3, 40):  # 40: more shares than a context has tiles
        n_t = torch.tensor(lens, dtype=torch.int32)
        out = torch.full((len(lens), heads + 2, d), float("nan"))[:, 1 : 1 + heads]
        assert paged_decode(q, k, v, table, n_t, bs, d**-0.5, splits, out=out) is out
        worst = 0.0
        for r, n in enumerate(lens):
            pos = torch.arange(n)
            slots = torch.tensor(tables[r])[pos // bs] * bs + pos % bs
            qg = q[r].view(kvh, heads // kvh, d)
            ref = torch.softmax(qg @ k[:, slots].transpose(-1, -2) * d**-0.5, -1) @ v[:, slots]
            worst = max(worst, (ref.reshape(heads, d) - out[r]).abs().max().item())
        errors[f"{kvh}x{heads // kvh} d{d} page{bs} splits{splits}"] = worst
json.dump(errors, open(sys.argv[1], "w"))
"""


def test_the_decode_kernel_attends_each_context_through_its_block_table(tmp_path):
    """Every decode's output is exact softmax attention over its own blocks, wherever they lie,
    for GQA groups of 3 and 4, contexts of 1 token to past several pages and tiles, one share
    or many (an empty share weighs nothing in the merge)."""
    errors = run_interpreted(KERNEL, tmp_path)
    assert len(errors) == 6
    assert max(errors.values()) < 1e-5, errors


ROPE = r"""
import json, sys
import torch
from medha.engine.layers.rotary import RotaryEmbedding, TorchRope, TritonRope

torch.manual_seed(0)
equal = {}
for heads, kvh, d, tokens in ((9, 3, 64, 1), (32, 8, 128, 37), (4, 4, 32, 5), (40, 2, 16, 3)):
    rotary = RotaryEmbedding(d, 500000.0, None)
    cos, sin = rotary.cos_sin(torch.randint(0, 131072, (tokens,)), torch.float32)
    rows = torch.randn(tokens + 2, (heads + 2 * kvh) * d)  # padding rows past the tokens
    qkv, padding = rows[:tokens], rows[tokens:].clone()
    want = TorchRope.of(cos, sin, heads + kvh, kvh)(qkv, heads, kvh, d)
    got = TritonRope.of(cos, sin)(qkv, heads, kvh, d)
    equal[f"{heads}/{kvh} d{d} x{tokens}"] = (
        torch.equal(got, want) and got.data_ptr() == rows.data_ptr()
        and torch.equal(rows[tokens:], padding)
    )
json.dump(equal, open(sys.argv[1], "w"))
"""


def test_the_rope_kernel_rotates_in_place_as_the_torch_path_does(tmp_path):
    """CUDA's RoPE, one kernel a layer in place on the fused q/k/v output, gives the torch
    path's rotation bit for bit in float32 (the same products and sums, no fused
    multiply-add), v heads untouched, for head sizes of 16 to 128 and GQA groups of 1 to 20."""
    equal = run_interpreted(ROPE, tmp_path)
    assert len(equal) == 4 and all(equal.values()), equal


ENGINE = r"""
import json, os, random, sys
from medha.benchmark.tiny_llama import build_tiny_llama
from medha.engine.llm import LLM
from medha.engine.sampling_params import SamplingParams
from medha.scheduler.config import SchedulerConfig

# weights wide enough that greedy tokens vary (the default tiny model repeats one token)
path = build_tiny_llama(sys.argv[1] + ".model", initializer_range=0.3)
rng = random.Random(0)
prompts = [[rng.randrange(3, 40000) for _ in range(n)] for n in (5, 17, 40, 90, 150)]
params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=0)
greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)  # sampled on the device
out = {}
for policy, chunking in (("fcfs", "static:16"), ("lars", "adaptive")):
    for kernel, graphs, ahead in (
        ("torch", True, False), ("triton", True, False), ("triton", False, False),
        ("triton", True, True),
    ):
        os.environ["MEDHA_DECODE_KERNEL"] = kernel
        llm = LLM(path, SchedulerConfig(policy=policy, chunking=chunking, prefix_cache="off"),
                  device="cpu", dtype="float32", kernels="torch", kv_memory_gb=0.01,
                  cuda_graphs=graphs, async_scheduling=ahead)
        runner = llm.engine.runner
        done = llm.generate(prompts, greedy if ahead else params)
        out[f"{policy}/{kernel}/{graphs}" + ("/async" if ahead else "")] = {
            "tokens": [o.token_ids for o in done],
            "logprobs": [[s.logprob for s in o.logprobs or []] for o in done],
            "overlapped": llm.engine.metrics.overlapped,
            "triton": runner.triton_decode,
            "spare": runner.spare_block,
            "slots": runner.kv_caches[0].shape[1],
            "blocks": llm.engine.scheduler.blocks.num_blocks,
            "replays": None if runner.graphs is None else runner.graphs.replays,
        }
json.dump(out, open(sys.argv[1], "w"))
"""


def test_cuda_decode_path_gives_the_torch_paths_tokens(tmp_path):
    """The Triton kernel, eagerly and in the CUDA graphs' padded steps (five decodes padded to
    a captured size of 8, their padding writing into the spare block), gives the torch path's
    greedy tokens, and its logprobs to float32 rounding, under fixed and adaptive chunks; and
    so does CUDA's default, async scheduling, with each decode's input token fed into the
    graphs' buffers from the batch before on the device."""
    out = run_interpreted(ENGINE, tmp_path)
    for policy in ("fcfs", "lars"):
        base = out[f"{policy}/torch/True"]
        assert not base["triton"] and base["replays"] is None and base["spare"] is None
        assert len({t for toks in base["tokens"] for t in toks}) > 10  # not one token repeated
        for graphs in (True, False):
            got = out[f"{policy}/triton/{graphs}"]
            assert got["triton"]
            assert got["spare"] == got["blocks"]  # one block past the scheduler's
            assert got["slots"] == (got["blocks"] + 1) * (got["slots"] // (got["blocks"] + 1))
            assert (got["replays"] or 0) > 0 if graphs else got["replays"] is None
            assert got["tokens"] == base["tokens"]
            assert got["overlapped"] == 0
            worst = max(
                abs(a - b) for x, y in zip(got["logprobs"], base["logprobs"]) for a, b in zip(x, y)
            )
            assert worst < 1e-4
        ahead = out[f"{policy}/triton/True/async"]
        assert ahead["tokens"] == base["tokens"] and ahead["overlapped"] > 0
        assert ahead["replays"] > 0


def test_graph_sizes_cover_every_batch_up_to_the_limit():
    assert capture_sizes(256) == [1, 2, 4, 8, *range(16, 257, 16)]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(1) == [1]
    assert capture_sizes(1000)[-1] == 256  # the largest graph; bigger batches run eagerly
    for limit in (1, 3, 17, 100, 256):
        sizes = capture_sizes(limit)
        assert sizes[-1] == limit and sizes == sorted(set(sizes))
