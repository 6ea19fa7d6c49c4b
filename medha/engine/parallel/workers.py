"""The other processes of a replica, driven by the engine's process (rank 0).

Rank 0 keeps the scheduler, the tokenizer and the sampler. With tensor parallelism it broadcasts
each batch's tensors (a StepInput) and all ranks run their shard of the forward pass, joined by
all-reduces. With stream-pipeline parallelism rank s holds stage s and batches flow from stage
to stage (pipeline.py). torch.distributed carries both, over gloo on CPU: one runtime, one
process group, and the metadata broadcast is ordered with the collectives of the step by
construction (a separate ZeroMQ channel would need its own ordering and failure handling). The
metadata of a step is a few kilobytes of tensors; pickling it costs well under a millisecond.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from medha.engine.parallel.pipeline import StagePipeline, stage_loop
from medha.engine.parallel.stage import WHOLE, Stage
from medha.engine.parallel.tensor_parallel import SINGLE, TensorParallel

# A collective that waits longer than this means a rank is gone: fail instead of hanging.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)


@dataclass(frozen=True)
class RunnerArgs:
    """What each rank needs to build its ModelRunner shard."""

    path: Path
    config: dict
    dtype: torch.dtype
    num_blocks: int
    block_size: int


def threads_per_rank(world: int) -> int:
    # more runnable threads than cores makes OpenMP's spinning threads wait on descheduled
    # ones: 10-20x slower (docs/server.md)
    return max(1, (os.cpu_count() or 1) // world)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, world: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=COLLECTIVE_TIMEOUT)


def _roles(rank: int, world: int, spp: int) -> tuple[TensorParallel, Stage]:
    if spp > 1:
        return SINGLE, Stage(rank, spp)
    return TensorParallel(rank, world, dist.group.WORLD), WHOLE


def _worker_main(rank: int, world: int, spp: int, port: int, args: RunnerArgs) -> None:
    from medha.engine.model_runner import ModelRunner

    torch.set_num_threads(threads_per_rank(world))
    _init(rank, world, port)
    tp, stage = _roles(rank, world, spp)
    runner = ModelRunner(args.path, args.config, torch.device("cpu"), args.dtype,
                         args.num_blocks, args.block_size, tp=tp, stage=stage)
    if spp > 1:
        stage_loop(runner, rank, spp, args.config["hidden_size"])
        dist.destroy_process_group()
        return
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            break
        runner.run(box[0])
    dist.destroy_process_group()


class WorkerGroup:
    """Starts ranks 1 .. world-1 and joins the process group as rank 0: `world` TP ranks,
    or with `spp` > 1 that many pipeline stages (one rank each)."""

    def __init__(self, world: int, args: RunnerArgs, spp: int = 1) -> None:
        self.world = world
        port = _free_port()
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=_worker_main, args=(rank, world, spp, port, args),
                                  name=f"medha-rank{rank}", daemon=True)
                      for rank in range(1, world)]
        for p in self.procs:
            p.start()
        torch.set_num_threads(threads_per_rank(world))
        _init(0, world, port)
        self.tp, self.stage = _roles(0, world, spp)
        self.pipeline = StagePipeline(spp, args.config["hidden_size"], args.dtype) \
            if spp > 1 else None

    def broadcast(self, step) -> None:
        dist.broadcast_object_list([step], src=0)

    def close(self) -> None:
        if not dist.is_initialized():
            return
        try:
            if all(p.is_alive() for p in self.procs):
                if self.pipeline is not None:
                    self.pipeline.close()
                else:
                    self.broadcast(None)
        except RuntimeError:
            pass  # a rank went away meanwhile: there is no one left to tell
        finally:
            for p in self.procs:
                p.join(10)
                if p.is_alive():
                    p.kill()
            dist.destroy_process_group()
