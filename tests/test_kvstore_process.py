"""The KV store as a real process: real gRPC over a unix socket, worker
processes that map its shared memory, and the failure paths (a worker killed
while holding pages and a lock, bad requests, an over-budget start, SIGTERM).

Workers are spawned processes running the functions at the bottom of this
file; they report through files and events, never through the store."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch

from engine.batch import ForwardBatch, SequenceInput
from engine.cache import CacheShape, PagedKVCache
from kvstore.arena import SHM_DIR
from kvstore.client import StoreCapacityError, StoreClient, StoreError, wait_for_store
from tandem.internal.v1 import kvstore_pb2 as pb
from tandem.internal.v1 import kvstore_pb2_grpc as pb_grpc
from tandem.wire import pack_token_ids

ROOT = Path(__file__).resolve().parents[1]
SPAWN = mp.get_context("spawn")
PAGE = 4
PROMPT = [(7 * i + 3) % 512 for i in range(22)]  # 5 whole pages + 2 tokens
TURN = [(11 * i + 5) % 512 for i in range(6)]    # the next turn's new tokens


# ------------------------------------------------------------------ helpers


class StoreProcess:
    """`python -m kvstore.server` in a subprocess, health-gated."""

    def __init__(self, directory: Path, *flags: str, device: str = "cpu"):
        self.socket = str(directory / "kv.sock")
        self.stderr_path = directory / "store.err"
        with open(directory / "store.out", "w") as out, open(self.stderr_path, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvstore.server", "--socket", self.socket,
                 "--device", device, *flags], cwd=ROOT, stdout=out, stderr=err)

    def wait_serving(self, timeout: float = 60.0) -> "StoreProcess":
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(f"unix:{self.socket}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                assert self.proc.poll() is None, f"store exited: {self.stderr()}"
                try:
                    if stub.Check(health_pb2.HealthCheckRequest(), timeout=0.5).status == \
                            health_pb2.HealthCheckResponse.SERVING:
                        return self
                except grpc.RpcError:
                    time.sleep(0.05)
        raise AssertionError(f"store not serving after {timeout} s: {self.stderr()}")

    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def shm_files(self) -> list[Path]:
        return sorted(SHM_DIR.glob(f"tandem-{self.proc.pid}-*"))

    def terminate(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=20)


def _conserved(stats) -> None:
    assert stats.free_pages + stats.held_pages + stats.cached_pages == stats.total_pages
    assert stats.free_slots + stats.held_slots + stats.snapshots == stats.total_slots


def _spawn(target, *args):
    proc = SPAWN.Process(target=target, args=args, daemon=True)
    proc.start()
    return proc


def _join(proc, timeout=60.0) -> None:
    proc.join(timeout)
    assert proc.exitcode == 0, f"worker {proc.name} exited with {proc.exitcode}"


@pytest.fixture(scope="module")
def hybrid_store(tmp_path_factory):
    """tiny-qwen3.5 with rk4 pages: 64 pages of 4 tokens, 4 + 4 GDN slots."""
    store = StoreProcess(tmp_path_factory.mktemp("hybrid-store"), "--model", "tiny-qwen3.5",
                         "--kv-format", "rk4", "--page-size", str(PAGE),
                         "--max-context-tokens", "256", "--live-slots", "4",
                         "--snapshot-slots", "4").wait_serving()
    yield store
    assert store.terminate() == 0
    assert store.shm_files() == []


@pytest.fixture
def client(hybrid_store):
    with StoreClient.connect(hybrid_store.socket, "test", map_memory=False) as c:
        yield c


# -------------------------------------------------------------------- tests


def test_a_prefix_written_by_one_worker_is_decoded_by_another(hybrid_store, tmp_path):
    inserted = SPAWN.Event()
    writer = _spawn(_write_prefix, hybrid_store.socket, PROMPT, inserted)
    reader = _spawn(_decode_after_prefix, hybrid_store.socket, PROMPT + TURN, inserted,
                    str(tmp_path / "decoded.pt"))
    # Meanwhile the oracle: the whole sequence in one forward, in this process,
    # on the same shared weights and a private rk4 cache.
    with StoreClient.connect(hybrid_store.socket, "oracle") as oracle:
        full = PROMPT + TURN
        cache = PagedKVCache(oracle.info.config, CacheShape(16, PAGE, 1), "cpu",
                             oracle.info.kv_format.build())
        seq = SequenceInput(tuple(full), 0, tuple(range(16)), 0)
        expected = oracle.model(ForwardBatch.build([seq], PAGE, "cpu"), cache, all_logits=True)
    _join(writer)
    _join(reader)
    got = torch.load(tmp_path / "decoded.pt")
    hit = got["hit_tokens"]
    assert hit == 20  # 5 whole pages and their GDN snapshot
    torch.testing.assert_close(got["logits"], expected[hit:], rtol=1e-4, atol=1e-4)
    with StoreClient.connect(hybrid_store.socket, "check", map_memory=False) as c:
        stats = c.stats()
    assert stats.held_pages == 0 and stats.locked_pages == 0 and stats.cached_pages >= 5
    _conserved(stats)


def test_a_killed_worker_leaves_the_store_consistent(hybrid_store, client, tmp_path):
    baseline = client.stats()
    holding = SPAWN.Event()
    victim = _spawn(_hold_and_hang, hybrid_store.socket, holding)
    assert holding.wait(60), "the victim never got its pages"
    during = client.stats()
    assert during.sessions == baseline.sessions + 1
    assert during.held_pages > 0 and during.held_slots > 0 and during.locked_pages > 0

    os.kill(victim.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    while True:
        now = client.stats()
        if now.sessions == baseline.sessions:
            break
        assert time.monotonic() - killed_at < 5.0, f"session not released: {now}"
        time.sleep(0.01)
    released_in = time.monotonic() - killed_at
    victim.join(5)
    assert released_in < 1.0
    assert (now.held_pages, now.held_slots, now.locked_pages) == (0, 0, baseline.locked_pages)
    assert now.free_pages + now.evictable_pages >= baseline.free_pages + baseline.evictable_pages
    _conserved(now)

    # everything can be had again (evicting the unlocked cache), then given back
    everything = client.allocate(pages=now.total_pages, slots=now.total_slots)
    assert len(everything.pages) == now.total_pages and len(everything.slots) == now.total_slots
    client.release(everything.pages, everything.slots)
    after = client.stats()
    assert after.free_pages == after.total_pages and after.free_slots == after.total_slots


def test_bad_requests_get_their_status_and_change_nothing(hybrid_store, client):
    def code_of(call) -> str:
        with pytest.raises(StoreError) as e:
            call()
        return e.value.code

    mine = client.allocate(pages=2, slots=1)
    before = client.stats()
    free_page = next(p for p in range(before.total_pages) if p not in mine.pages)
    assert code_of(lambda: client.release(pages=[10_000])) == "INVALID_ARGUMENT"
    assert code_of(lambda: client.release(pages=[-1])) == "INVALID_ARGUMENT"
    assert code_of(lambda: client.release(pages=[free_page])) == "FAILED_PRECONDITION"
    assert code_of(lambda: client.allocate(pages=-3)) == "INVALID_ARGUMENT"
    assert code_of(lambda: client.insert(list(range(8)), mine.pages[:1])) == "INVALID_ARGUMENT"
    assert code_of(lambda: client.insert(list(range(8)), [mine.pages[0], free_page])) \
        == "FAILED_PRECONDITION"
    assert code_of(lambda: client.insert(list(range(8)), mine.pages, snapshot_slot=99)) \
        == "INVALID_ARGUMENT"
    assert code_of(lambda: client.match([1_000_000])) == "INVALID_ARGUMENT"
    with pytest.raises(StoreError, match=r"^INVALID_ARGUMENT: token id 1000000 is outside the "
                                         r"vocabulary \[0, "):  # checked vectorized, same words
        client.match(pack_token_ids([3, 1_000_000]))
    assert code_of(lambda: client.match([-1])) == "INVALID_ARGUMENT"  # refused before sending
    assert code_of(lambda: client.unlock([123])) == "FAILED_PRECONDITION"
    assert code_of(lambda: client.lock([987_654])) == "INVALID_ARGUMENT"
    with pytest.raises(StoreCapacityError) as e:
        client.allocate(pages=before.total_pages, slots=0)  # 2 are ours
    assert e.value.code == "RESOURCE_EXHAUSTED" and "release" in e.value.details
    # a request from no session at all, straight on the wire
    with grpc.insecure_channel(f"unix:{hybrid_store.socket}") as channel:
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.KVStoreStub(channel).Allocate(
                pb.AllocateRequest(session_id="not-a-session", num_pages=1), timeout=5)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "Attach" in e.value.details()
    # packed token ids that are not whole 4-byte ids, straight on the wire
    with grpc.insecure_channel(f"unix:{hybrid_store.socket}") as channel:
        stub = pb_grpc.KVStoreStub(channel)
        for call, request in ((stub.Match, pb.MatchRequest(session_id=client.session_id,
                                                            tokens_le32=b"\x01\x00\x00\x00\x02")),
                              (stub.Insert, pb.InsertRequest(session_id=client.session_id,
                                                             tokens_le32=b"\x00" * 18,
                                                             pages=mine.pages[:1]))):
            with pytest.raises(grpc.RpcError) as e:
                call(request, timeout=5)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert e.value.details().startswith("tokens_le32: ")
            assert "is not a whole number of token ids: pack each id as a 4-byte little-endian" \
                in e.value.details()

    after = client.stats()
    assert (after.free_pages, after.held_pages, after.free_slots, after.held_slots) == \
        (before.free_pages, before.held_pages, before.free_slots, before.held_slots)
    _conserved(after)
    client.release(mine.pages, mine.slots)  # and it still serves


def test_over_budget_start_refuses_with_the_plan(tmp_path):
    # The Qwen3.5-27B shape: the plan is made from the config alone, so no
    # 54 GB of dummy weights are ever created.
    store = StoreProcess(tmp_path, "--model", "qwen3.5-27b", "--kv-format", "rk4",
                         "--max-context-tokens", "262144", "--gpu-memory-budget", "24GiB")
    assert store.proc.wait(timeout=60) == 2
    err = store.stderr()
    assert "capacity plan" in err and "kv pages" in err and "budget" in err
    assert "over budget: weights" in err and "does not fit" in err
    assert store.shm_files() == [] and not os.path.exists(store.socket)


def test_dense_store_serves_then_stops_cleanly_on_sigterm(tmp_path):
    store = StoreProcess(tmp_path, "--model", "tiny-llama", "--kv-format", "int8",
                         "--page-size", "8", "--max-context-tokens", "128",
                         "--prefill-chunk-tokens", "64").wait_serving()
    # a prefill worker asking for larger chunks than the store's plan sized
    # activations for is refused at start, naming both flags
    worker = subprocess.run(
        [sys.executable, "-m", "prefill.server", "--store", store.socket, "--socket",
         str(tmp_path / "prefill.sock"), "--device", "cpu", "--chunk", "128"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert worker.returncode == 2, worker.stderr
    assert "--chunk 128 is larger than the 64-token prefill chunk" in worker.stderr
    assert "--prefill-chunk-tokens 128" in worker.stderr
    files = store.shm_files()
    # a CPU store keeps its token table with the other weights: the host arena is empty
    assert [f.name.rsplit("-", 1)[1] for f in files] == ["host", "kv", "state", "weights"]
    with StoreClient.connect(store.socket, "dense") as c:
        assert c.info.num_state_slots == 0 and c.cache.recurrent == []
        assert c.info.prefill_chunk_tokens == 64  # what prefill workers run by default
        with pytest.raises(StoreError, match="no GDN layers"):
            c.allocate(pages=1, slots=1)
        got = c.allocate(pages=2)
        tokens = tuple(range(1, 12))
        logits = c.model(ForwardBatch.build([SequenceInput(tokens, 0, got.pages)], 8, "cpu"),
                         c.cache)
        assert logits.shape == (1, 512) and torch.isfinite(logits).all()
        assert c.arenas.kv.tensor("kv.0.k_codes").abs().sum() > 0  # written in place
    assert store.terminate() == 0
    assert store.shm_files() == [] and not os.path.exists(store.socket)
    assert "shared memory unlinked" in store.stderr()


def test_files_of_a_killed_store_are_swept_by_the_next_store(tmp_path):
    dense = ("--model", "tiny-llama", "--kv-format", "int8", "--page-size", "8",
             "--max-context-tokens", "64")
    (tmp_path / "a").mkdir()
    killed = StoreProcess(tmp_path / "a", *dense).wait_serving()
    orphans = killed.shm_files()
    assert orphans
    killed.proc.kill()  # SIGKILL: no chance to unlink
    killed.proc.wait(timeout=20)
    assert all(f.exists() for f in orphans)
    (tmp_path / "b").mkdir()
    successor = StoreProcess(tmp_path / "b", *dense).wait_serving()
    try:
        assert not any(f.exists() for f in orphans)
        assert successor.shm_files()  # its own files are untouched
        assert "left by a store that was killed" in successor.stderr()
    finally:
        assert successor.terminate() == 0
    assert successor.shm_files() == []


def test_real_weights_are_shared_not_copied(tmp_path):
    """The embedded SmolLM2: a worker's parameters are views of the store's
    file; a byte written through this process's mapping is seen by the worker;
    the worker's logits equal a model loaded here the ordinary way."""
    from engine.loader import load_model

    store = StoreProcess(tmp_path, "--kv-format", "bf16", "--page-size", "16",
                         "--max-context-tokens", "256")
    name = "model.norm.weight"
    asked, answered, results = SPAWN.Event(), SPAWN.Event(), SPAWN.Queue()
    # The worker starts and the reference loads while the store loads.
    worker = _spawn(_report_weights, store.socket, name, asked, answered, results)
    reference = load_model(progress=False)
    store.wait_serving(timeout=120)
    try:
        with StoreClient.connect(store.socket, "poker") as c:
            assert all(c.arenas.weights.contains(p) for p in c.model.parameters())
            logits, zero_copy = results.get(timeout=60)
            logits = torch.tensor([logits], dtype=torch.float32)
            view = c.arenas.weights.tensor(name).view(torch.uint8)
            old = view[0].item()
            view[0] = old ^ 0xFF
            asked.set()
            seen = results.get(timeout=30)
            view[0] = old
            answered.set()
            _join(worker)
        assert zero_copy and seen == old ^ 0xFF
        ids = torch.tensor(_REAL_PROMPT)
        cache = PagedKVCache(reference.config, CacheShape(4, 16), "cpu",
                             c.info.kv_format.build())
        expected = reference.model(ForwardBatch.build(
            [SequenceInput(tuple(ids.tolist()), 0, (0, 1))], 16, "cpu"), cache)
        torch.testing.assert_close(logits, expected, rtol=0, atol=0)
    finally:
        assert store.terminate() == 0
    assert store.shm_files() == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_store_is_mapped_by_ipc(tmp_path):
    store = StoreProcess(tmp_path, "--model", "tiny-qwen3.5", "--page-size", str(PAGE),
                         "--max-context-tokens", "256", "--live-slots", "2",
                         "--snapshot-slots", "2", device="cuda")
    store.wait_serving(timeout=120)
    try:
        inserted = SPAWN.Event()
        writer = _spawn(_write_prefix, store.socket, PROMPT, inserted)
        reader = _spawn(_decode_after_prefix, store.socket, PROMPT + TURN, inserted,
                        str(tmp_path / "decoded.pt"))
        _join(writer, 120)
        _join(reader, 120)
        with StoreClient.connect(store.socket, "oracle") as oracle:
            assert oracle.arenas.weights.buffer.is_cuda
            # the untied token table stays in host memory (--embeddings auto on a GPU)
            table = oracle.model.model.embed_tokens.weight
            assert oracle.model.embeds_on_host and oracle.arenas.host.contains(table)
            assert all(oracle.arenas.weights.contains(p) for n, p in
                       oracle.model.named_parameters() if not n.startswith("model.embed_tokens."))
            full = PROMPT + TURN
            cache = PagedKVCache(oracle.info.config, CacheShape(16, PAGE, 1), "cuda",
                                 oracle.info.kv_format.build())
            seq = SequenceInput(tuple(full), 0, tuple(range(16)), 0)
            expected = oracle.model(ForwardBatch.build([seq], PAGE, "cuda"), cache,
                                    all_logits=True).float().cpu()
        got = torch.load(tmp_path / "decoded.pt")
        hit = got["hit_tokens"]
        assert hit == 20
        # bf16 compute: compare as flash-attention tests do, loosely against the one pass
        assert (got["logits"].argmax(-1) == expected[hit:].argmax(-1)).float().mean() >= 0.8
        assert (got["logits"] - expected[hit:]).abs().max() < 0.1 * expected.abs().max()
    finally:
        assert store.terminate() == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_mapping_failure_is_loud():
    from dataclasses import replace

    from kvstore.arena import Arena, ArenaMapError, Layout

    arena = Arena.create("probe", Layout.pack([("x", torch.float32, (8,))]), "cuda", "unused")
    bogus = replace(arena.handle, cuda=replace(arena.handle.cuda, handle=bytes(64)))
    with pytest.raises(ArenaMapError, match="never falls back to copying"):
        Arena.open("probe", bogus, owner_pid=os.getpid())


# ------------------------------------------------------------------ workers
# Run in spawned processes: each attaches on its own, as a real worker would.

_REAL_PROMPT = [1, 504, 3458, 314, 260, 1345, 28, 2]


def _write_prefix(socket_path: str, prompt: list[int], inserted) -> None:
    """Prefill `prompt` into pages it allocated, snapshot the GDN state at the
    last whole page, insert that prefix, give back the rest."""
    c = StoreClient.connect(socket_path, "writer")
    ps, device = c.info.page_size, c.arenas.kv.buffer.device
    got = c.allocate(pages=-(-len(prompt) // ps), slots=2)
    live, snapshot = got.slots
    whole = len(prompt) // ps * ps
    for start, end in ((0, whole), (whole, len(prompt))):  # snapshot at the page boundary
        seq = SequenceInput(tuple(prompt[start:end]), start, got.pages, live)
        c.model(ForwardBatch.build([seq], ps, device), c.cache)
        if end == whole:
            c.cache.copy_state(live, snapshot)
    if device.type == "cuda":
        torch.cuda.synchronize()  # the reader maps the same memory from another process
    c.insert(prompt[:whole], got.pages[:whole // ps], snapshot_slot=snapshot)
    c.release(pages=got.pages[whole // ps:], slots=[live])
    c.close()
    inserted.set()


def _decode_after_prefix(socket_path: str, tokens: list[int], inserted, out: str) -> None:
    """Match and lock the cached prefix, restore its snapshot into a live slot,
    and decode the rest one token at a time over the shared pages."""
    c = StoreClient.connect(socket_path, "reader")
    assert inserted.wait(60)
    ps, device = c.info.page_size, c.arenas.kv.buffer.device
    m = c.match(tokens, lock=True)
    got = c.allocate(pages=-(-len(tokens) // ps) - len(m.pages), slots=1)
    pages, slot = m.pages + got.pages, got.slots[0]
    c.cache.copy_state(m.snapshot_slot, slot)
    logits = []
    for pos in range(m.num_tokens, len(tokens)):
        seq = SequenceInput((tokens[pos],), pos, pages, slot)
        logits.append(c.model(ForwardBatch.build([seq], ps, device), c.cache).float().cpu())
    torch.save({"hit_tokens": m.num_tokens, "logits": torch.cat(logits)}, out)
    c.unlock([m.node_id])
    c.release(got.pages, got.slots)
    c.close()


def _hold_and_hang(socket_path: str, holding) -> None:
    """Hold pages, slots and a lock, then hang as if stuck mid-request."""
    c = StoreClient.connect(socket_path, "victim", map_memory=False)
    got = c.allocate(pages=6, slots=2)
    prefix = [(13 * i + 1) % 512 for i in range(8)]
    c.insert(prefix, got.pages[:2], snapshot_slot=got.slots[1], lock=True)
    c.allocate(pages=3)
    holding.set()
    time.sleep(600)


def _report_weights(socket_path: str, name: str, asked, answered, results) -> None:
    wait_for_store(socket_path, timeout=120)
    c = StoreClient.connect(socket_path, "worker")
    zero_copy = all(c.arenas.weights.contains(p) for p in c.model.parameters())
    cache = PagedKVCache(c.info.config, CacheShape(4, 16), "cpu", c.info.kv_format.build())
    logits = c.model(ForwardBatch.build([SequenceInput(tuple(_REAL_PROMPT), 0, (0, 1))], 16,
                                        "cpu"), cache)
    results.put((logits[0].tolist(), zero_copy))  # plain floats: exact for fp32
    assert asked.wait(60)
    results.put(c.arenas.weights.tensor(name).view(torch.uint8)[0].item())
    assert answered.wait(60)
    c.close()
