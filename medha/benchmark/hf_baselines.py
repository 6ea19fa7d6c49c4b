"""Hugging Face transformers baselines for medha's engine, on CPU: static batching with
`generate`, transformers' own continuous batching, and the prefill GFLOP/s of one forward pass,
over one synthetic offline workload. bench/engine/hf_baselines.py runs them alone;
bench/engine/engine_throughput.py runs them beside medha's engine, and
bench/engine/engine_vs_peers.py sends the same workload to servers."""

from __future__ import annotations

import math
import random
import time

import torch
from torch import nn
from transformers import ContinuousBatchingConfig, GenerationConfig


def make_workload(
    n: int = 64,
    seed: int = 0,
    vocab_size: int = 49152,
    prompt_range: tuple[int, int] = (64, 512),
    output_range: tuple[int, int] = (64, 256),
) -> list[tuple[list[int], int]]:
    """n requests (prompt ids, output length). Per request, from one `random.Random(seed)`: prompt
    length, output length (both uniform, inclusive), then the prompt ids, uniform in [3, vocab_size)
    so that the special ids 0-2 (unk, bos, eos/pad for SmolLM2) never appear."""
    rng = random.Random(seed)
    requests = []
    for _ in range(n):
        prompt_len = rng.randint(*prompt_range)
        output_len = rng.randint(*output_range)
        requests.append(([rng.randrange(3, vocab_size) for _ in range(prompt_len)], output_len))
    return requests


def _result(useful: int, generated: int, wall_s: float, **extra) -> dict:
    return {
        "useful_tokens": useful,
        "wall_s": wall_s,
        "tokens_per_s": useful / wall_s,
        "generated_tokens": generated,
        **extra,
    }


@torch.inference_mode()
def hf_static_generate(model, requests: list[tuple[list[int], int]], batch_size: int = 8) -> dict:
    """Static batching with `model.generate`: consecutive batches of `batch_size` requests in
    workload order, left-padded, greedy; each batch generates max(output lengths in the batch)
    tokens for every row, so `generated_tokens` >= `useful_tokens`.

    EOS is ignored by passing `eos_token_id=None` to `generate`: call kwargs override the model's
    generation_config (which has eos 2), whereas a GenerationConfig object with eos None would get
    eos refilled from the model's defaults. With no EOS there is no stopping criterion but length;
    the output width is checked anyway."""
    pad_id = model.generation_config.pad_token_id or 0
    useful = generated = 0
    wall = 0.0
    for start in range(0, len(requests), batch_size):
        batch = requests[start : start + batch_size]
        width = max(len(p) for p, _ in batch)
        new_tokens = max(o for _, o in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (prompt, _) in enumerate(batch):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        t0 = time.perf_counter()
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=pad_id,
        )
        wall += time.perf_counter() - t0
        if out.shape[1] != width + new_tokens:
            raise RuntimeError(f"generate stopped early: {out.shape[1] - width} of {new_tokens}")
        useful += sum(o for _, o in batch)
        generated += len(batch) * new_tokens
    return _result(useful, generated, wall)


# No inference_mode here: the manager allocates its buffers in this thread and updates them in
# place from its own (no_grad-only) generation thread, which torch refuses for inference tensors.
def hf_continuous_batching(
    model,
    requests: list[tuple[list[int], int]],
    max_batch_tokens: int = 512,
    max_requests_per_batch: int = 8,
    page_size: int = 256,
) -> dict:
    """transformers' own continuous batching (paged KV cache, FIFO scheduler, chunked prefill),
    driven through `continuous_batching_context_manager` rather than `generate_batch`, because
    only `manager.add_request` takes a per-request `max_new_tokens` (and `eos_token_id`):
    every request generates exactly its own length, so useful == generated tokens.

    EOS is ignored with `eos_token_id=-1` per request (RequestState keeps only ids >= 0, so the
    request's EOS set is empty and only max_new_tokens ends it). Greedy: do_sample=False.

    CPU configuration: attention stays "sdpa", the implementation the model loads with
    (`auto_switch_to_flash=False`: there is no flash kernel on CPU anyway). On CPU the
    decode fast path (flash_attn_with_kvcache + block table), CUDA graphs and async batching are
    all unavailable, so every step runs the varlen path: the batch's query tokens are packed into
    one sequence and attend, through a dense [M, N+M] mask, to all N cached tokens read for the
    batch. Attention cost is thus quadratic in the number of requests in the batch, which is why
    `max_requests_per_batch` is 8, as many as static batching runs at once (in short, noisy probes
    on parts of this workload, 16 was ~10% slower, and 8192 batch tokens with every request
    admitted at once, transformers' defaults, ~40% slower). `max_batch_tokens` is the per-step
    token budget, i.e. the prefill chunk size. The cache is sized to hold the whole workload
    (`num_blocks`) instead of 60% of the machine's RAM, which transformers would otherwise reserve
    on CPU. Manager construction (cache allocation) is reported as setup_s, outside wall_s.
    """
    gen_cfg = GenerationConfig(
        do_sample=False, eos_token_id=-1, max_new_tokens=max(o for _, o in requests)
    )
    # +1 block per request for its partly filled last page; /0.85 because the FIFO scheduler stops
    # admitting new prefills below 15% free blocks (its default safety margin).
    blocks = sum(math.ceil((len(p) + o) / page_size) + 1 for p, o in requests)
    cb_cfg = ContinuousBatchingConfig(
        page_size=page_size,
        num_blocks=math.ceil(blocks / 0.85),
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=max_requests_per_batch,
        auto_switch_to_flash=False,
    )
    t_setup = time.perf_counter()
    with model.continuous_batching_context_manager(
        generation_config=gen_cfg, continuous_batching_config=cb_cfg
    ) as manager:
        t0 = time.perf_counter()
        for i, (prompt, out_len) in enumerate(requests):
            manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=out_len, eos_token_id=-1)
        results = {}
        while len(results) < len(requests):
            res = manager.get_result(timeout=1)
            if res is not None and res.is_finished():
                results[res.request_id] = res
            elif res is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching loop died; see its log above")
        wall = time.perf_counter() - t0
    setup = t0 - t_setup
    generated = 0
    for i, (_, out_len) in enumerate(requests):
        res = results[f"r{i}"]
        if res.error is not None or len(res.generated_tokens) != out_len:
            raise RuntimeError(
                f"request {i}: {len(res.generated_tokens)} of {out_len} tokens, error={res.error}"
            )
        generated += len(res.generated_tokens)
    return _result(sum(o for _, o in requests), generated, wall, setup_s=setup)


@torch.inference_mode()
def hf_prefill_gflops(model, num_tokens: int) -> float:
    """Achieved GFLOP/s of one plain forward pass (transformers defaults: DynamicCache filled,
    logits for every position) over one prompt of `num_tokens` random ids; best of 3 after one
    warm-up. With T = num_tokens, L layers, H query heads of size d, hidden h, vocab V:

        flops = 2*T*W                       W = weights of all nn.Linear in the L decoder layers
              + 2*T*h*V                     LM head (tied to the embedding) at every position
              + 4*L*H*d * T*(T+1)/2         QK^T and PV over the causal half only

    Embedding lookup, norms, RoPE, SiLU and softmax are not counted."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    linear = sum(m.weight.numel() for m in model.model.layers.modules() if isinstance(m, nn.Linear))
    flops = (
        2 * num_tokens * linear
        + 2 * num_tokens * cfg.hidden_size * cfg.vocab_size
        + 4
        * cfg.num_hidden_layers
        * cfg.num_attention_heads
        * head_dim
        * num_tokens
        * (num_tokens + 1)
        / 2
    )
    ids = torch.randint(3, cfg.vocab_size, (1, num_tokens))
    model(ids)  # warm-up
    best = math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        model(ids)
        best = min(best, time.perf_counter() - t0)
    return flops / best / 1e9
