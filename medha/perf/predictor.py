"""How long a batch takes: the interface both predictors implement.

A batch's time is split the way its kernels split: token-parallel work (GEMMs, norms, LM head,
collectives) depends only on how many tokens and sequences the batch holds, while attention is a
sum over its members (a prefill chunk of n tokens after k cached ones; a decode over k cached
ones). That split lets the packer ask "how long if I add this chunk?" in O(1) while it
binary-searches chunk sizes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

from medha.core.batch import Batch
from medha.perf.hardware_specs import HardwareSpec
from medha.perf.model_specs import ModelSpec
from medha.perf.parallel_config import ParallelConfig


class Predictor(ABC):
    name: str = "predictor"

    def __init__(self, model: ModelSpec, hardware: HardwareSpec, parallel: ParallelConfig):
        self.model = model
        self.hardware = hardware
        self.parallel = parallel

    @abstractmethod
    def linear_time(self, num_tokens: int, num_seqs: int) -> float:
        """Seconds of everything but attention for a batch of `num_tokens` tokens that belong to
        `num_seqs` sequences (one logit row each), through all pipeline stages."""

    @abstractmethod
    def prefill_attention_time(self, num_tokens: int, kv_offset: int) -> float:
        """Seconds of attention, all layers, for one chunk of `num_tokens` after `kv_offset`."""

    @abstractmethod
    def decode_attention_time(self, kv_len: int) -> float:
        """Seconds of attention, all layers, for one decode token over `kv_len` cached tokens."""

    def decode_attention_total(self, kv_lens: list[int]) -> float:
        """Attention time of a group of decodes (predictors with a closed form override it)."""
        return sum(map(self.decode_attention_time, kv_lens))

    def prefill_step_time(self, num_tokens: int, kv_offset: int) -> float:
        """Seconds of a step that runs one prefill chunk alone: `num_tokens` after
        `kv_offset` computed ones (what Algorithm 3 and the chunking price walk)."""
        return self.linear_time(num_tokens, 1) + self.prefill_attention_time(num_tokens, kv_offset)

    def timer(self) -> BatchTimer:
        return BatchTimer(self)

    def shape_time(
        self, prefills: Iterable[tuple[int, int]] = (), decode_kv_lens: Iterable[int] = ()
    ) -> float:
        """Predicted time of a batch given as (chunk, kv_offset) pairs and decode KV lengths."""
        t = self.timer()
        for kv in decode_kv_lens:
            t.add_decode(kv)
        for n, k in prefills:
            t.add_prefill(n, k)
        return t.time()

    def batch_time(self, batch: Batch) -> float:
        return self.shape_time(*batch.shape())

    def fingerprint(self) -> dict | None:
        """Everything its predictions depend on, as JSON data, for tables derived from them
        and kept on disk (the simulator's set-up cache); None, the default, keeps them off
        the disk. A subclass with inputs of its own must add them."""
        return None

    def describe(self) -> str:
        p = self.parallel
        return (
            f"{self.name} predictor: {self.model.name} on {self.hardware.name}, "
            f"tp={p.tp} spp={p.spp} kvp={p.kvp}"
        )


class WrappedPredictor(Predictor):
    """`inner`'s times, for a predictor that changes some of them (a subclass overrides what it
    changes, typically `linear_time` for a cost paid once per iteration) and keeps the rest."""

    def __init__(self, inner: Predictor) -> None:
        super().__init__(inner.model, inner.hardware, inner.parallel)
        self.inner = inner

    def linear_time(self, num_tokens: int, num_seqs: int) -> float:
        return self.inner.linear_time(num_tokens, num_seqs)

    def prefill_attention_time(self, num_tokens: int, kv_offset: int) -> float:
        return self.inner.prefill_attention_time(num_tokens, kv_offset)

    def decode_attention_time(self, kv_len: int) -> float:
        return self.inner.decode_attention_time(kv_len)

    def decode_attention_total(self, kv_lens: list[int]) -> float:
        return self.inner.decode_attention_total(kv_lens)


class BatchTimer:
    """A batch under construction, with its predicted time kept up to date."""

    __slots__ = ("_p", "num_tokens", "num_seqs", "attention_s")

    def __init__(self, predictor: Predictor) -> None:
        self._p = predictor
        self.num_tokens = 0
        self.num_seqs = 0
        self.attention_s = 0.0

    def add_decode(self, kv_len: int) -> None:
        self.num_tokens += 1
        self.num_seqs += 1
        self.attention_s += self._p.decode_attention_time(kv_len)

    def add_decodes(self, kv_lens: list[int]) -> None:
        self.num_tokens += len(kv_lens)
        self.num_seqs += len(kv_lens)
        self.attention_s += self._p.decode_attention_total(kv_lens)

    def add_prefill(self, num_tokens: int, kv_offset: int) -> None:
        self.num_tokens += num_tokens
        self.num_seqs += 1
        self.attention_s += self._p.prefill_attention_time(num_tokens, kv_offset)

    def time(self) -> float:
        if self.num_seqs == 0:
            return 0.0
        return self._p.linear_time(self.num_tokens, self.num_seqs) + self.attention_s

    def time_with_prefill(self, num_tokens: int, kv_offset: int) -> float:
        """Predicted time if a chunk of `num_tokens` after `kv_offset` joined the batch."""
        p = self._p
        return (
            p.linear_time(self.num_tokens + num_tokens, self.num_seqs + 1)
            + self.attention_s
            + p.prefill_attention_time(num_tokens, kv_offset)
        )
