"""Stream pipeline across processes: stage 0 runs in the engine's process (rank 0, with its TP
and KVP peers, which get each step from it), stage s in the ranks of stage s (layout.py). A
batch's tensors and stage 0's output go on with non-blocking sends, so rank 0 is free to
schedule the next batch (the next chunk of the same long prefill, say) and run its stage 0
while stage 1 works on this one: the stages work on different chunks at once. The last stage
sends its output, with every stage's (start, end) times, back to rank 0, which picks the rows
to sample and computes their logits. Messages between two ranks arrive in the order they were
sent, and every stage takes batches in order, so no batch id is needed on the wire.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from medha.engine.parallel.layout import Layout


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


def stage_loop(runner, rank: int, layout: Layout, hidden_size: int) -> None:
    """A worker's life at (group k, stage s, TP rank t): take a batch from the previous stage
    (stage 0: the step from rank 0), run this stage's layers, pass the result on. The last stage
    of group 0, TP rank 0, sends it back to rank 0; its peers' copies are the same and dropped."""
    k, s, t = layout.coords(rank)
    src = 0 if s == 0 else layout.rank(k, s - 1, t)
    last = s == layout.spp - 1
    dst = (0 if k == t == 0 else None) if last else layout.rank(k, s + 1, t)
    while True:
        message = recv_object(src)
        if message is None:
            if not last:
                wait_all(send_object(None, dst))
            return
        if s == 0:
            step, times, hidden = message, [], None
        else:
            step, times = message
            hidden = torch.empty(step.ids.numel(), hidden_size, dtype=runner.dtype)
            dist.recv(hidden, src)
        start = time.monotonic()
        out = runner.forward(step, hidden).cpu()
        times = [*times, (start, time.monotonic())]
        if dst is None:
            continue
        handles = send_object(times if last else (step, times), dst)
        handles.append((dist.isend(out.contiguous(), dst), out))
        wait_all(handles)


class StagePipeline:
    """Rank 0's side: hands a batch to the other stage-0 ranks, runs its own stage 0, sends the
    batch into the pipeline and collects it at the end."""

    def __init__(self, layout: Layout, hidden_size: int, dtype: torch.dtype) -> None:
        self.layout, self.hidden_size, self.dtype = layout, hidden_size, dtype
        self._next = layout.rank(0, 1, 0)
        self._peers = layout.stage_zero_peers()
        self._last = layout.rank(0, layout.spp - 1, 0)
        self._pending: list[list] = []  # send handles of the batches in flight, oldest first
        # (batch id, stage, start, end) of every batch so far: what the SPP overlap check reads
        self.stage_times: list[tuple[int, int, float, float]] = []

    def launch(self, step, stage0: Callable[[], torch.Tensor]) -> None:
        """Run `stage0` (this process's stage 0 of `step`) and send its output on."""
        handles = [h for peer in self._peers for h in send_object(step, peer)]
        start = time.monotonic()
        hidden = stage0().cpu().contiguous()
        handles += send_object((step, [(start, time.monotonic())]), self._next)
        handles.append((dist.isend(hidden, self._next), hidden))
        self._pending.append(handles)

    def result(self, batch_id: int, rows: int) -> torch.Tensor:
        """The last stage's output (`rows` token rows) for the oldest batch in flight."""
        times = recv_object(self._last)
        out = torch.empty(rows, self.hidden_size, dtype=self.dtype)
        dist.recv(out, self._last)
        wait_all(self._pending.pop(0))
        self.stage_times.extend((batch_id, s, a, b) for s, (a, b) in enumerate(times))
        return out

    def close(self) -> None:
        wait_all([h for rank in [*self._peers, self._next] for h in send_object(None, rank)])
