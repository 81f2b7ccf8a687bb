"""Graph decode's block tables on the device (engine/block_tables.py): a step writes only the page ids added since the
last, and the tokens stay those of an eager run while sequences finish, new ones take their slots, and the scheduler
preempts."""
import pytest
import torch

from longreach import SamplingParams
from longreach.engine.block_tables import DeviceBlockTables
from longreach.engine.llm import LLM

from conftest import make_tiny_hf_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, _ = make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "m", arch="llama", max_position_embeddings=512)
    return path


def test_rows_get_only_new_entries_and_a_new_table_is_written_whole():
    t = DeviceBlockTables(2, 8, scratch_page=99, device=torch.device("cpu"))
    a, b = [3, 4], [7]
    assert t.slots([0, 1], [a, b]) == [0, 1] and t.entries_written == 3
    assert t.slots([0, 1], [a, b]) == [0, 1] and t.entries_written == 3  # nothing new: nothing written
    a.append(5)
    t.slots([1, 0], [b, a])
    assert t.entries_written == 4  # the one new page
    assert t.rows[0].tolist() == [3, 4, 5] + [99] * 5 and t.rows[1].tolist() == [7] + [99] * 7
    assert t.rows[t.scratch_row].tolist() == [99] * 8
    # sequence 0 preempted: its pages freed, its next table a new list (shorter here): the row is rewritten whole
    t.slots([0], [[6]])
    assert t.rows[0].tolist() == [6] + [99] * 7 and t.entries_written == 5
    # a table changed in place (not how BlockManager works): its last entry no longer matches, rewritten whole
    b[0] = 2
    t.slots([1], [b])
    assert t.rows[1].tolist() == [2] + [99] * 7
    # released slots go to new sequences; with none free, one not in the step is taken
    t.release(0)
    assert t.slots([5], [[1, 2]]) == [0] and t.rows[0].tolist() == [1, 2] + [99] * 6
    assert t.slots([6], [[4]]) == [1]  # sequence 1 is not in this step: its slot is handed over
    assert t.slots([5, 1], [[1, 2], b]) == [0, 1]  # and sequence 1 comes back to the slot 6 is not using now
    assert t.rows[1].tolist() == [2] + [99] * 7


def _llm(path, eager, **kw):
    return LLM(path, device="cpu", dtype="float32", enforce_eager=eager, max_num_seqs=3, **kw)


@pytest.mark.parametrize("attention", ["dense", "infinitehip"])
def test_graph_decode_writes_only_new_pages_and_equals_eager_with_finishes_and_preemption(tiny, attention):
    """Five requests of different lengths and output budgets through three graph rows, on a KV cache too small for
    all of them (the scheduler preempts): each request's tokens equal the eager run's, and the device tables got
    each page id once per life of a sequence's table (a preempted sequence's again after its re-prefill)."""
    g = torch.Generator().manual_seed(11)
    lengths, budgets = [100, 40, 130, 20, 70], [60, 60, 40, 45, 50]
    prompts = [{"prompt_token_ids": torch.randint(3, 256, (n,), generator=g).tolist()} for n in lengths]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in budgets]
    kw = dict(kv_cache_memory_gb=560 * 512 / 2**30, max_model_len=256, block_size=8)  # ~320 slots: 3 rows preempt
    if attention == "infinitehip":
        kw.update(attention="infinitehip", attention_config='{"n_sink": 8, "n_window": 16, "block_q": 8, '
                  '"chunk_sizes": [32, 8, 2], "budgets": [64, 32, 8], "refresh": [6, 3, 2], "dense_below": 60}')
    expected = [o.token_ids for o in _llm(tiny, True, **kw).generate(prompts, params, use_tqdm=False)]
    llm = _llm(tiny, False, **kw)
    runner = llm.engine.runner
    runner.capture_graphs(emulate=True)
    tables = runner.device_tables
    lives: dict[tuple[int, int], int] = {}  # (seq_id, its table's list) -> most pages it held at a graph step
    keep, steps, replay = [], [], runner._replay

    def counted(batch):  # the pages each step's sequences hold as it starts (what it hands the device tables)
        held = {}
        for s in batch.seqs:
            table = runner.blocks.table(s.seq_id)
            keep.append(table)  # (its id stays unique)
            lives[s.seq_id, id(table)] = max(lives.get((s.seq_id, id(table)), 0), len(table))
            held[s.seq_id] = len(table)
        steps.append(held)
        return replay(batch)
    runner._replay = counted
    got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    assert llm.engine.scheduler.num_preemptions > 0 and len({sid for sid, _ in lives}) == len(prompts)
    assert len(lives) > len(prompts)  # some sequence decoded through graphs in two lives (before and after preemption)
    # every page id written once per life of a table: what the step-by-step writer of only new entries writes
    assert tables.entries_written == sum(lives.values())
    # against rebuilding every table every step, which wrote each step's whole tables
    assert tables.entries_written < sum(sum(held.values()) for held in steps) / 4
    assert not tables._slot  # every finished or preempted sequence gave its slot back
    llm.engine.blocks.check_integrity()
