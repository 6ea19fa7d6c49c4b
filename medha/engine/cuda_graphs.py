"""CUDA graphs of decode-only steps.

A decode step of a 7-8 B model reads its weights once in a few milliseconds, but launched
kernel by kernel (hundreds of them: every layer's GEMMs, norms, rotations, the attention) it
costs more in launches than in memory traffic. So, as vLLM and SGLang do, the engine captures
the whole forward pass of a decode step (embedding, every layer, the LM head) once per padded
batch size when it starts, and a decode-only step replays the graph of the smallest size that
holds it.

What makes a step replayable: every input the forward reads is a tensor in a buffer the graph
holds (token ids, positions, the slots the new K/V go to, each decode's block table and
context length), the decode attention is one Triton kernel that reads shapes from those
tensors (layers/triton_decode.py), and nothing in the forward waits for the host. A step
copies its inputs into the buffers' first rows; the padding rows decode token 0 at position 0
over a context of one token in the runner's spare block, which the scheduler never hands
out, so their K/V writes land nowhere that matters. Batches with a prefill chunk, more
decodes than the largest graph, or a context past the captured tables' width run eagerly.

On a CPU (the tests, model_runner.DECODE_KERNEL_ENV) nothing is captured: a step runs the
same padded forward over the same buffers, eagerly.
"""

from __future__ import annotations

import torch

from medha.engine.layers.attention import AttentionMetadata, DecodePages

LARGEST = 256  # decodes in the largest graph (vLLM's default captures up to 512)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to the scheduler's limit (or LARGEST)."""
    top = max(1, min(max_num_seqs, LARGEST))
    sizes = [s for s in (1, 2, 4, 8) if s < top] + list(range(16, top, 16))
    return sorted({*sizes, top})


class DecodeGraphs:
    def __init__(
        self,
        model,
        kv_caches: list[torch.Tensor],
        block_size: int,
        spare_block: int,
        workspace,
        max_num_seqs: int,
        max_model_len: int,
    ) -> None:
        """Captures every size now (the engine's start-up), for a model runner on CUDA with
        the Triton decode path: its model, KV caches, block size, spare block and workspace
        (not the runner itself, which holds this: no cycle keeps a dropped engine's GPU
        memory alive until the garbage collector runs)."""
        self.model, self.kv_caches, self.workspace = model, kv_caches, workspace
        self.block_size, self.spare_block = block_size, spare_block
        self.kv_heads = model.layers[0].self_attn.kvh
        self.sizes = capture_sizes(max_num_seqs)
        self.width = -(-max_model_len // block_size)  # block-table columns
        n, dev = self.sizes[-1], kv_caches[0].device
        self.spare_slot = spare_block * block_size
        with torch.inference_mode():
            self.ids = torch.zeros(n, dtype=torch.long, device=dev)
            self.positions = torch.zeros(n, dtype=torch.long, device=dev)
            self.slots = torch.full((n,), self.spare_slot, dtype=torch.long, device=dev)
            self.tables = torch.full((n, self.width), spare_block, dtype=torch.int32, device=dev)
            self.lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None]] = {
            size: (None, None) for size in self.sizes
        }
        self.replays = 0
        if dev.type == "cuda":
            self._capture(dev)

    def _capture(self, dev: torch.device) -> None:
        with torch.inference_mode():
            for size in self.sizes:  # compiles the kernel and warms cuBLAS for each shape
                self._forward(size)
            torch.cuda.synchronize(dev)
            pool = torch.cuda.graph_pool_handle()
            # largest first: the smaller graphs reuse its memory from the shared pool
            for size in reversed(self.sizes):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self._forward(size)
                self.graphs[size] = (graph, logits)
            torch.cuda.synchronize(dev)

    def _forward(self, size: int) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.slots[:size],
            decode_groups=[],
            block_size=self.block_size,
            prefills=[],
            workspace=self.workspace,
            pages=DecodePages.of(self.tables[:size], self.lens[:size], self.kv_heads),
        )
        hidden = self.model(self.ids[:size], self.positions[:size], self.kv_caches, meta)
        return self.model.logits(hidden)

    def size_for(self, step) -> int | None:
        """The graph that runs `step`, None where it runs eagerly."""
        if step.decode_tables is None or step.prefills or step.sample_rows is None:
            return None
        n, width = step.decode_tables.shape
        if width > self.width:
            return None
        return next((s for s in self.sizes if s >= n), None)

    @torch.inference_mode()
    def replay(self, step) -> torch.Tensor | None:
        """Logits [decodes, vocab] fp32 on the device, as ModelRunner.run returns them, or
        None for a step that no graph runs."""
        size = self.size_for(step)
        if size is None:
            return None
        n, width = step.decode_tables.shape
        self.ids[:n].copy_(step.ids)
        self.positions[:n].copy_(step.positions)
        self.slots[:n].copy_(step.slot_mapping)
        self.tables[:n, :width].copy_(step.decode_tables)
        self.lens[:n].copy_(step.decode_lens)
        if size > n:  # padding rows: token 0 at position 0 in the spare block
            self.ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slots[n:size].fill_(self.spare_slot)
            self.tables[n:size, 0].fill_(self.spare_block)
            self.lens[n:size].fill_(1)
        graph, logits = self.graphs[size]
        if graph is None:  # on a CPU: the same padded step, eagerly
            logits = self._forward(size)
        else:
            graph.replay()
        self.replays += 1
        return logits[:n]
