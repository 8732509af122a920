"""A GDN snapshot left inside a forward (SequenceInput.snapshot) holds the
state and conv window that a forward cut at that point leaves, and the rows
after it match: on the CPU's per-sequence path, and on CUDA through fla's
chunked rule (long parts), the fused steps (parts of 1..8 rows) and a batch
whose rows gather around the snapshot (two sequences)."""
import pytest
import torch

from engine.batch import ForwardBatch, SequenceInput
from engine.cache import CacheShape, PagedKVCache
from engine.kv import make_format
from engine.loader import load_model

PAGE = 16
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))]


def _setup(device):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    loaded = load_model("tiny-qwen3.5", device=device, dtype=dtype, seed=9)
    return loaded, PagedKVCache(loaded.config, CacheShape(64, PAGE, 8), device, make_format("int8"))


def _states(cache, slot):
    return [t[slot].float().clone() for t in (*cache.recurrent, *cache.conv)]


def _assert_states_close(ours, theirs, tol):
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("start, cut, end", [
    (0, 96, 100),     # a fresh prompt, its last partial page folded in
    (32, 144, 150),   # after a cached prefix: long part, then a short one
    (48, 52, 54)])    # both parts within the fused steps' 1..8 rows
def test_a_snapshot_inside_a_forward_is_the_state_at_its_point(device, start, cut, end):
    loaded, cache = _setup(device)
    ids = tuple((11 * i + 2) % 512 for i in range(end))
    pages = tuple(range(-(-end // PAGE)))
    tol = 1e-4 if device == "cpu" else 2e-2

    def run(seqs):
        return loaded.model(ForwardBatch.build(seqs, PAGE, device), cache)

    def prefix(slot):  # the cached prefix, if any, into `slot`
        if start:
            run([SequenceInput(ids[:start], 0, pages, slot)])

    # the oracle: two forwards cut at the snapshot point, the state copied between
    prefix(0)
    run([SequenceInput(ids[start:cut], start, pages, 0)])
    cut_state = _states(cache, 0)
    cut_logits = run([SequenceInput(ids[cut:], cut, pages, 0)])
    # the same rows in one forward, a second sequence beside it on other pages
    other = tuple(range(len(pages), 2 * len(pages)))
    prefix(1)
    folded = run([SequenceInput(ids[start:], start, pages, 1, snapshot=(cut, 2)),
                  SequenceInput(ids[:end - start], 0, other, 3)])
    _assert_states_close(_states(cache, 2), cut_state, tol)
    torch.testing.assert_close(folded[:1].float(), cut_logits.float(), rtol=tol, atol=tol)
    # alone in its forward: the rows are one range (no gather)
    prefix(4)
    alone = run([SequenceInput(ids[start:], start, pages, 4, snapshot=(cut, 5))])
    _assert_states_close(_states(cache, 5), cut_state, tol)
    torch.testing.assert_close(alone.float(), cut_logits.float(), rtol=tol, atol=tol)


def test_a_snapshot_must_lie_inside_the_forward():
    from engine.errors import InvalidRequestError

    for snapshot in ((16, 2), (48, 2), (32, -1)):
        with pytest.raises(InvalidRequestError, match="must lie inside"):
            SequenceInput(tuple(range(32)), 16, tuple(range(4)), 1, snapshot=snapshot)
    with pytest.raises(InvalidRequestError, match="not both"):
        SequenceInput((1, 2), 16, tuple(range(2)), 1, position_slots=(2, 3), snapshot=(17, 4))


def test_the_split_batches_are_those_the_parts_would_build():
    """SnapshotSplit's parts are cut from the forward's own tensors; they must
    hold what ForwardBatch.build of the same part sequences holds."""
    seqs = [SequenceInput(tuple(range(40)), 32, tuple(range(5)), 0, snapshot=(64, 4)),
            SequenceInput(tuple(range(7)), 0, tuple(range(5, 6)), 1),
            SequenceInput(tuple(range(20)), 16, tuple(range(6, 9)), 2, snapshot=(32, 5))]
    batch = ForwardBatch.build(seqs, PAGE, "cpu")
    split = batch.snapshot_split
    heads_tails = [s.split_at_snapshot() if s.snapshot else (s, None) for s in seqs]
    expected_before = ForwardBatch.build([h for h, _ in heads_tails], PAGE, "cpu")
    expected_after = ForwardBatch.build([t for _, t in heads_tails if t], PAGE, "cpu")
    for got, want in ((split.before, expected_before), (split.after, expected_after)):
        assert got.offsets == want.offsets and got.seqs == want.seqs
        for name in ("input_ids", "positions", "kv_slots", "state_slots"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        for name in ("q_offsets", "kv_lens"):
            assert torch.equal(getattr(got.attention, name), getattr(want.attention, name)), name
        width = want.attention.page_table.shape[1]
        assert torch.equal(got.attention.page_table[:, :width], want.attention.page_table)
        assert (got.attention.max_new_tokens, got.attention.max_kv_len) == \
            (want.attention.max_new_tokens, want.attention.max_kv_len)
        assert torch.equal(got.gdn.write, want.gdn.write)
        assert torch.equal(got.row_sequences, want.row_sequences)
    rows = torch.cat([batch.input_ids[split.rows_before], batch.input_ids[split.rows_after]])
    assert sorted(rows.tolist()) == sorted(batch.input_ids.tolist())
    assert split.from_slots.tolist() == [0, 2] and split.to_slots.tolist() == [4, 5]
