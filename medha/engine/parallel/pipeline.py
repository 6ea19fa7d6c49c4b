"""Stream pipeline across processes: stage 0 runs in the engine's process (rank 0), stage s in rank
s. A batch's tensors and stage 0's output go to rank 1 with non-blocking sends, so rank 0 is
free to schedule the next batch (the next chunk of the same long prefill, say) and run its stage
0 while rank 1 works on this one: the stages work on different chunks at once. The last stage
sends its output, with every stage's (start, end) times, back to rank 0, which picks the rows to
sample and computes their logits. Messages between two ranks arrive in the order they were sent,
and every stage takes batches in order, so no batch id is needed on the wire.
"""

from __future__ import annotations

import pickle
import time

import torch
import torch.distributed as dist


def send_object(obj, dst: int) -> list:
    """Non-blocking; keep the returned handles (and buffers) until they complete."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.long)
    return [(dist.isend(size, dst), size), (dist.isend(data, dst), data)]


def recv_object(src: int):
    size = torch.empty(1, dtype=torch.long)
    dist.recv(size, src)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(data, src)
    return pickle.loads(data.numpy().tobytes())


def wait_all(handles: list) -> None:
    for work, _ in handles:
        work.wait()


def stage_loop(runner, rank: int, spp: int, hidden_size: int) -> None:
    """A worker's life as stage `rank`: take a batch from the previous stage, run this
    stage's layers, pass the result on (to rank 0 from the last stage)."""
    last = rank == spp - 1
    while True:
        message = recv_object(rank - 1)
        if message is None:
            if not last:
                wait_all(send_object(None, rank + 1))
            return
        step, times = message
        hidden = torch.empty(step.ids.numel(), hidden_size, dtype=runner.dtype)
        dist.recv(hidden, rank - 1)
        start = time.monotonic()
        out = runner.forward(step, hidden).cpu()
        times = [*times, (start, time.monotonic())]
        dst = 0 if last else rank + 1
        handles = send_object(times if last else (step, times), dst)
        handles.append((dist.isend(out.contiguous(), dst), out))
        wait_all(handles)


class StagePipeline:
    """Rank 0's side: sends a batch into the pipeline after stage 0 and collects it at the end."""

    def __init__(self, spp: int, hidden_size: int, dtype: torch.dtype) -> None:
        self.spp, self.hidden_size, self.dtype = spp, hidden_size, dtype
        self._pending: list[list] = []  # send handles of the batches in flight, oldest first
        # (batch id, stage, start, end) of every batch so far: what the SPP overlap check reads
        self.stage_times: list[tuple[int, int, float, float]] = []

    def launch(self, step, hidden: torch.Tensor, stage0: tuple[float, float]) -> None:
        handles = send_object((step, [stage0]), 1)
        hidden = hidden.cpu().contiguous()
        handles.append((dist.isend(hidden, 1), hidden))
        self._pending.append(handles)

    def result(self, batch_id: int, rows: int) -> torch.Tensor:
        """The last stage's output (`rows` token rows) for the oldest batch in flight."""
        src = self.spp - 1
        times = recv_object(src)
        out = torch.empty(rows, self.hidden_size, dtype=self.dtype)
        dist.recv(out, src)
        wait_all(self._pending.pop(0))
        self.stage_times.extend((batch_id, s, a, b) for s, (a, b) in enumerate(times))
        return out

    def close(self) -> None:
        wait_all(send_object(None, 1))
