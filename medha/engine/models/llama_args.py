"""The shape of a Llama-family model, read from its config.json and checked: a checkpoint's
config decides how much memory the model takes, so an absurd one must fail here, with the
field named, and not in the allocator."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass

from medha.engine.errors import EngineError
from medha.engine.layers.rotary import ROPE_TYPES, rope_parameters, rope_type

# Any two sizes multiply within int64 (a weight's element count); no real model comes near.
_MAX_SIZE = 2**31 - 1


@dataclass(frozen=True)
class LlamaArgs:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    max_position_embeddings: int

    @classmethod
    def from_config(cls, config: dict, source: object = "config.json") -> LlamaArgs:
        """`source` (the config's path) starts every error message. An optional field that is
        null counts as absent, as in transformers."""

        def size(field: str, default: int | None = None) -> int:
            value = config.get(field)
            if value is None and default is not None:
                return default
            if field not in config:
                raise EngineError(f"{source}: lacks {field!r}")
            return _size(source, field, value)

        def flag(field: str) -> bool:
            value = config.get(field)
            if value is not None and not isinstance(value, bool):
                raise EngineError(f"{source}: {field} must be true or false, got {value!r}")
            return bool(value)

        for field in ("rope_parameters", "rope_scaling"):
            if not isinstance(config.get(field), dict | None):
                raise EngineError(f"{source}: {field} must be an object, got {config[field]!r}")
        if config.get("hidden_act", "silu") != "silu":
            raise EngineError(
                f"{source}: unsupported activation {config['hidden_act']!r} (medha runs silu)"
            )
        hidden, heads = size("hidden_size"), size("num_attention_heads")
        kv_heads = size("num_key_value_heads", heads)
        if config.get("head_dim") is None and hidden % heads:
            raise EngineError(
                f"{source}: hidden_size {hidden} is not a multiple of "
                f"num_attention_heads {heads} (and head_dim is absent)"
            )
        head_dim = size("head_dim", hidden // heads)
        if heads % kv_heads:
            raise EngineError(
                f"{source}: num_attention_heads {heads} is not a multiple of "
                f"num_key_value_heads {kv_heads}"
            )
        if head_dim % 2:
            raise EngineError(
                f"{source}: head_dim must be even (rotary embeddings turn pairs), got {head_dim}"
            )
        eps = config.get("rms_norm_eps")
        theta, scaling = rope_parameters(config)
        return cls(
            hidden_size=hidden,
            intermediate_size=size("intermediate_size"),
            num_layers=size("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=size("vocab_size"),
            rms_norm_eps=1e-6 if eps is None else _positive(source, "rms_norm_eps", eps),
            rope_theta=_positive(source, "rope_theta", theta),
            rope_scaling=_checked_scaling(source, scaling),
            tie_word_embeddings=flag("tie_word_embeddings"),
            attention_bias=flag("attention_bias"),
            mlp_bias=flag("mlp_bias"),
            max_position_embeddings=size("max_position_embeddings", 4096),
        )

    def weight_shapes(self) -> Iterator[tuple[str, tuple[tuple[str, int], ...], str | None]]:
        """What the checkpoint must hold, as load_checkpoint names it (no "model." prefix):
        (tensor name, its dims each with the config fields that set it, and the config flag
        that asks for the tensor, if any)."""
        vocab, hidden = ("vocab_size", self.vocab_size), ("hidden_size", self.hidden_size)
        inter = ("intermediate_size", self.intermediate_size)
        q = ("num_attention_heads * head_dim", self.num_heads * self.head_dim)
        kv = ("num_key_value_heads * head_dim", self.num_kv_heads * self.head_dim)
        yield "embed_tokens.weight", (vocab, hidden), None
        yield "norm.weight", (hidden,), None
        if not self.tie_word_embeddings:
            yield "lm_head.weight", (vocab, hidden), "tie_word_embeddings is false"
        attn, mlp = "attention_bias is true", "mlp_bias is true"
        for i in range(self.num_layers):
            a, m = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
            yield f"layers.{i}.input_layernorm.weight", (hidden,), None
            yield f"layers.{i}.post_attention_layernorm.weight", (hidden,), None
            for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                yield a + name + ".weight", (rows, hidden), None
                if self.attention_bias:
                    yield a + name + ".bias", (rows,), attn
            yield a + "o_proj.weight", (hidden, q), None
            if self.attention_bias:
                yield a + "o_proj.bias", (hidden,), attn
            for name in ("gate_proj", "up_proj"):
                yield m + name + ".weight", (inter, hidden), None
                if self.mlp_bias:
                    yield m + name + ".bias", (inter,), mlp
            yield m + "down_proj.weight", (hidden, inter), None
            if self.mlp_bias:
                yield m + "down_proj.bias", (hidden,), mlp


def _size(source: object, field: str, value) -> int:
    if type(value) is not int or not 1 <= value <= _MAX_SIZE:  # type(): a bool is an int too
        raise EngineError(
            f"{source}: {field} must be a positive integer below 2**31, got {value!r}"
        )
    return value


def _positive(source: object, field: str, value) -> float:
    # the comparisons also refuse NaN, the infinities and ints beyond a float's range
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not 0 < value <= sys.float_info.max
    ):
        raise EngineError(f"{source}: {field} must be a positive finite number, got {value!r}")
    return float(value)


def _checked_scaling(source: object, scaling: dict | None) -> dict | None:
    """The RoPE scaling that inverse_frequencies applies, its numbers sane."""
    if not scaling:
        return None
    kind = rope_type(scaling)
    if kind not in ROPE_TYPES:
        raise EngineError(
            f"{source}: unsupported rope scaling type {kind!r} (supported: {', '.join(ROPE_TYPES)})"
        )
    if kind in ("linear", "llama3"):
        _positive(source, "rope_scaling.factor", scaling.get("factor"))
    if kind == "llama3":
        low = _positive(source, "rope_scaling.low_freq_factor", scaling.get("low_freq_factor"))
        high = _positive(source, "rope_scaling.high_freq_factor", scaling.get("high_freq_factor"))
        if not low < high:  # the smoothing divides by high - low
            raise EngineError(
                f"{source}: rope_scaling.low_freq_factor {low} must be below "
                f"high_freq_factor {high}"
            )
        _size(
            source,
            "rope_scaling.original_max_position_embeddings",
            scaling.get("original_max_position_embeddings"),
        )
    return scaling
