"""The tensor-parallel group one engine rank sees: its rank, the world size and the collectives the model needs.

`TPGroup.single()` is the group of a one-process engine: every collective returns its input untouched, so the
single-process path runs exactly the code it ran before tensor parallelism existed and pays nothing for it.

Process groups are built as objects over a TCP store (`torch.distributed.ProcessGroupGloo` / `ProcessGroupNCCL`), not
through `init_process_group`: nothing global is set, so one process may hold several engines (the tests hold a TP=1 and
two TP=2 engines at once). Two groups per engine:
  * `compute`: the model's all-reduces and the logits' gather (gloo on CPU, NCCL on CUDA), with a timeout
    (`COLLECTIVE_TIMEOUT_S`): a rank that stops answering mid-step makes the others raise, not hang;
  * `plans`: rank 0's step plans (gloo, on the CPU, so a plan never waits behind GPU work). Workers wait on it while
    the engine idles, for as long as it idles: its timeout is long, and a dead rank 0 is noticed by the closed
    connection (gloo raises at once) or by the worker's parent watch (engine/tp_workers.py).

The store is hosted by rank 0 on 127.0.0.1 when rank 0 spawned the others; under torchrun the ranks meet at its
MASTER_ADDR:MASTER_PORT, on the store its agent hosts there (every rank a client, our keys under a prefix).
"""
from __future__ import annotations

import datetime
import pickle
import socket
from dataclasses import dataclass
from typing import Any

import torch

COLLECTIVE_TIMEOUT_S = 300  # the longest one step's collective may wait for a peer (a long prefill chunk on a CPU)
PLAN_TIMEOUT_S = 30 * 24 * 3600  # how long a worker waits for the next plan: an idle server is not a failure
PLAN_INLINE = 16384  # bytes of one plan broadcast: a plan this size or smaller takes one round trip, not two


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the rendezvous of one engine's ranks)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class TPGroup:
    rank: int
    world_size: int
    compute: Any = None  # torch.distributed.ProcessGroup (None for world size 1)
    plans: Any = None  # the gloo group of the step plans
    store: Any = None  # the TCP store the groups rendezvoused on (rank 0 hosts it: kept alive with the group)
    local_rank: int | None = None  # the rank's GPU index on its host (torchrun's LOCAL_RANK); None: its rank

    @classmethod
    def single(cls) -> "TPGroup":
        return cls(0, 1)

    @classmethod
    def connect(cls, rank: int, world_size: int, port: int, device: torch.device, host: str = "127.0.0.1",
                agent_store: bool = False, local_rank: int | None = None) -> "TPGroup":
        """Join the group of `world_size` ranks meeting on `host`:`port`. Rank 0 hosts the store, unless
        `agent_store`: torchrun's agent hosts one there already (TORCHELASTIC_USE_AGENT_STORE), and every rank is its
        client, under a prefix of ours. Blocks until every rank has joined (or the store's timeout passes)."""
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        store = dist.TCPStore(host, port, world_size, rank == 0 and not agent_store, timeout=timeout)
        if agent_store:
            store = dist.PrefixStore("longreach", store)
        plans = dist.ProcessGroupGloo(dist.PrefixStore("plans", store), rank, world_size,
                                      datetime.timedelta(seconds=PLAN_TIMEOUT_S))
        if device.type == "cuda":  # untested here: no GPU in CI (docs/design-tensor-parallel.md)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            compute = dist.ProcessGroupNCCL(dist.PrefixStore("compute", store), rank, world_size, opts)
        else:
            compute = dist.ProcessGroupGloo(dist.PrefixStore("compute", store), rank, world_size, timeout)
        return cls(rank, world_size, compute, plans, store, local_rank)

    @property
    def gpu_index(self) -> int:
        """The CUDA device of this rank on its host: cuda:LOCAL_RANK under torchrun, cuda:rank when rank 0 spawned
        the others."""
        return self.rank if self.local_rank is None else self.local_rank

    @property
    def is_driver(self) -> bool:
        """Rank 0: it schedules, samples and sends the plans."""
        return self.rank == 0

    # ---- the model's collectives ---------------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place (row-parallel layers, the vocab-parallel embedding); x itself with one
        rank."""
        if self.world_size > 1:
            self.compute.allreduce([x]).wait()
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise maximum of `x` over the ranks, in place (fp8 weights: a row-parallel layer's scales span
        every rank's inputs); x itself with one rank."""
        if self.world_size > 1:
            import torch.distributed as dist

            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.MAX
            self.compute.allreduce([x], opts).wait()
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's `x` (..., n) along the last dim on rank 0 -> (..., world_size * n); None on the
        other ranks (the vocab-parallel LM head: only rank 0 samples)."""
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        opts = dist.GatherOptions()
        opts.rootRank = 0
        outs = [[torch.empty_like(x) for _ in range(self.world_size)]] if self.rank == 0 else []
        self.compute.gather(outs, [x], opts).wait()
        return torch.cat(outs[0], dim=-1) if self.rank == 0 else None

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (the KV page count every rank can hold)."""
        if self.world_size == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.plans.allreduce([t], opts).wait()  # a host integer: the CPU group, whatever the device
        return int(t.item())

    # ---- plans ---------------------------------------------------------------------------------------------------
    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0 sends `obj` (pickled), every other rank returns it. One broadcast of PLAN_INLINE bytes on the plan
        group (its length, then the pickle) when it fits, as a decode step's plan does; a longer one (a prefill's
        tokens, a new block table) follows in a second broadcast of its own size. Each broadcast is a round trip
        rank 0 waits for before the step's GPU work: two per step cost ~0.6 ms on a 2-core CPU, one ~0.4 ms
        (scripts/tp_plan_latency.py)."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        head = torch.zeros(PLAN_INLINE, dtype=torch.uint8)
        if self.rank == 0:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            head[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
            if len(data) <= PLAN_INLINE - 8:
                head[8:8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.plans.broadcast([head], opts).wait()
        size = int(head[:8].view(torch.int64).item())
        if size > PLAN_INLINE - 8:
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == 0 else \
                torch.empty(size, dtype=torch.uint8)
            self.plans.broadcast([buf], opts).wait()
        else:
            buf = head[8:8 + size]
        return obj if self.rank == 0 else pickle.loads(buf.numpy().tobytes())
