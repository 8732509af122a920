"""transfer/: page and slot bytes move bit-exactly whatever the buffers'
dtypes, a request's pushes after each chunk add up to exactly its page
range, and a real two-process gloo group carries a transfer (header,
per-layer payloads, END) into the registered pages, drops a cancelled one
and keeps the pair in step."""
from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from tandem.ports import free_port
from transfer.outbox import OutgoingTransfer, PeerLink
from transfer.pages import StoreBuffers
from transfer.protocol import TransferError, TransferSpec

PAGES, PAGE, SLOTS = 12, 4, 3


def _store(seed: int, *, zero: bool = False) -> StoreBuffers:
    """Two int8-format attention layers (codes + fp16 scales), an MTP pool and a GDN layer."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, dtype):
        if zero:
            return torch.zeros(*shape, dtype=dtype)
        if dtype.is_floating_point:
            return torch.randn(*shape, generator=g).to(dtype)
        return torch.randint(-128, 127, shape, generator=g).to(dtype)

    kv = {}
    for layer in (0, 2, 5):
        for side in ("k", "v"):
            kv[f"kv.{layer}.{side}_codes"] = rand(PAGES, PAGE, 2, 8, dtype=torch.int8)
            kv[f"kv.{layer}.{side}_scales"] = rand(PAGES, PAGE, 2, dtype=torch.float16)
    state = {"recurrent.1": rand(SLOTS, 2, 4, 4, dtype=torch.float32),
             "conv.1": rand(SLOTS, 6, 3, dtype=torch.float32)}
    return StoreBuffers(kv, state)


def test_layers_gather_and_scatter_bytes_exactly():
    src, dst = _store(1), _store(2, zero=True)
    assert [layer.name for layer in src.kv] == ["kv.0", "kv.2", "kv.5"]
    assert src.fingerprint() == dst.fingerprint()
    rows_src, rows_dst = src.rows([3, 7, 1]), dst.rows([0, 11, 5])
    for a, b in zip(src.kv, dst.kv):
        data = a.gather(rows_src)
        assert data.dtype == torch.uint8 and data.numel() == 3 * a.row_bytes
        b.scatter(rows_dst, data)
        for ta, tb in zip(a.tensors, b.tensors):
            assert torch.equal(ta[[3, 7, 1]].view(torch.uint8), tb[[0, 11, 5]].view(torch.uint8))
            assert not tb[[2, 3]].view(torch.uint8).any()  # nothing else written


def test_fingerprint_differs_for_another_layout():
    other = StoreBuffers({"kv.0.k": torch.zeros(PAGES, PAGE, 2, 8, dtype=torch.bfloat16)}, {})
    assert other.fingerprint() != _store(1).fingerprint()
    with pytest.raises(TransferError, match="lays out pages differently"):
        PeerLink(_store(1), [other])


def _chunk(out, end, last, layers=3):
    out.chunk_starts(end, last)
    for layer in range(layers):  # the forward's KV writes, pool by pool
        out.layer_written(layer)


def test_layer_pushes_cover_the_page_range_once():
    src, dst = _store(3), _store(4, zero=True)
    link = PeerLink(src, [dst])
    table = (9, 2, 4, 6, 8, 10)  # the request's pages in the prefill store; 22 tokens
    spec = TransferSpec(transfer_id=5, decode_worker=0, first_page=1, dest_pages=(0, 1, 3, 5, 7),
                        dest_state_slot=2, snapshot_slot=0, dest_snapshot_slot=1)
    # pool 2 is an MTP layer: the last position's pair comes after sampling
    out = OutgoingTransfer(spec, link, table, PAGE, num_tokens=22, target_layers=2)
    _chunk(out, 6, False)   # page 1 is not complete yet (tokens 4..7)
    assert link.bytes_sent == 0
    out.chunk_starts(13, False)
    out.layer_written(0)    # pool 0's pages 1, 2 leave before pool 1 is even written
    assert link.bytes_sent == 2 * src.kv[0].row_bytes
    out.layer_written(1)
    out.layer_written(2)
    assert link.bytes_sent == 2 * src.page_bytes()
    _chunk(out, 22, True)   # target pools: through the partial last page; MTP: up to page 5
    assert out.sent == [6, 6, 5]
    assert out.finish(live_slot=1) == 5
    for a, b in zip(src.kv, dst.kv):
        for ta, tb in zip(a.tensors, b.tensors):
            assert torch.equal(ta[list(table[1:])], tb[[0, 1, 3, 5, 7]])
    for a, b in zip(src.state, dst.state):
        for ta, tb in zip(a.tensors, b.tensors):
            assert torch.equal(ta[1], tb[2]) and torch.equal(ta[0], tb[1])


def test_a_transfer_must_name_every_page_it_sends():
    with pytest.raises(TransferError, match="destination pages"):
        OutgoingTransfer(TransferSpec(1, 0, 1, (0, 1)), PeerLink(_store(1), [_store(2)]),
                         (0, 1, 2, 3), PAGE, num_tokens=16)


# ------------------------------------------------------- a real gloo group


def _rank(rank: int, port: int, results) -> None:
    torch.set_num_threads(1)
    from transfer.group import GroupConfig, TransferGroup
    from transfer.inbox import Inbox
    from transfer.outbox import DistLink

    group = TransferGroup(GroupConfig(rank, 2, f"127.0.0.1:{port}", num_prefill=1, timeout_s=60),
                          torch.device("cpu"))
    group.start()
    group.wait_ready(60)
    if rank == 0:
        src = _store(7)
        link = DistLink(src, group)
        # a cancelled transfer first (its bytes must be drained), then a real one
        for tid, dest in ((11, (0, 1, 2)), (12, (4, 5, 6))):
            spec = TransferSpec(tid, 0, 0, dest, dest_state_slot=2)
            out = OutgoingTransfer(spec, link, (3, 7, 1), PAGE, num_tokens=10)
            _chunk(out, 8, False)
            _chunk(out, 10, True)
            out.finish(live_slot=0)
        results.put(("sent", link.bytes_sent))
        import time
        time.sleep(3)  # keep the group up while the receiver finishes
    else:
        dst = _store(8, zero=True)
        inbox = Inbox(group, dst, range(1))
        cancelled = inbox.register("req-a", 11, 0, (0, 1, 2), dest_state_slot=2)
        assert inbox.cancel("req-a") and cancelled.done.is_set()
        real = inbox.register("req-b", 12, 0, (4, 5, 6), dest_state_slot=2)
        inbox.start()
        assert real.done.wait(30), "transfer never finished"
        src = _store(7)
        same = all(torch.equal(ta[[3, 7, 1]], tb[[4, 5, 6]])
                   for a, b in zip(src.kv, dst.kv) for ta, tb in zip(a.tensors, b.tensors))
        state = all(torch.equal(ta[0], tb[2]) for a, b in zip(src.state, dst.state)
                    for ta, tb in zip(a.tensors, b.tensors))
        untouched = not any(t[[0, 1, 2]].view(torch.uint8).any() for layer in dst.kv
                            for t in layer.tensors)
        results.put(("received", (real.error, real.pages, same, state, untouched)))
        inbox.stop()
    group.close()


def test_gloo_group_carries_a_transfer_and_drains_a_cancelled_one():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, results)) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    got = dict(results.get(timeout=5) for _ in range(2))
    assert got["received"] == (None, 3, True, True, True)
    assert got["sent"] == 2 * (3 * _store(0).page_bytes() + _store(0).slot_bytes())
    assert all(p.exitcode == 0 for p in procs)
