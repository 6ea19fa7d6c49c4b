"""The other processes of a replica, driven by the engine's process (rank 0).

Rank 0 keeps the scheduler, the tokenizer and the sampler. Ranks form a tp x spp x kvp grid
(layout.py). Without pipeline stages rank 0 broadcasts each batch's tensors (a StepInput) and
all ranks run their shard of the forward pass, joined by all-reduces (TP) and by the merge of
partial attentions (KVP, kv_parallel.py). With stages, rank 0 sends each step to the other
stage-0 ranks and batches flow from stage to stage (pipeline.py). torch.distributed carries all
of it, over gloo on CPU: one runtime, and the metadata is ordered with the collectives of the
step by construction (a separate ZeroMQ channel would need its own ordering and failure
handling). The metadata of a step is a few kilobytes of tensors; pickling it costs well under a
millisecond.
"""

from __future__ import annotations

import datetime
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from medha.engine.parallel.kv_parallel import KvParallel
from medha.engine.parallel.layout import Layout
from medha.engine.parallel.pipeline import StagePipeline, stage_loop
from medha.engine.parallel.stage import Stage
from medha.engine.parallel.tensor_parallel import TensorParallel

# A collective that waits longer than this means a rank is gone: fail instead of hanging.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)


@dataclass(frozen=True)
class RunnerArgs:
    """What each rank needs to build its ModelRunner shard."""

    path: Path
    config: dict
    dtype: torch.dtype
    num_blocks: int  # of one KVP group
    block_size: int
    kernels: str = "torch"  # resolved: torch or vllm


def threads_per_rank(world: int) -> int:
    # more runnable threads than cores makes OpenMP's spinning threads wait on descheduled
    # ones: 10-20x slower (docs/server.md)
    return max(1, (os.cpu_count() or 1) // world)


def _init(rank: int, layout: Layout, rendezvous: str, num_blocks: int) -> dict:
    """Join the process group; returns this rank's roles as ModelRunner arguments."""
    dist.init_process_group(
        "gloo",
        init_method=f"file://{rendezvous}",
        rank=rank,
        world_size=layout.world,
        timeout=COLLECTIVE_TIMEOUT,
    )
    k, s, t = layout.coords(rank)
    tp_group, kvp_group = layout.groups(rank)
    return {
        "tp": TensorParallel(t, layout.tp, tp_group),
        "stage": Stage(s, layout.spp),
        "kvp": KvParallel(k, layout.kvp, kvp_group, num_blocks),
    }


def _worker_main(rank: int, layout: Layout, rendezvous: str, args: RunnerArgs) -> None:
    from medha.engine.model_runner import ModelRunner

    torch.set_num_threads(threads_per_rank(layout.world))
    roles = _init(rank, layout, rendezvous, args.num_blocks)
    runner = ModelRunner(
        args.path,
        args.config,
        torch.device("cpu"),
        args.dtype,
        args.num_blocks,
        args.block_size,
        kernels=args.kernels,
        **roles,
    )
    if layout.spp > 1:
        stage_loop(runner, rank, layout, args.config["hidden_size"])
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
    """Starts ranks 1 .. world-1 of `layout` and joins the process group as rank 0;
    `roles` are rank 0's ModelRunner arguments (tp, stage, kvp)."""

    def __init__(self, layout: Layout, args: RunnerArgs) -> None:
        self.world = layout.world
        # the ranks meet in a file of a directory only this group uses: a TCP port picked free
        # and bound later by rank 0 could be taken in between by anyone on the machine
        self._rendezvous_dir = tempfile.TemporaryDirectory(prefix="medha-ranks-")
        rendezvous = os.path.join(self._rendezvous_dir.name, "store")
        ctx = mp.get_context("spawn")
        self.procs = [
            ctx.Process(
                target=_worker_main,
                args=(rank, layout, rendezvous, args),
                name=f"medha-rank{rank}",
                daemon=True,
            )
            for rank in range(1, layout.world)
        ]
        for p in self.procs:
            p.start()
        torch.set_num_threads(threads_per_rank(layout.world))
        self.roles = _init(0, layout, rendezvous, args.num_blocks)
        self.pipeline = (
            StagePipeline(layout, args.config["hidden_size"], args.dtype)
            if layout.spp > 1
            else None
        )

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
            self._rendezvous_dir.cleanup()
