"""Tensor parallelism's processes: rank 0 (the user's process) starts ranks 1..N-1, each runs the worker loop.

Launch (docs/design-tensor-parallel.md, "Launch"): `start_workers` spawns the workers with torch.multiprocessing
(spawn: no inherited CUDA or thread state; as with any spawn, a script that builds the engine at import time must do
so under `if __name__ == "__main__":`), as daemon processes, and joins them as rank 0 in a group meeting on
127.0.0.1 at a free port (distributed/group.py). Each worker builds the same `LLMEngine` with its rank's part of the
model, its KV heads' cache and its backend, then runs `serve_plans`: receive a step plan, run that forward pass,
until the stop plan (engine/tp_plan.py).

Under torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT in the environment: `torchrun_env`)
nothing is spawned: every process runs the command, rank 0's engine joins the others at MASTER_ADDR:MASTER_PORT
(`join_torchrun`), and the commands that support it (`generate`, `serve`) hand ranks > 0 to `serve_if_worker`, the
same worker loop. Rank r runs on cuda:LOCAL_RANK; several hosts (`torchrun --nnodes`) are the same code.

Failure and shutdown:
  * a worker that dies: rank 0 checks the workers' exit codes before each plan (`TPWorkers.check_alive`; the
    server's engine loop also asks while idle), and a collective in flight fails as the dead peer's connection closes
    (or after the group's timeout); either way rank 0 raises `WorkerDied`, naming the rank and its exit code, and
    never hangs. Under torchrun rank 0 sees no process of the others: the collective's error is what it raises, and
    torchrun's agent ends the other ranks when one fails;
  * rank 0 that dies: the worker's wait for the next plan fails on the closed connection, and a watch thread ends a
    spawned worker whose parent process is gone (no orphans even when rank 0 is killed);
  * `TPWorkers.close` sends the stop plan when the group is healthy, joins with a timeout, then terminates and
    kills what is left; it also runs when the engine is garbage-collected, and multiprocessing ends daemon workers at
    interpreter exit.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
import weakref
from dataclasses import dataclass
from typing import NoReturn

import torch

from ..distributed.group import TPGroup, free_port

logger = logging.getLogger("longreach")

JOIN_TIMEOUT_S = 10.0  # how long `close` waits for a worker to leave on its own before terminating it


class WorkerDied(RuntimeError):
    """A tensor-parallel worker process exited while the engine needed it: the engine cannot go on."""


class TPWorkers:
    """Rank 0's handle on ranks 1..N-1: their processes when rank 0 spawned them, none under torchrun (its agent
    owns them; the stop plan still ends their loops)."""

    def __init__(self, processes: list):
        self.processes = processes
        self._finalizer = weakref.finalize(self, _end_processes, list(processes), 0.0)

    def failure(self, wait_s: float = 0.0) -> WorkerDied | None:
        """A `WorkerDied` naming the first worker that has exited, or None while all run. `wait_s`: wait up to that
        long for one to exit (after a collective failed: its socket closes before its exit code can be read)."""
        from multiprocessing.connection import wait

        if wait_s > 0 and self.processes and all(p.exitcode is None for p in self.processes):
            wait([p.sentinel for p in self.processes], timeout=wait_s)
        for rank, p in enumerate(self.processes, start=1):
            code = p.exitcode
            if code is not None:
                how = f"exit code {code}"
                if code < 0 and -code in signal.valid_signals():
                    how += f", killed by {signal.Signals(-code).name}"
                return WorkerDied(f"tensor-parallel rank {rank} (pid {p.pid}) died ({how}): the engine cannot run "
                                  "further steps; close it and start a new one")
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
        if self.processes:
            logger.info("tensor parallelism: workers ended (exit codes %s)", [p.exitcode for p in self.processes])


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


def rank_device(device: torch.device, index: int) -> torch.device:
    """A rank's device: cuda:`index` on CUDA (its rank, or torchrun's LOCAL_RANK: TPGroup.gpu_index), the CPU
    otherwise."""
    return torch.device("cuda", index) if device.type == "cuda" else device


def _watch_parent(parent: int) -> None:
    while True:
        if os.getppid() != parent:  # rank 0 is gone (killed): leave at once, no orphan
            os._exit(1)
        time.sleep(1.0)


def worker_main(rank: int, world_size: int, port: int, config, engine_cls) -> None:
    """A worker process: join the group, build this rank's engine, run its plans until the stop plan."""
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True, name="parent-watch").start()
    # Ctrl-C in a terminal reaches the whole process group: rank 0 drains (the server) and then stops the workers
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.getLogger("longreach").setLevel(logging.ERROR)  # rank 0 logs the engine; a worker only its errors
    from .devices import resolve_device

    device = rank_device(resolve_device(config.device), rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = TPGroup.connect(rank, world_size, port, device)
    serve_plans(engine_cls(config, tp=group))
    _leave(0)


def _leave(status: int) -> NoReturn:
    """End a worker process after its loop: without the interpreter's teardown, whose process-group destructors raced
    rank 0's closing of the store and sometimes aborted the worker (exit code -6, SIGABRT: seen in 1 of 4 runs of
    tests/test_tensor_parallel.py's shutdown test on a loaded 2-core CPU). Nothing is left to flush but the logs."""
    logging.shutdown()
    os._exit(status)


# ---- torchrun ------------------------------------------------------------------------------------------------------
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class TorchrunEnv:
    """What torchrun tells each process it starts (its environment variables)."""

    rank: int
    world_size: int
    local_rank: int  # the process's index on its host: its GPU
    master_addr: str
    master_port: int
    agent_store: bool  # torchrun's agent hosts the store at MASTER_ADDR:MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE)

    def connect(self, device: torch.device) -> TPGroup:
        return TPGroup.connect(self.rank, self.world_size, self.master_port, device, self.master_addr,
                               self.agent_store, self.local_rank)


def torchrun_env(tensor_parallel_size: int) -> TorchrunEnv | None:
    """The launch torchrun describes in the environment, None when there is none (no RANK / WORLD_SIZE). ValueError
    when a variable is missing or not a number, or when WORLD_SIZE differs from `tensor_parallel_size`: each
    process torchrun starts is one tensor-parallel rank."""
    env = os.environ
    if "RANK" not in env and "WORLD_SIZE" not in env:
        return None
    missing = [name for name in TORCHRUN_VARS if not env.get(name)]
    if missing:
        raise ValueError(f"launched by torchrun (RANK / WORLD_SIZE are set) but {', '.join(missing)} "
                         f"{'is' if len(missing) == 1 else 'are'} not: tensor parallelism under torchrun needs "
                         f"{', '.join(TORCHRUN_VARS)}")
    try:
        rank, world, local, port = (int(env[name]) for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"))
    except ValueError:
        raise ValueError("RANK, WORLD_SIZE, LOCAL_RANK and MASTER_PORT must be integers, got "
                         + ", ".join(f"{n}={env[n]!r}" for n in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"))
                         ) from None
    if world != tensor_parallel_size:
        raise ValueError(f"torchrun started {world} processes (WORLD_SIZE={world}) and --tensor-parallel-size is "
                         f"{tensor_parallel_size}: they must be equal, one tensor-parallel rank per process; pass "
                         f"--tensor-parallel-size {world}, or start {tensor_parallel_size} processes")
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank} is outside [0, WORLD_SIZE={world})")
    return TorchrunEnv(rank, world, local, env["MASTER_ADDR"], port,
                       env.get("TORCHELASTIC_USE_AGENT_STORE") == "True")


def _torchrun_device(device: torch.device, launch: TorchrunEnv) -> torch.device:
    device = rank_device(device, launch.local_rank)
    if device.type == "cuda":  # untested here: no GPU in CI (docs/design-tensor-parallel.md)
        if launch.local_rank >= torch.cuda.device_count():
            raise ValueError(f"rank {launch.rank} has LOCAL_RANK={launch.local_rank} (it runs on "
                             f"cuda:{launch.local_rank}) but this host sees {torch.cuda.device_count()} GPUs: start "
                             "at most that many processes per node (--nproc-per-node)")
        torch.cuda.set_device(device)
    return device


def join_torchrun(launch: TorchrunEnv, device: torch.device) -> tuple[TPWorkers, TPGroup]:
    """Rank 0 of a torchrun launch: join the ranks torchrun started (no process of ours to spawn or watch)."""
    if launch.rank != 0:
        raise ValueError(f"under torchrun, rank {launch.rank} runs the worker loop, not an engine of its own: "
                         "`longreach generate` and `longreach serve` do that; a script calls "
                         "longreach.engine.tp_workers.serve_if_worker(config, LLMEngine) before building the engine")
    t0 = time.perf_counter()
    group = launch.connect(_torchrun_device(device, launch))
    logger.info("tensor parallelism: %d ranks (%s, launched by torchrun, meeting at %s:%d) connected in %.1f s",
                launch.world_size, "NCCL" if device.type == "cuda" else "gloo", launch.master_addr,
                launch.master_port, time.perf_counter() - t0)
    return TPWorkers([]), group


def serve_if_worker(config, engine_cls) -> None:
    """Under torchrun, on ranks > 0: build this rank's `engine_cls(config, tp=its group)` (LLMEngine, passed in: it
    imports this module), run rank 0's plans until it stops, and end the process (status 0 on the stop plan, 1 when
    rank 0 is gone); it does not return. Returns at once elsewhere (not under torchrun, or rank 0: it runs the
    command). ValueError when torchrun's WORLD_SIZE is not `config.tensor_parallel_size`."""
    launch = torchrun_env(config.tensor_parallel_size)
    if launch is None or launch.rank == 0:
        return
    logging.getLogger("longreach").setLevel(logging.ERROR)  # rank 0 logs the engine; a worker only its errors
    # torchrun's agent signals every rank at once (SIGTERM on its own stop, SIGINT on Ctrl-C): rank 0 drains and then
    # sends the stop plan, which this rank must still be there to read (the agent kills it if it never comes)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    from .devices import resolve_device

    group = launch.connect(_torchrun_device(resolve_device(config.device), launch))
    engine = engine_cls(config, tp=group)
    status = 0
    try:
        serve_plans(engine)
    except Exception as e:  # noqa: BLE001 -- rank 0 is gone (its connection closed): nothing to serve any more
        logger.error("tensor-parallel rank %d: waiting for rank 0's next step failed (%s: %s); exiting",
                     launch.rank, type(e).__name__, e)
        status = 1
    _leave(status)


@torch.inference_mode()
def serve_plans(engine) -> None:
    """The worker loop: each plan of rank 0 becomes the same `ModelRunner.execute` on this rank's shard, through the
    engine's own runner (its decode and prefill-chunk graphs, captured at build as rank 0 captured its own) reading
    the mirrored block tables."""
    from .tp_plan import MirroredBlocks

    # the offloaded store drops the slots of freed pages (kvcache/build.py sets the same hook on rank 0's manager)
    blocks = MirroredBlocks(engine.blocks.num_blocks, engine.blocks.block_size, engine.blocks.on_free)
    runner = engine.runner
    runner.blocks = blocks
    while True:
        plan = engine.tp.broadcast_object()
        if plan is None:
            return
        runner.execute(blocks.apply(plan, engine.backend, runner.free_sequence), plan.all_logits)
