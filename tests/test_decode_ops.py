"""The small kernels of a captured infinitehip decode step (issue 31), counted on a CPU: scripts/count_decode_ops.py
runs the emulated graph path with the Triton kernels forced on (Triton's interpreter), so the code is the GPU's, and
counts the torch ops inside the attention backend. On a GPU each is a kernel launch inside the decode graph (a few
microseconds each, whatever its size), so these bounds guard against the per-layer small ops coming back: the
aranges, fills, casts, row gathers and where/cat chains that were ~24 per layer in every step (now 3), and ~50 per
layer in a step that refreshes the last stage (now ~13). The selections must equal the eager decode step's, which
shares none of the graph decoder's code (its own stage cache, host-built query blocks, box tables gathered per
layer)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="counts the CPU interpreter's path")


def _trimmed(picked):
    """(layer, [the listed blocks of each row and group]) per attended layer: the eager index is as wide as the
    widest selection, the graph's as wide as the layer's index width, both -1 padded."""
    return [(layer, [[b[:int(c)].tolist() for b, c in zip(rb, rc)] for rb, rc in zip(blocks, counts)])
            for layer, blocks, counts in picked]


def test_captured_decode_step_launches_few_small_ops():
    from count_decode_ops import count

    layers, steps = 4, 5  # refresh levels 0, 3, 3, 3, 2 with the script's refresh (16, 8, 4), not the default's
    graph = count(steps=steps, layers=layers)
    eager = count(steps=steps, layers=layers, graph=False)
    assert graph["tokens"] == eager["tokens"]
    assert _trimmed(graph["picked"]) == _trimmed(eager["picked"])
    assert graph["levels"] == [0, 3, 3, 3, 2]
    per_step = graph["per_step"]
    # level 3 (no stage refreshed; 12 of every 16 steps): the cached last stage gathered, its counts (2 ops), and
    # the query positions once per step; was 24 per layer
    assert all(n <= 3 * layers + 1 for n in per_step[1:4]), per_step
    # level 2 (the last stage refreshed): was 51 per layer
    assert per_step[4] <= 13 * layers, per_step
    # every layer launches its block-sparse attention and split-K combine, and nothing else at level 3; the box build
    # only in a step that completes a chunk (3k-box's window is longer than a chunk: infinitehip/boxes.py), none of
    # steps 1-3 here
    assert graph["kernels"][1:4] == [2 * layers] * 3
    assert all(not any(k.startswith("aten::" + op) for k in graph["by_level"][3])
               for op in ("to", "arange", "zeros", "ones", "cat", "pad", "where", "div"))


def test_default_schedule_never_keeps_its_every_step_stage():
    """The default 3k-box refreshes every (8, 4, 1) steps: its last stage is recomputed at every step by every row
    that selects, so the captured step keeps no cached copy of it (method.run_stages), two ops per layer fewer than
    a stage that may be kept, and gathers none (one op fewer), with the eager step's selections and tokens."""
    from count_decode_ops import count

    layers, steps = 4, 5  # refresh levels 0, 2, 2, 2, 1
    graph = count(steps=steps, layers=layers, refresh=(8, 4, 1))
    eager = count(steps=steps, layers=layers, graph=False, refresh=(8, 4, 1))
    assert graph["tokens"] == eager["tokens"]
    assert _trimmed(graph["picked"]) == _trimmed(eager["picked"])
    assert graph["levels"] == [0, 2, 2, 2, 1]
    # level 2 under (16, 8, 4) is <= 13 per layer (the test above); here the last stage's keep (gt, where) and the
    # gather of its cached copy are gone, its sub-chunk ids are one add, and the candidate end is made once per step
    # (sparse/graph.py), not per layer: 32 in all, 8 per layer; then the last stage's top-k writes the attention
    # index and its counts itself (`graph_last_direct`): no index_copy into the cache, no gather of it by slot, no
    # count of the index with one row: 16 in all, 4 per layer
    assert all(n <= 4 * layers for n in graph["per_step"][1:4]), graph["per_step"]
    level2 = graph["by_level"][2]
    assert level2["aten::where"] == 0 and level2["aten::index_copy_"] == 0, level2
    # level 0 (stage 0 rescored, every 8th step): 65 per layer when each layer made its own stage-0 candidates,
    # query rows, query rotation angles and candidate validity; the layers of a step now share them (one
    # BlockQueries per row and step, its `memo`): 33 per layer
    assert graph["per_step"][0] <= 34 * layers, graph["per_step"]
    assert level2["aten::index"] <= 3 * layers, level2  # 3 steps: per layer only the cached stage 1 it starts from


def test_a_prefill_chunks_attention_launches_few_ops_outside_its_selection_graph():
    """scripts/count_chunk_ops.py (issue 30): past the first chunk, a 256-token chunk's attention runs per layer one
    selection-graph replay, the box build and the block-sparse attention kernel, and a few torch ops around them
    (14 per layer in this 2-layer model when written, 10 averaged over the script's 4 layers: the static inputs'
    copies, the chunk's query blocks). A bound, so that host work per chunk and layer does not creep back in (on a
    GPU each is a launch from Python)."""
    from count_chunk_ops import count

    r = count(context=512, chunk=256, layers=2)
    assert len(r["chunks"]) == 1 and r["replays"] >= 2  # every layer of the chunk replayed its selection
    eager, launches, inside = r["chunks"][0]
    assert eager <= 16 * 2 and launches == 2 * 2 and inside > eager, r["chunks"]
    assert r["ops"]["triton::_bsa_kernel"] == 2 and r["ops"]["triton::_box_build_kernel"] == 2
