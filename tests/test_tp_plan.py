"""Rank 0's step plans (engine/tp_plan.py) on their own: a plan carries each block table's new entries only, and a
table that was replaced (its sequence freed and re-admitted) whole; the worker's mirror rebuilds rank 0's tables."""
from types import SimpleNamespace

from longreach.engine.scheduler import ScheduledBatch
from longreach.engine.tp_plan import MirroredBlocks, PlanSender


class _Blocks:
    """What PlanSender reads of a BlockManager: live tables that grow by appending; a freed one is dropped."""

    num_slots = None

    def __init__(self):
        self.tables = {}

    def table(self, sid):
        return self.tables.setdefault(sid, [])

    def owns(self, sid):
        return sid in self.tables


def _seq(sid, computed, tokens):
    return SimpleNamespace(seq_id=sid, num_computed=computed, num_tokens=len(tokens),
                           token_slice=lambda a, b: tokens[a:b])


class _Backend:
    def free_sequence(self, sid):
        pass


def test_plans_send_new_table_entries_and_replaced_tables_whole():
    blocks, sent = _Blocks(), []
    sender = PlanSender(SimpleNamespace(broadcast_object=sent.append), blocks)
    mirror = MirroredBlocks(num_blocks=64, block_size=4)
    tokens = list(range(40))

    def step(computed, n):
        sender.send(ScheduledBatch(is_prefill=computed == 0, seqs=[_seq(7, computed, tokens)], num_tokens=[n]), False)
        mirror.apply(sent[-1], _Backend())
        return sent[-1].seqs[0]

    blocks.table(7).extend([3, 4, 5])
    p = step(0, 12)
    assert (p.table_start, p.table_tail) == (0, [3, 4, 5])
    p = step(12, 1)  # no new page: nothing sent
    assert (p.table_start, p.table_tail) == (3, [])
    blocks.table(7).extend([9, 1])
    p = step(13, 1)
    assert (p.table_start, p.table_tail) == (3, [9, 1])
    assert mirror.table(7) == [3, 4, 5, 9, 1]
    blocks.tables[7] = [8]  # freed and re-admitted between two plans: a new list, sent whole
    p = step(0, 4)
    assert (p.table_start, p.table_tail) == (0, [8])
    assert mirror.table(7) == [8]


def _echo(rank, port, path):
    import torch

    from longreach.distributed.group import PLAN_INLINE, TPGroup

    g = TPGroup.connect(rank, 2, port, torch.device("cpu"))
    objs = [{"small": 1}, list(range(PLAN_INLINE)), None, "x" * (PLAN_INLINE - 30)]  # one fits, one does not, ...
    got = [g.broadcast_object(o if rank == 0 else None) for o in objs]
    if rank == 1:
        torch.save(got == objs, path)


def test_plan_broadcast_inline_and_long(tmp_path):
    """A plan that fits PLAN_INLINE goes in one broadcast, a longer one in a second: every rank gets each object."""
    import torch
    import torch.multiprocessing as mp

    from longreach.distributed.group import free_port

    path = str(tmp_path / "ok.pt")
    mp.spawn(_echo, args=(free_port(), path), nprocs=2)
    assert torch.load(path) is True
