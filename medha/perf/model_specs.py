"""Shapes of the Llama-family models the predictor knows."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_context: int
    tied_embeddings: bool = False
    hf_id: str = ""

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_params(self) -> int:
        h, i = self.hidden_size, self.intermediate_size
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * i + 2 * h
        embeddings = self.vocab_size * h * (1 if self.tied_embeddings else 2)
        return self.num_layers * per_layer + embeddings + h

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of one token over all layers."""
        return 2 * self.num_layers * self.kv_size * dtype_bytes

    def linear_flops(self, num_tokens: int) -> float:
        """Matmul FLOPs of all layers plus the LM head, for `num_tokens` tokens."""
        h, i = self.hidden_size, self.intermediate_size
        per_token_layer = (
            2 * h * (self.q_size + 2 * self.kv_size) + 2 * self.q_size * h + 2 * 3 * h * i
        )
        return num_tokens * (self.num_layers * per_token_layer + 2 * h * self.vocab_size)

    def attention_flops(self, num_tokens: int, kv_offset: int = 0) -> float:
        """QK^T and PV FLOPs of a chunk of `num_tokens` queries after `kv_offset` cached tokens,
        causal inside the chunk (the work a flash kernel executes)."""
        keys_per_query = kv_offset + (num_tokens + 1) / 2
        return 4.0 * num_tokens * keys_per_query * self.q_size * self.num_layers

    def prefill_flops(self, num_tokens: int) -> float:
        return self.linear_flops(num_tokens) + self.attention_flops(num_tokens)


_SPECS = [
    ModelSpec(
        "llama-3-8b",
        32,
        4096,
        32,
        8,
        128,
        14336,
        128256,
        1 << 20,
        hf_id="meta-llama/Meta-Llama-3-8B",
    ),
    ModelSpec(
        "llama-3-70b",
        80,
        8192,
        64,
        8,
        128,
        28672,
        128256,
        1 << 20,
        hf_id="meta-llama/Meta-Llama-3-70B",
    ),
    ModelSpec(
        "llama-2-7b", 32, 4096, 32, 32, 128, 11008, 32000, 4096, hf_id="meta-llama/Llama-2-7b-hf"
    ),
    ModelSpec(
        "llama-2-70b", 80, 8192, 64, 8, 128, 28672, 32000, 4096, hf_id="meta-llama/Llama-2-70b-hf"
    ),
    # PLA-Serve's models (She et al.): Qwen2.5, from each checkpoint's config.json (QKV bias
    # left out: one add per projection). 128K context with YaRN; 32K native.
    ModelSpec(
        "qwen2.5-7b", 28, 3584, 28, 4, 128, 18944, 152064, 32768, hf_id="Qwen/Qwen2.5-7B-Instruct"
    ),
    ModelSpec(
        "qwen2.5-14b", 48, 5120, 40, 8, 128, 13824, 152064, 32768, hf_id="Qwen/Qwen2.5-14B-Instruct"
    ),
    ModelSpec(
        "qwen2.5-32b", 64, 5120, 40, 8, 128, 27648, 152064, 32768, hf_id="Qwen/Qwen2.5-32B-Instruct"
    ),
    # IBM Granite 3.1 8B (the deferred-prefill paper's second model), from the published
    # config.json of ibm-granite/granite-3.1-8b-instruct: 40 layers, hidden 4096, 32 heads,
    # 8 KV heads, MLP 12800, vocabulary 49155, 128K context, tied embeddings (8.17B
    # parameters, the paper's figure; untied would be 8.37B). Granite's scaling multipliers
    # (embedding, residual, attention, logits) change no shape, so no cost.
    ModelSpec(
        "granite-3.1-8b",
        40,
        4096,
        32,
        8,
        128,
        12800,
        49155,
        131072,
        tied_embeddings=True,
        hf_id="ibm-granite/granite-3.1-8b-instruct",
    ),
    ModelSpec(
        "smollm2-135m",
        30,
        576,
        9,
        3,
        64,
        1536,
        49152,
        8192,
        tied_embeddings=True,
        hf_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
]
# Llama-3 ships with an 8K window; the Medha experiments use its long-context (1M) variants,
# which have the same shapes, so the specs allow 1M tokens.
MODELS: dict[str, ModelSpec] = {s.name: s for s in _SPECS}
_ALIASES = {"smollm2": "smollm2-135m", "smollm2-135m-instruct": "smollm2-135m"}
_ALIASES.update({s.hf_id.lower(): s.name for s in _SPECS})
_ALIASES.update({s.hf_id.lower().split("/")[1]: s.name for s in _SPECS})


def get_model(name: str) -> ModelSpec:
    key = name.lower()
    key = _ALIASES.get(key, key)
    if key not in MODELS:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(sorted(MODELS))}")
    return MODELS[key]


def model_from_hf_config(name: str, config: dict) -> ModelSpec:
    """A spec from a Hugging Face `config.json` of a Llama-family model."""
    heads = config["num_attention_heads"]
    return ModelSpec(
        name=name,
        num_layers=config["num_hidden_layers"],
        hidden_size=config["hidden_size"],
        num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,  # null: absent, as in HF
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        intermediate_size=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        max_context=config.get("max_position_embeddings") or 4096,
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
    )
