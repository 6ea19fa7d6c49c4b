"""A tiny random Llama for tests and benchmarks that exercise the engine, not the weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def build_tiny_llama(out: Path, **overrides) -> str:
    """A 2-layer random Llama (hidden 64, 4 heads, 2 KV heads, tied embeddings, seed 0) with
    SmolLM2's tokenizer and vocabulary, written as safetensors into `out`; returns its path.
    `overrides`: LlamaConfig fields to change."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from medha.engine.checkpoint import resolve_model

    src = resolve_model("smollm2")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, out / f.name)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=json.loads((src / "config.json").read_text())["vocab_size"],
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    for name, value in overrides.items():
        setattr(cfg, name, value)
    LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    return str(out)
