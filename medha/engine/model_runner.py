"""Runs one scheduler Batch through the model: builds the flattened token batch and the
attention metadata from the chunks' tokens and block tables (the batch is all it reads), and
returns logits for the sampling positions."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from medha.core.batch import Batch
from medha.engine.errors import blame
from medha.engine.layers import vllm_kernels
from medha.engine.layers.attention import (
    AttentionMetadata,
    DecodeGroup,
    DecodePages,
    PrefillSpan,
    Workspace,
)
from medha.engine.models.llama import LlamaArgs, LlamaForCausalLM
from medha.engine.parallel.kv_parallel import SINGLE_GROUP, KvParallel, build_view
from medha.engine.parallel.stage import WHOLE, Stage
from medha.engine.parallel.tensor_parallel import SINGLE, TensorParallel

# Which kernel attends the decodes on torch's ops: auto (Triton on CUDA, the torch path
# elsewhere), torch, or triton, which on a CPU runs CUDA's decode path in Triton's interpreter
# (TRITON_INTERPRET=1 turns it on) with the CUDA graphs' padded steps run eagerly: for the
# tests that check it against the torch path where no GPU is, and A/B runs on a GPU
DECODE_KERNEL_ENV = "MEDHA_DECODE_KERNEL"

log = logging.getLogger(__name__)


def padded_tables(chunks, dtype: torch.dtype) -> torch.Tensor:
    """The chunks' block tables as one [chunks, widest] tensor, each row padded with block 0
    (never read: every kernel stops at its own context)."""
    width = max(len(c.block_table) for c in chunks)
    return torch.tensor(
        [c.block_table + [0] * (width - len(c.block_table)) for c in chunks], dtype=dtype
    )


@dataclass
class StepInput:
    """One batch as plain tensors: all a rank needs to run it, picklable for the workers."""

    ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillSpan]
    sample_rows: list[int] | None  # None: logits of every row
    paged: vllm_kernels.PagedBatch | None = None  # with vLLM's kernels, instead of the groups
    # on CUDA (the Triton decode kernel), instead of the groups: each decode's block ids
    # [D, width] int32 and its context [D] int32
    decode_tables: torch.Tensor | None = None
    decode_lens: torch.Tensor | None = None
    # (async scheduling) (row, request id) of each decode whose input token the batch running
    # ahead samples: its id is a placeholder here, the engine feeds it on the device (`run`)
    pending: list[tuple[int, str]] = dataclasses.field(default_factory=list)

    def to(self, device: torch.device) -> StepInput:
        """The step on `device`. The copies do not wait for the device: torch's blocking
        host-to-device copy synchronizes the stream, which would make the host wait for the
        batch running ahead (async scheduling) before it could launch this one. A step
        already there (one device a process) is returned as it is: run moves it, then forward
        would again."""
        if device.type == "cpu" or self.ids.device.type == device.type:
            return self

        def move(obj):
            changes = {
                f.name: getattr(obj, f.name).to(device, non_blocking=True)
                for f in dataclasses.fields(obj)
                if isinstance(getattr(obj, f.name), torch.Tensor)
            }
            return dataclasses.replace(obj, **changes)

        return dataclasses.replace(
            move(self),
            decode_groups=[move(g) for g in self.decode_groups],
            prefills=[move(p) for p in self.prefills],
        )


class ModelRunner:
    def __init__(
        self,
        path: Path,
        config: dict,
        device: torch.device,
        dtype: torch.dtype,
        num_blocks: int,
        block_size: int,
        tp: TensorParallel = SINGLE,
        workers=None,
        stage: Stage = WHOLE,
        kvp: KvParallel = SINGLE_GROUP,
        kernels: str = "torch",
    ) -> None:
        """`tp`: this process's tensor-parallel rank; `stage`: the pipeline stage whose layers
        it holds; `kvp`: its KV-cache parallel group (`num_blocks` are that group's);
        `workers` (rank 0 only): the WorkerGroup running the other ranks, which gets every
        step before rank 0 runs it; `kernels`: torch or vllm (resolved, see vllm_kernels)."""
        self.args = LlamaArgs.from_config(config)
        self.device, self.dtype = device, dtype
        self.block_size = block_size
        self.workers = workers
        self.kvp = kvp
        with torch.device("meta"):  # no random init: the weights are loaded next
            model = LlamaForCausalLM(self.args, tp, stage)
        model.to_empty(device=device)
        model.rotary = model.rotary.__class__(
            self.args.head_dim, self.args.rope_theta, self.args.rope_scaling
        ).to(device)
        model.load_checkpoint(path, dtype, device)
        self.kernels = kernels
        # CUDA's decodes run in Triton kernels that read the blocks in place, and its RoPE in
        # one (both tile a head: a power-of-two head_dim, as every Llama's; others take the
        # torch path)
        dim = self.args.head_dim
        self.triton_decode = (
            os.environ.get(DECODE_KERNEL_ENV, "auto")
            in (("auto", "triton") if device.type == "cuda" else ("triton",))
            and kernels == "torch"
            and kvp.size == 1
            and dim >= 16
            and dim & (dim - 1) == 0
            and importlib.util.find_spec("triton") is not None
        )
        self.graphs = None  # CUDA graphs of decode steps (capture_decode_graphs)
        model.triton_rope = self.triton_decode
        if device.type == "cpu" and dtype != torch.float32 and kernels == "torch":
            model.split_projections()
        if kernels == "vllm":
            model.use_vllm_kernels()
            self.isa = vllm_kernels.attention_isa(dtype, block_size)
        self.model = model.eval()
        self.workspace = Workspace()
        a = self.args
        # this rank's KV heads only, K and V of a layer in one tensor (the layout is in
        # layers/attention). On CUDA one more block than the scheduler's: where a CUDA graph's
        # padding rows write their K/V
        self.spare_block = num_blocks if self.triton_decode else None
        slots = (num_blocks + (self.spare_block is not None)) * block_size
        shape = (2 * model.layers[0].self_attn.kvh, slots, a.head_dim)
        # zeros, not empty: stale memory can hold denormals or NaNs, which slow CPU math down
        # even where the attention mask hides them
        self.kv_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in model.layers]

    @staticmethod
    def kv_bytes_per_token(config: dict, dtype: torch.dtype) -> int:
        a = LlamaArgs.from_config(config)
        return 2 * a.num_layers * a.num_kv_heads * a.head_dim * torch.finfo(dtype).bits // 8

    def _slots(self, blocks: list[int], start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        table = torch.tensor(blocks, dtype=torch.long)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def _decode_group(
        self, decodes, start: int, end: int, slot_parts: list[torch.Tensor]
    ) -> DecodeGroup:
        bs = self.block_size
        chunks = decodes[start:end]
        lens = torch.tensor([c.start + 1 for c in chunks])  # contexts incl. the new token
        table = padded_tables(chunks, torch.long)
        width = table.shape[1]
        last = lens - 1
        slot_parts.append(table[torch.arange(len(chunks)), last // bs] * bs + last % bs)
        mask = (torch.arange(width * bs)[None, :] < lens[:, None])[None, :, None, :]
        lone = self._slots(chunks[0].block_table, 0, int(lens[0])) if len(chunks) == 1 else None
        return DecodeGroup(start, end, table.reshape(-1), mask, lone)

    def chunk_inputs(self, batch: Batch) -> tuple[dict[str, list[int]], set[str]]:
        """Each chunk's token ids, read and checked against its block table under its
        request's name: a request whose inputs cannot be read fails alone, before anything
        runs. And the decodes whose token is a placeholder (async scheduling: the batch
        running ahead samples it), given id 0 here."""
        inputs, pending = {}, set()
        for c in (*batch.decodes, *batch.prefills):
            rid = c.request.request_id
            with blame(rid):
                tokens, table = c.token_ids, c.block_table
                if not tokens and c.num_tokens == 1 and c.request.num_placeholders:
                    tokens = [0]
                    pending.add(rid)
                if len(tokens) != c.num_tokens or len(table) * self.block_size < c.end:
                    raise IndexError(
                        f"chunk [{c.start}:{c.end}) lies beyond its {len(tokens)}"
                        f" tokens or {len(table)} KV blocks"
                    )
                inputs[rid] = tokens
        return inputs, pending

    def prepare(self, batch: Batch, all_logits: bool = False) -> tuple[StepInput, list]:
        """The batch as tensors (decodes first, then each prefill chunk's tokens), and the
        chunks whose next token is sampled, in the order of their logits rows. Raises
        RequestFailedError, before anything runs, for a request whose inputs are broken."""
        inputs, pending = self.chunk_inputs(batch)
        ids: list[int] = []
        positions: list[int] = []
        slot_parts: list[torch.Tensor] = []
        sample_rows: list[int] = []
        sample_chunks = []
        bs = self.block_size

        # decodes first, sorted by context so that each attention group pads little
        decodes = sorted(batch.decodes, key=lambda c: c.start)
        groups: list[DecodeGroup] = []
        tables = lens = None
        if self.kernels == "vllm" or self.triton_decode:  # one kernel call attends them all
            slot_parts.append(
                torch.tensor(
                    [c.block_table[c.start // bs] * bs + c.start % bs for c in decodes],
                    dtype=torch.long,
                )
            )
            if self.triton_decode and decodes:  # it reads each context by its block table
                tables = padded_tables(decodes, torch.int32)
                lens = torch.tensor([c.start + 1 for c in decodes], dtype=torch.int32)
        else:
            start = 0
            while start < len(decodes):
                end = start + 1
                # with KVP every decode reads its own slots: groups split its context anyway
                while (
                    end < len(decodes)
                    and self.kvp.size == 1
                    and decodes[end].start < 1.25 * decodes[start].start + bs
                ):
                    end += 1
                groups.append(self._decode_group(decodes, start, end, slot_parts))
                start = end
        pending_rows = []
        for i, c in enumerate(decodes):
            rid = c.request.request_id
            ids.extend(inputs[rid])
            if rid in pending:
                pending_rows.append((i, rid))
            positions.append(c.start)
            sample_rows.append(i)
            sample_chunks.append(c)

        spans = []
        row = len(decodes)
        for c in batch.prefills:
            ids.extend(inputs[c.request.request_id])
            positions.extend(range(c.start, c.end))
            if self.kernels == "vllm":  # the kernel reads the context from the block table
                slot_parts.append(self._slots(c.block_table, c.start, c.end))
            else:
                ctx_slots = self._slots(c.block_table, 0, c.end)
                slot_parts.append(ctx_slots[c.start :])
                spans.append(PrefillSpan(row, row + c.num_tokens, c.start, ctx_slots))
            row += c.num_tokens
            if c.samples:
                sample_rows.append(row - 1)
                sample_chunks.append(c)
        step = StepInput(
            torch.tensor(ids),
            torch.tensor(positions),
            torch.cat(slot_parts),
            groups,
            spans,
            None if all_logits else sample_rows,
            self._paged(decodes, batch.prefills) if self.kernels == "vllm" else None,
            tables,
            lens,
            pending_rows,
        )
        return step, sample_chunks

    @staticmethod
    def _paged(decodes, prefills) -> vllm_kernels.PagedBatch:
        chunks = [*decodes, *prefills]  # the order of their rows in the batch
        starts = [0]
        for c in chunks:
            starts.append(starts[-1] + c.num_tokens)
        return vllm_kernels.PagedBatch(
            torch.tensor(starts, dtype=torch.int32),
            torch.tensor([c.end for c in chunks], dtype=torch.int32),
            padded_tables(chunks, torch.int32),
        )

    @torch.inference_mode()
    def forward(
        self,
        step: StepInput,
        hidden: torch.Tensor | None = None,
        pause: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """This rank's stage of the step: from the token ids on the first stage, from the
        previous stage's output `hidden` elsewhere. `pause`: the model calls it
        between the parts of its layers (a paused step: medha/engine/pauses.py)."""
        step = step.to(self.device)
        meta = AttentionMetadata(
            slot_mapping=step.slot_mapping,
            decode_groups=step.decode_groups,
            block_size=self.block_size,
            prefills=step.prefills,
            workspace=self.workspace,
            kvp=build_view(step, self.kvp, self.block_size) if self.kvp.size > 1 else None,
        )
        if step.decode_tables is not None:
            kvh = self.model.layers[0].self_attn.kvh
            meta.pages = DecodePages.of(step.decode_tables, step.decode_lens, kvh)
        if step.paged is not None:
            attn = self.model.layers[0].self_attn
            meta.paged = vllm_kernels.plan(
                step.paged, attn.h, attn.kvh, attn.d, self.dtype, self.isa
            )
        if hidden is not None:
            hidden = hidden.to(self.device)
        return self.model(step.ids, step.positions, self.kv_caches, meta, hidden, pause)

    def capture_decode_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """CUDA graphs of decode-only steps (engine/cuda_graphs.py): from now on such a step
        replays one instead of launching its kernels one by one."""
        from medha.engine.cuda_graphs import DecodeGraphs

        try:
            self.graphs = DecodeGraphs(
                self.model,
                self.kv_caches,
                self.block_size,
                self.spare_block,
                self.workspace,
                max_num_seqs,
                max_model_len,
            )
        except Exception as e:  # a driver or kernel that cannot be captured: serve eagerly
            log.warning("CUDA graph capture failed (%s): decode steps run eagerly", e)
            self.graphs = None

    @torch.inference_mode()
    def logits(self, step: StepInput, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [rows, vocab] fp32 on the model's device of the step's sampling rows (every
        row if it names none), from the last stage's output; empty on TP ranks other than 0.
        They stay where they are computed: the sampler reads what it needs of them there."""
        if self.model.tp.rank != 0:
            return torch.empty(0, device=self.device)
        hidden = hidden.to(self.device)
        rows = step.sample_rows
        # rows are increasing: as many as the hidden states are all of them (a decode step)
        if rows is not None and len(rows) < hidden.shape[0]:
            if not rows:
                return torch.empty(0, self.args.vocab_size, device=self.device)
            hidden = hidden[torch.tensor(rows).to(hidden.device, non_blocking=True)]
        return self.model.logits(hidden)

    def run(
        self,
        step: StepInput,
        feed: tuple[torch.Tensor, torch.Tensor] | None = None,
        pause: Callable[[], None] | None = None,
    ):
        """The whole model on this process (one TP rank of it): logits on the device.
        `feed`: (rows, token ids), device tensors: the input ids of the step's pending rows,
        sampled on the device by the batch before it (async scheduling). `pause`:
        as `forward`'s."""
        step = step.to(self.device)
        if feed is not None:
            step.ids[feed[0]] = feed[1]
        if self.graphs is not None:
            logits = self.graphs.replay(step)
            if logits is not None:
                return logits
        return self.logits(step, self.forward(step, pause=pause))

    def execute(self, batch: Batch, all_logits: bool = False) -> tuple[torch.Tensor, list]:
        """Returns (logits [samples, vocab] fp32 on the CPU, the sampling chunks in row order).

        `all_logits` returns every row's logits instead (decodes first, then each prefill
        chunk's tokens): what correctness tests compare with a reference model."""
        step, chunks = self.prepare(batch, all_logits)
        if self.workers is not None:
            self.workers.broadcast(step)
        return self.run(step).cpu(), chunks
