"""The roofline predictor with decode attention padded to the batch's longest context.

The roofline prices a group of decodes as the sum of their own KV reads, the ideal of a kernel
that balances work across the device (split-KV / flash-decoding). A kernel that pads the
batch's contexts to the longest one (a static-shape batched attention; medha's CPU engine does
this within each of its length groups) pays n x t(longest) instead. That is the iteration-level
bubble AlignedServe removes; this predictor lets the simulator price it, so that whatever
prefix-aware batching gains there comes from the cost model.
"""

from __future__ import annotations

from medha.perf.predictor import BatchTimer, Predictor
from medha.perf.roofline_predictor import RooflinePredictor


class PaddedRooflinePredictor(RooflinePredictor):
    name = "roofline-padded"

    def decode_attention_total(self, kv_lens: list[int]) -> float:
        return len(kv_lens) * self.decode_attention_time(max(kv_lens)) if kv_lens else 0.0

    def timer(self) -> BatchTimer:
        return PaddedBatchTimer(self)


class PaddedBatchTimer(BatchTimer):
    """Keeps the decodes as (count, longest) and adds their padded attention at the end."""

    __slots__ = ("_decodes", "_longest")

    def __init__(self, predictor: Predictor) -> None:
        super().__init__(predictor)
        self._decodes = 0
        self._longest = 0

    def add_decode(self, kv_len: int) -> None:
        self.add_decodes([kv_len])

    def add_decodes(self, kv_lens: list[int]) -> None:
        if kv_lens:
            self.num_tokens += len(kv_lens)
            self.num_seqs += len(kv_lens)
            self._decodes += len(kv_lens)
            self._longest = max(self._longest, max(kv_lens))

    def _decode_s(self) -> float:
        return (
            self._decodes * self._p.decode_attention_time(self._longest) if self._decodes else 0.0
        )

    def time(self) -> float:
        return super().time() + self._decode_s() if self.num_seqs else 0.0

    def time_with_prefill(self, num_tokens: int, kv_offset: int) -> float:
        return super().time_with_prefill(num_tokens, kv_offset) + self._decode_s()
