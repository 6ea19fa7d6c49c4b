"""Runs one scheduler Batch through the model: builds the flattened token batch and the
attention metadata from the block tables, and returns logits for the sampling positions."""

from __future__ import annotations

from pathlib import Path

import torch

from medha.core.batch import Batch
from medha.engine.layers.attention import AttentionMetadata, DecodeGroup, PrefillSpan, Workspace
from medha.engine.models.llama import LlamaArgs, LlamaForCausalLM
from medha.scheduler.block_manager import BlockManager


class ModelRunner:
    def __init__(self, path: Path, config: dict, device: torch.device, dtype: torch.dtype,
                 num_blocks: int, block_size: int) -> None:
        self.args = LlamaArgs.from_config(config)
        self.device, self.dtype = device, dtype
        self.block_size = block_size
        with torch.device("meta"):  # no random init: the weights are loaded next
            model = LlamaForCausalLM(self.args)
        model.to_empty(device=device)
        model.rotary = model.rotary.__class__(self.args.head_dim, self.args.rope_theta,
                                              self.args.rope_scaling).to(device)
        model.load_checkpoint(path, dtype, device)
        self.model = model.eval()
        self.workspace = Workspace()
        a = self.args
        shape = (a.num_kv_heads, num_blocks * block_size, a.head_dim)  # see layers/attention
        # zeros, not empty: stale memory can hold denormals or NaNs, which slow CPU math down
        # even where the attention mask hides them
        self.kv_caches = [(torch.zeros(shape, dtype=dtype, device=device),
                           torch.zeros(shape, dtype=dtype, device=device))
                          for _ in range(a.num_layers)]

    @staticmethod
    def kv_bytes_per_token(config: dict, dtype: torch.dtype) -> int:
        a = LlamaArgs.from_config(config)
        return 2 * a.num_layers * a.num_kv_heads * a.head_dim * torch.finfo(dtype).bits // 8

    def _slots(self, blocks: list[int], start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        table = torch.tensor(blocks, dtype=torch.long)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def _decode_group(self, decodes, start: int, end: int, blocks: BlockManager,
                      slot_parts: list[torch.Tensor]) -> DecodeGroup:
        bs = self.block_size
        chunks = decodes[start:end]
        lens = torch.tensor([c.start + 1 for c in chunks])  # contexts incl. the new token
        tables = [blocks.blocks_of(c.request.request_id) for c in chunks]
        width = max(len(t) for t in tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
        last = lens - 1
        slot_parts.append(table[torch.arange(len(chunks)), last // bs] * bs + last % bs)
        mask = (torch.arange(width * bs)[None, :] < lens[:, None])[None, :, None, :]
        lone = self._slots(tables[0], 0, int(lens[0])) if len(chunks) == 1 else None
        dev = self.device
        return DecodeGroup(start, end, table.reshape(-1).to(dev), mask.to(dev),
                           None if lone is None else lone.to(dev))

    @torch.inference_mode()
    def execute(self, batch: Batch, contexts: dict[str, list[int]], blocks: BlockManager,
                all_logits: bool = False) -> tuple[torch.Tensor, list]:
        """Returns (logits [samples, vocab] fp32, the sampling chunks in row order).

        `all_logits` returns every row's logits instead (decodes first, then each prefill
        chunk's tokens): what correctness tests compare with a reference model."""
        ids: list[int] = []
        positions: list[int] = []
        slot_parts: list[torch.Tensor] = []
        sample_rows: list[int] = []
        sample_chunks = []
        bs = self.block_size

        # decodes first, sorted by context so that each attention group pads little
        decodes = sorted(batch.decodes, key=lambda c: c.start)
        groups: list[DecodeGroup] = []
        start = 0
        while start < len(decodes):
            end = start + 1
            while end < len(decodes) and decodes[end].start < 1.25 * decodes[start].start + bs:
                end += 1
            groups.append(self._decode_group(decodes, start, end, blocks, slot_parts))
            start = end
        for i, c in enumerate(decodes):
            ids.append(contexts[c.request.request_id][c.start])
            positions.append(c.start)
            sample_rows.append(i)
            sample_chunks.append(c)

        spans = []
        row = len(decodes)
        for c in batch.prefills:
            rid = c.request.request_id
            ids.extend(contexts[rid][c.start:c.end])
            positions.extend(range(c.start, c.end))
            ctx_slots = self._slots(blocks.blocks_of(rid), 0, c.end)
            slot_parts.append(ctx_slots[c.start:])
            spans.append(PrefillSpan(row, row + c.num_tokens, c.start, ctx_slots.to(self.device)))
            row += c.num_tokens
            if c.samples:
                sample_rows.append(row - 1)
                sample_chunks.append(c)

        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.cat(slot_parts).to(dev), num_decodes=len(decodes),
            decode_groups=groups,
            block_size=bs, prefills=spans, workspace=self.workspace)
        hidden = self.model(torch.tensor(ids, device=dev), torch.tensor(positions, device=dev),
                            self.kv_caches, meta)
        if all_logits:
            return self.model.logits(hidden).cpu(), sample_chunks
        if not sample_rows:
            return torch.empty(0, self.args.vocab_size), []
        logits = self.model.logits(hidden[torch.tensor(sample_rows, device=dev)])
        return logits.cpu(), sample_chunks
