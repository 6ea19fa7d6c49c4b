"""medha's engine against the device's limits and against transformers on the same machine: the
rows of issue 49, on whatever device this finds (docs/engine.md "The engine against its device").

    python bench/gpu/engine_device.py --out DIR                      # every row, this device
    python bench/gpu/engine_device.py --out DIR --rows aten,decode1  # some of them
    python bench/gpu/engine_device.py --out DIR --against ../base --rounds 2   # A/B, alternated

Rows (each engine with medha's defaults unless a flag says otherwise):
  decode1    one request decoding over a 1,024-token context: time per output token, against
             the weights' read time at the device's memory bandwidth
  decode64   64 requests decoding (512-token prompts): output tokens/s, and the step's bound
             (weights and KV read once a step)
  prefill    one prompt whole (8,192 tokens on CUDA): TTFT and TFLOP/s
  chunking   a long prompt alone (32K and 120K tokens on CUDA), whole (fcfs/none) against the
             default chunks (lars/adaptive)
  convoy     8 short requests (256 tokens, 32 out) arriving in the first 0.8 s of each long
             prompt, under lars/adaptive: their TTFT against their time alone, and the long
             prompt's TTFT against its whole-prompt TTFT alone
  aten       top-level aten calls per layer of a lone decode step on torch's kernels (fp32 on
             a CPU), with the profiler: every call, and the calls that do work (no views)
  hf         transformers on the same weights and device: its forward over the prefill row's
             prompt, and a greedy generate after a 1,024-token prompt (time per token)

On CUDA the model is a random checkpoint with Llama-3-8B's shapes in bf16 (7.4 B parameters,
SmolLM2's vocabulary and tokenizer, from --tok: a GPU machine may have no network), built into
--ckpt unless it is there. On a CPU it is SmolLM2-135M (the embedded default) and the sizes
shrink to its 8,192-token context and two cores: decode1 over 1,024 tokens, decode64 over
128-token prompts, a 2,048-token prefill, long prompts of 4,096 and 8,000 tokens. --quick:
every row at toy sizes (a dry run of the script, nothing timed that matters).

--engine-arg KEY=VALUE sets any other EngineConfig field of every engine (the A/B of one
setting: async_scheduling=false, cuda_graphs=false; MEDHA_PREFIX_KERNEL=cudnn in the
environment takes cuDNN's kernel for a chunk's prefix).
--against CHECKOUT runs the same rows with that checkout's medha imported instead (a clean
`git worktree` of the base commit), one process per contender and round, alternating, and
prints each figure's ratio (this / that) round by round. Writes DIR/results.json.
"""

# ruff: noqa: E501  (a measuring script: its tables are wide)
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

# the checkout this script is in (the folder holding medha/benchmark/)
ROOT = next(p for p in Path(__file__).resolve().parents if (p / "medha" / "benchmark").is_dir())


def this_checkout(name: str):
    """medha/benchmark/<name>.py of this script's checkout, loaded by its path: the worker of an
    A/B run (--against) imports the other checkout's medha, which may have no such module or
    another one, and the rows it runs are this checkout's."""
    spec = importlib.util.spec_from_file_location(
        f"_engine_device_{name}", ROOT / "medha" / "benchmark" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # where dataclasses look their module up
    spec.loader.exec_module(module)
    return module


harness = this_checkout("harness")
engine_rows = this_checkout("engine_rows")
ROWS = engine_rows.ROWS
LLAMA3_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
)


# ---- the GPU's model ------------------------------------------------------------------------
def make_checkpoint(path: Path, tok: Path) -> None:
    """A random bf16 checkpoint with Llama-3-8B's shapes and SmolLM2's vocabulary, made here
    (std 0.02, norms 1), with the tokenizer files of `tok` beside it."""
    import torch
    from safetensors.torch import save_file

    from medha.engine.models.llama_args import LlamaArgs

    if (path / "model.safetensors").exists():
        return
    path.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((tok / "config.json").read_text())
    cfg.pop("_model_name_or_path", None)
    cfg.update(**LLAMA3_8B, max_position_embeddings=131072, tie_word_embeddings=False,
               dtype="bfloat16", torch_dtype="bfloat16",
               rope_parameters={"rope_theta": 500000.0, "rope_type": "default"})  # fmt: skip
    for f in tok.iterdir():
        if f.name != "config.json" and f.is_file():
            (path / f.name).write_bytes(f.read_bytes())
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    args = LlamaArgs.from_config(cfg, "config.json")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(0)
    tensors = {}
    for name, dims, _ in args.weight_shapes():
        shape = tuple(size for _, size in dims)
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = (torch.randn(shape, generator=g, device=dev) * 0.02).to(torch.bfloat16).cpu()
        tensors[name if name.startswith("lm_head") else "model." + name] = t
    save_file(tensors, str(path / "model.safetensors"))


# ---- the driver -----------------------------------------------------------------------------
def engine_arg(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep:
        raise SystemExit(f"--engine-arg {text!r}: expected KEY=VALUE")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def run_contender(a, checkout: Path | None, out: Path) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--json", str(out), "--rows", a.rows, "--device", a.device,
           "--model", a.model, "--dtype", a.dtype, "--kernels", a.kernels]  # fmt: skip
    for flag in ("kv_memory_gb", "self_profile_s"):
        if getattr(a, flag) is not None:
            cmd += ["--" + flag.replace("_", "-"), str(getattr(a, flag))]
    for arg in a.engine_arg:
        cmd += ["--engine-arg", arg]
    if a.quick:
        cmd.append("--quick")
    env = dict(os.environ)
    if checkout is not None:
        env["PYTHONPATH"] = str(checkout.resolve()) + os.pathsep + env.get("PYTHONPATH", "")
    subprocess.run(cmd, env=env, check=True, cwd=checkout or ROOT)
    return json.loads(out.read_text())


FIGURES = (
    ("aten", "per_layer"), ("aten", "work_per_layer"), ("decode1", "tpot_s"),
    ("decode64", "tpot_p50_s"), ("decode64", "decode_tok_per_s"), ("decode64", "out_tok_per_s"),
    ("prefill", "ttft_s"),
    ("hf", "prefill_s"), ("hf", "tpot_s"),
)  # fmt: skip


def figures(r: dict) -> dict[str, float]:
    out = {f"{row}.{key}": r[row][key] for row, key in FIGURES if row in r and key in r[row]}
    for L, c in r.get("chunking", {}).items():
        out[f"chunking.{L}.ratio"] = c["ratio"]
    for L, c in r.get("convoy", {}).items():
        out[f"convoy.{L}.shorts_over_alone"] = c["shorts_over_alone"]
        out[f"convoy.{L}.long_over_whole"] = c["long_over_whole"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])  # fmt: skip
    harness.add_common_args(ap, out=None, out_help="where results.json goes")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    ap.add_argument("--device", default="auto", help="auto (CUDA if there is one), cuda or cpu")
    ap.add_argument("--model", default=None, help="default: --ckpt on CUDA, smollm2 on a CPU")
    ap.add_argument("--ckpt", default="/tmp/llama8b-shape", help="where the CUDA model is built")
    ap.add_argument(
        "--tok", default=".gpu/tok", help="SmolLM2's tokenizer files and config.json (CUDA)"
    )
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--kernels", default="auto")
    ap.add_argument(
        "--kv-memory-gb",
        type=float,
        default=None,
        help="default: 24 on CUDA, the engine's elsewhere",
    )
    ap.add_argument(
        "--self-profile-s",
        type=float,
        default=None,
        help="the engine's --self-profile-s (default: its own)",
    )
    ap.add_argument(
        "--engine-arg", action="append", default=[], metavar="KEY=VALUE",
        help="any other EngineConfig field for every engine, VALUE in JSON where it parses "
        "(e.g. async_scheduling=false, cuda_graphs=false); repeatable",
    )  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="toy sizes: a dry run")
    ap.add_argument(
        "--against", type=Path, default=None, help="another checkout to run side by side"
    )
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.engine_args = dict(engine_arg(x) for x in a.engine_arg)
    if a.worker:
        a.json.write_text(json.dumps(engine_rows.worker(a), indent=1))
        return
    if not a.out:
        ap.error("--out is required")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    import torch

    if a.device == "auto":
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.model is None:
        if a.device == "cuda":
            make_checkpoint(Path(a.ckpt), Path(a.tok))
            a.model = a.ckpt
        else:
            a.model = "smollm2"
    if a.device == "cuda" and a.kv_memory_gb is None:
        a.kv_memory_gb = 24.0
    contenders = [("this", None)] + ([("against", a.against)] if a.against else [])
    results: dict = {"args": {k: str(v) for k, v in vars(a).items()}, "rounds": []}
    for i in range(a.rounds):
        order = contenders if i % 2 == 0 else contenders[::-1]
        got = {}
        for name, checkout in order:
            print(f"== round {i}: {name} ({checkout or 'this checkout'})", flush=True)
            got[name] = run_contender(a, checkout, out / f"{name}-{i}.json")
        results["rounds"].append(got)
        (out / "results.json").write_text(json.dumps(results, indent=1))
    if a.against:
        print("\nthis / against, round by round:")
        for key in figures(results["rounds"][0]["this"]):
            pairs = [(r["this"], r["against"]) for r in results["rounds"]]
            vals = [figures(x).get(key) for x, _ in pairs], [figures(y).get(key) for _, y in pairs]
            cells = [f"{x:.4g} / {y:.4g} = {x / y:.3f}" for x, y in zip(*vals) if x and y]
            print(f"  {key:32s} " + "; ".join(cells))


if __name__ == "__main__":
    main()
