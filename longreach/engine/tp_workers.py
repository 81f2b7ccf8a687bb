"""Tensor parallelism's processes: rank 0 (the user's process) starts ranks 1..N-1, each runs the worker loop.

Launch (docs/design-tensor-parallel.md, "Launch"): `start_workers` spawns the workers with torch.multiprocessing
(spawn: no inherited CUDA or thread state; as with any spawn, a script that builds the engine at import time must do
so under `if __name__ == "__main__":`), as daemon processes, and joins them as rank 0 in a group meeting on
127.0.0.1 at a free port (distributed/group.py). Each worker builds the same `LLMEngine` with its rank's part of the
model, its KV heads' cache and its backend, then runs `serve_plans`: receive a step plan, run that forward pass,
until the stop plan (engine/tp_plan.py).

Failure and shutdown:
  * a worker that dies: rank 0 checks the workers' exit codes before each plan (`TPWorkers.check_alive`), and a
    collective in flight fails as the dead peer's connection closes (or after the group's timeout); either way rank 0
    raises `WorkerDied`, naming the rank and its exit code, and never hangs;
  * rank 0 that dies: the worker's wait for the next plan fails on the closed connection, and a watch thread ends a
    worker whose parent process is gone (no orphans even when rank 0 is killed);
  * `TPWorkers.close` sends the stop plan when the group is healthy, joins with a timeout, then terminates and
    kills what is left; it also runs when the engine is garbage-collected, and multiprocessing ends daemon workers at
    interpreter exit.
"""
from __future__ import annotations

import logging
import os
import threading
import time
import weakref

import torch

from ..distributed.group import TPGroup, free_port

logger = logging.getLogger("longreach")

JOIN_TIMEOUT_S = 10.0  # how long `close` waits for a worker to leave on its own before terminating it


class WorkerDied(RuntimeError):
    """A tensor-parallel worker process exited while the engine needed it: the engine cannot go on."""


class TPWorkers:
    """Rank 0's handle on ranks 1..N-1 (their processes)."""

    def __init__(self, processes: list):
        self.processes = processes
        self._finalizer = weakref.finalize(self, _end_processes, list(processes), 0.0)

    def failure(self) -> WorkerDied | None:
        """A `WorkerDied` naming the first worker that has exited, or None while all run."""
        for rank, p in enumerate(self.processes, start=1):
            if p.exitcode is not None:
                return WorkerDied(f"tensor-parallel worker rank {rank} (pid {p.pid}) exited with code {p.exitcode}: "
                                  "the engine cannot run further steps; close it and start a new one")
        return None

    def check_alive(self) -> None:
        err = self.failure()
        if err is not None:
            raise err

    def close(self, stop=None) -> None:
        """End the workers: `stop()` (the stop plan) first when all are alive, then join, terminate, kill."""
        stopped = False
        if stop is not None and self.failure() is None:
            try:
                stop()
                stopped = True
            except Exception as e:  # noqa: BLE001 -- a broken group: the processes are ended below anyway
                logger.warning("tensor parallelism: the stop plan could not be sent (%s); terminating the workers", e)
        _end_processes(self.processes, JOIN_TIMEOUT_S if stopped else 0.0)  # not stopped: they will not leave
        self._finalizer.detach()


def _end_processes(processes: list, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for p in processes:
        p.join(max(deadline - time.monotonic(), 0.0))
    for p in processes:
        if p.is_alive():
            p.terminate()
            p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join()


def start_workers(config, device: torch.device, engine_cls) -> tuple[TPWorkers, TPGroup]:
    """Spawn ranks 1..N-1 of `config.tensor_parallel_size`, each building an `engine_cls(config, tp=its group)`
    (LLMEngine, passed in: it imports this module), and connect to them as rank 0 on `device`."""
    import torch.multiprocessing as mp

    n = config.tensor_parallel_size
    if device.type == "cuda" and torch.cuda.device_count() < n:
        raise ValueError(f"tensor_parallel_size={n} needs {n} GPUs (rank r on cuda:r); {torch.cuda.device_count()} "
                         "are visible")
    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker_main, args=(rank, n, port, config, engine_cls), name=f"longreach-tp{rank}",
                         daemon=True) for rank in range(1, n)]
    for p in procs:
        p.start()
    workers = TPWorkers(procs)
    t0 = time.perf_counter()
    try:
        group = TPGroup.connect(0, n, port, device)
    except BaseException:
        workers.close()
        raise
    logger.info("tensor parallelism: %d ranks (%s, workers pids %s) connected in %.1f s", n,
                "NCCL" if device.type == "cuda" else "gloo", [p.pid for p in procs], time.perf_counter() - t0)
    return workers, group


def rank_device(device: torch.device, rank: int) -> torch.device:
    """The device of `rank`: cuda:rank on CUDA, the CPU otherwise."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def _watch_parent(parent: int) -> None:
    while True:
        if os.getppid() != parent:  # rank 0 is gone (killed): leave at once, no orphan
            os._exit(1)
        time.sleep(1.0)


def worker_main(rank: int, world_size: int, port: int, config, engine_cls) -> None:
    """A worker process: join the group, build this rank's engine, run its plans until the stop plan."""
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True, name="parent-watch").start()
    logging.getLogger("longreach").setLevel(logging.ERROR)  # rank 0 logs the engine; a worker only its errors
    from .devices import resolve_device

    device = rank_device(resolve_device(config.device), rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = TPGroup.connect(rank, world_size, port, device)
    engine = engine_cls(config, tp=group)
    serve_plans(engine)
    # the stop plan: leave without the interpreter's teardown, whose process-group destructors raced rank 0's closing
    # of the store and sometimes aborted the worker (exit code -6, SIGABRT: seen in 1 of 4 runs of
    # tests/test_tensor_parallel.py's shutdown test on a loaded 2-core CPU). Nothing is left to flush but the logs.
    logging.shutdown()
    os._exit(0)


@torch.inference_mode()
def serve_plans(engine) -> None:
    """The worker loop: each plan of rank 0 becomes the same `ModelRunner.execute` on this rank's shard."""
    from .model_runner import ModelRunner
    from .tp_plan import MirroredBlocks

    # the offloaded store drops the slots of freed pages (kvcache/build.py sets the same hook on rank 0's manager)
    blocks = MirroredBlocks(engine.blocks.num_blocks, engine.blocks.block_size, engine.blocks.on_free)
    runner = ModelRunner(engine.model, engine.config, engine.kv_cache, blocks, engine.backend, engine.device)
    while True:
        plan = engine.tp.broadcast_object()
        if plan is None:
            return
        runner.execute(blocks.apply(plan, engine.backend), plan.all_logits)
