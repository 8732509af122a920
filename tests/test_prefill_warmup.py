"""The prefill worker's warm-up (prefill/warmup.py) against a real store
process: it runs the chunk kinds a request's prefill runs on pages and slots
it takes from the store, and gives every one back, also when it fails."""
from __future__ import annotations

import pytest

from engine.kv.attention import paged_prefill_asked, paged_prefill_attention
from kvstore.client import StoreClient
from prefill import warmup
from tests.test_kvstore_process import StoreProcess, _conserved

PAGE = 32  # rk4p's default page


@pytest.fixture(scope="module", params=["int8", "rk4p"])
def store(request, tmp_path_factory):
    proc = StoreProcess(tmp_path_factory.mktemp(f"warmup-{request.param}"),
                        "--model", "tiny-qwen3.5", "--kv-format", request.param,
                        "--page-size", str(PAGE), "--max-context-tokens", "1024",
                        "--live-slots", "2", "--snapshot-slots", "2").wait_serving()
    yield proc
    assert proc.terminate() == 0


def _held(stats) -> tuple[int, int, int]:
    return stats.free_pages, stats.free_slots, stats.held_pages


def test_the_warm_up_runs_every_chunk_kind_and_gives_everything_back(store, monkeypatch):
    ran = []
    real = warmup.run_prefill

    def recording(model, cache, job, chunk, **kwargs):
        ran.append((job.start, len(job.tokens), job.restore_slot, job.snapshots,
                    paged_prefill_asked()))
        return real(model, cache, job, chunk, **kwargs)

    monkeypatch.setattr(warmup, "run_prefill", recording)
    with StoreClient.connect(store.socket, "warm-up") as client:
        before = client.stats()
        length = warmup.warm_up_length(client)
        # the pool holds 1024 tokens' pages: half of it, less four pages
        assert length == (client.info.num_pages // 2 - 4) * PAGE
        assert warmup.warm_up(client, chunk=64) > 0
        after = client.stats()
    _conserved(after)
    assert _held(after) == _held(before)
    assert [paged for *_, paged in ran] == [False] * 5 + [True]
    (start1, end1, restore1, snaps1), (start2, end2, restore2, snaps2), \
        (start3, end3, restore3, snaps3), (start4, end4, restore4, snaps4), \
        (start5, end5, restore5, snaps5), (start6, end6, restore6, snaps6) = \
        [entry[:4] for entry in ran]
    # job 1: chunks, then a one-token chunk after its snapshot; job 2 resumes
    # from that snapshot: 21 tokens, a snapshot a page in; job 3 resumes from
    # it: 33 tokens (its keys split), a snapshot after 32; jobs 4 and 5
    # resume from that one: 12 and 5 tokens, no snapshot inside
    assert (start1, end1, restore1) == (0, length + 1, -1)
    assert snaps1[0][0] == length and restore2 == snaps1[0][1]
    assert (start2, end2) == (length, length + PAGE + 5)
    assert snaps2[0][0] == length + PAGE and restore3 == snaps2[0][1]
    assert (start3, end3) == (length + PAGE, length + 3 * PAGE + 1)
    assert snaps3[0][0] == length + 3 * PAGE
    assert (start4, end4, snaps4) == (length + 3 * PAGE, length + 3 * PAGE + 12, ())
    assert (start5, end5, snaps5) == (length + 3 * PAGE, length + 3 * PAGE + 5, ())
    assert restore4 == restore5 == snaps3[0][1]
    # job 6: a whole chunk from there, its keys dequantized in the kernel (as
    # past the dense workspace), a snapshot at its last page boundary
    assert (start6, end6) == (length + 3 * PAGE, length + 3 * PAGE + 64)
    assert restore6 == snaps3[0][1] and snaps6[0][0] == length + 3 * PAGE + 32


@pytest.mark.parametrize("chunk, pool, expected", [
    (512, 100_000, (2144, 2656)),   # the whole chunk
    (512, 2400, (2144, 2272)),      # what the pool holds beside the first job, less 4 pages
    (512, 2288, None),              # 16 new tokens never take the dense workspace
    (16, 100_000, None),
])
def test_the_paged_chunk_job_fits_the_pool(chunk, pool, expected):
    assert warmup.paged_chunk_job(2048, 32, chunk, pool) == expected


def test_paged_prefill_attention_is_asked_inside_its_block_only():
    assert not paged_prefill_asked()
    with paged_prefill_attention():
        assert paged_prefill_asked()
    assert not paged_prefill_asked()


def test_a_failed_warm_up_gives_back_its_pages_and_slots(store, monkeypatch):
    def failing(*args, **kwargs):
        raise RuntimeError("CUDA error: out of memory (made up)")

    monkeypatch.setattr(warmup, "run_prefill", failing)
    with StoreClient.connect(store.socket, "warm-up") as client:
        before = client.stats()
        with pytest.raises(RuntimeError, match="made up"):
            warmup.warm_up(client, chunk=64)
        after = client.stats()
    _conserved(after)
    assert _held(after) == _held(before)
