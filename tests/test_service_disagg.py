"""The disaggregated topology as users meet it: `tandem serve --topology
disaggregated` starts a store per worker, N prefill and M decode workers in
one gloo process group, and a router over them; every prompt's KV pages (and
GDN state) travel from the prefill store to the decode store.

Oracles: the offline engine (which tests/test_service.py also holds the
shared topology to, token for token), and the prefill store's own pages,
compared byte for byte with the decode store's copy."""
from __future__ import annotations

import os
import threading
import time

import grpc
import pytest
import torch

from kvstore.client import StoreClient
from tandem.v1 import generation_pb2 as pb
from tests.test_service import (ON_GPU, Service, _chat, _generate, assert_greedy,
                                oracle_engine)

PAGE = 16
GREEDY = pb.SamplingParameters(temperature=0.0)


def _disaggregated(directory, prefill: int, decode: int, model=None, method="dist", extra=()):
    # NCCL joins one rank per GPU (`tandem serve` refuses more): on fewer GPUs
    # than workers the group sends through host memory, by gloo
    shared_gpu = method == "dist" and ON_GPU and torch.cuda.device_count() < prefill + decode
    return Service(directory, model=model, extra=(
        "--topology", "disaggregated", "--prefill-workers", str(prefill),
        "--decode-workers", str(decode), "--kv-transfer", method, *extra),
        env={"TANDEM_TRANSFER_BACKEND": "gloo"} if shared_gpu else None)


def _store(svc: Service, worker: str, map_memory: bool = False) -> StoreClient:
    return StoreClient.connect(os.path.join(svc.dir, f"kvstore-{worker}.sock"), name="test",
                               map_memory=map_memory)


def _stats(svc: Service, worker: str):
    with _store(svc, worker) as client:
        return client.stats()


def _routed(svc: Service, worker: str) -> float:
    return svc.metric(f'tandem_worker_requests_total{{worker="{worker}"}}')


def _stop(svc: Service) -> None:
    svc.channel.close()
    svc.stop()
    assert svc.proc.returncode == 0, "".join(svc.stderr[-30:])


# ------------------------------------------------- the embedded model, 1 + 1


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    # with the shipped MTP head: its KV pools travel too, and greedy stays exact
    svc = _disaggregated(tmp_path_factory.mktemp("disagg"), 1, 1,
                         extra=("--speculative", "mtp", "--draft-tokens", "2"))
    yield svc
    _stop(svc)


@pytest.fixture(scope="module")
def offline():
    return oracle_engine()


def test_greedy_tokens_equal_the_offline_engine_like_the_shared_topology(embedded, offline):
    # a prompt of several pages, so pages go in more than one message
    prompt = "Name three colours and say why each of them is nice, in two sentences."
    ids, text, complete = _generate(embedded.stub, chat=_chat(prompt), sampling=GREEDY,
                                    max_new_tokens=12, cache_salt="greedy")
    assert_greedy(offline, offline.chat_prompt([{"role": "user", "content": prompt}]), ids, 12)
    assert complete.usage.completion_tokens == 12
    assert embedded.metric("tandem_kv_transfer_pages_total") >= -(-complete.usage.prompt_tokens
                                                                  // PAGE)


def test_transferred_pages_are_bit_exact(embedded):
    tokens = [(37 * i + 11) % 40000 for i in range(5 * PAGE + 3)]
    _generate(embedded.stub, token_ids=pb.TokenIds(ids=tokens), sampling=GREEDY,
              max_new_tokens=2, cache_salt="bits")
    with _store(embedded, "prefill-0", map_memory=True) as p, \
            _store(embedded, "decode-0", map_memory=True) as d:
        mp, md = p.match(tokens, "bits"), d.match(tokens, "bits")
        assert mp.num_tokens == md.num_tokens == 5 * PAGE
        kv_p, kv_d = p.arenas.kv.tensors("kv."), d.arenas.kv.tensors("kv.")
        assert kv_p.keys() == kv_d.keys() and len(kv_p) >= 30
        assert any(name.startswith("kv.30.") for name in kv_p)  # the MTP layer's pool
        for name in kv_p:
            src, dst = kv_p[name][list(mp.pages)], kv_d[name][list(md.pages)]
            assert torch.equal(src.view(torch.uint8), dst.view(torch.uint8)), name
            assert src.view(torch.uint8).any(), name  # real KV, not two empty pages


def test_next_turn_moves_only_the_new_pages(embedded):
    messages = [pb.ChatMessage(role="user", content="Tell me about the moon.")]
    _, first_text, first = _generate(embedded.stub, chat=pb.Chat(messages=messages),
                                     sampling=GREEDY, max_new_tokens=20, cache_salt="turns")
    before = embedded.metric("tandem_kv_transfer_pages_total")
    messages += [pb.ChatMessage(role="assistant", content=first_text),
                 pb.ChatMessage(role="user", content="And the sun?")]
    _, _, second = _generate(embedded.stub, chat=pb.Chat(messages=messages), sampling=GREEDY,
                             max_new_tokens=4, cache_salt="turns")
    # the prefill store cached the first prompt; the decode store prompt + output
    assert second.usage.cached_tokens >= first.usage.prompt_tokens // PAGE * PAGE > 0
    previous = first.usage.prompt_tokens + first.usage.completion_tokens
    moved = embedded.metric("tandem_kv_transfer_pages_total") - before
    assert moved == -(-second.usage.prompt_tokens // PAGE) - (previous - 1) // PAGE
    for worker in ("prefill-0", "decode-0"):
        s = _stats(embedded, worker)
        assert s.held_pages == 0 and s.free_pages + s.cached_pages == s.total_pages, worker


# ------------------- 2 prefill + 2 decode workers on the hybrid shape (GDN state travels)


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    # 2048 tokens (128 pages) per store, so two long requests fill both decode stores
    svc = _disaggregated(tmp_path_factory.mktemp("pool"), 2, 2, model="tiny-qwen3.5",
                         extra=("--max-context-tokens", "2048", "--prefill-chunk", "32"))
    yield svc
    _stop(svc)


WORKERS = ("prefill-0", "prefill-1", "decode-0", "decode-1")


def _ids(seed: int, n: int) -> list[int]:
    return [(seed * 31 + 7 * i) % 250 + 1 for i in range(n)]


def test_two_by_two_balances_concurrent_requests(pool):
    before = {w: _routed(pool, w) for w in WORKERS}
    results = [None] * 4

    def one(i):
        results[i] = _generate(pool.stub, token_ids=pb.TokenIds(ids=_ids(100 + i, 40)),
                               sampling=GREEDY, max_new_tokens=8, ignore_eos=True,
                               cache_salt=f"balance-{i}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r is not None and len(r[0]) == 8 for r in results)
    routed = {w: _routed(pool, w) - before[w] for w in WORKERS}
    assert routed == {w: 2 for w in WORKERS}, routed


def test_next_turn_goes_to_the_worker_with_its_prefix(pool):
    conversation = _ids(7, 50)
    ids, _, first = _generate(pool.stub, token_ids=pb.TokenIds(ids=conversation),
                              sampling=GREEDY, max_new_tokens=20, ignore_eos=True,
                              cache_salt="affinity")
    home = max(("decode-0", "decode-1"), key=lambda w: _stats(pool, w).cached_pages
               if _store_has(pool, w, conversation) else -1)
    for i in range(2):  # others' requests, so the home worker is not the least used any more
        _generate(pool.stub, token_ids=pb.TokenIds(ids=_ids(200 + i, 30)), sampling=GREEDY,
                  max_new_tokens=2, ignore_eos=True, cache_salt=f"other-{i}")
    other = "decode-1" if home == "decode-0" else "decode-0"
    assert _routed(pool, home) >= _routed(pool, other)
    before = _routed(pool, home)
    conversation = conversation + ids + _ids(9, 12)
    _, _, second = _generate(pool.stub, token_ids=pb.TokenIds(ids=conversation), sampling=GREEDY,
                             max_new_tokens=2, ignore_eos=True, cache_salt="affinity")
    assert _routed(pool, home) == before + 1
    assert second.usage.cached_tokens >= 50 // PAGE * PAGE


def _store_has(svc, worker, tokens) -> bool:
    with _store(svc, worker) as client:
        return client.match(tokens, "affinity").num_tokens > 0


def _all_pages_back(svc) -> dict:
    deadline = time.time() + 5
    while True:
        held = {w: (s.held_pages, s.held_slots) for w in WORKERS for s in [_stats(svc, w)]}
        if all(v == (0, 0) for v in held.values()) or time.time() > deadline:
            return held
        time.sleep(0.05)


def test_cancel_mid_stream_and_mid_prefill_gives_back_every_page(pool):
    call = pool.stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=_ids(3, 40)),
                                                 max_new_tokens=3000, ignore_eos=True))
    next(call)  # decoding
    call.cancel()
    # the router counts a transfer after the first token went out: wait for the
    # cancelled request to end before reading the counter
    assert _all_pages_back(pool) == {w: (0, 0) for w in WORKERS}
    # a long prompt in 32-token chunks, cancelled while its pages are on the way:
    # a third into the time the same length takes whole on this machine (a
    # fixed sleep was mid-prefill on one CPU and after the end on a faster one)
    started = time.perf_counter()
    _generate(pool.stub, token_ids=pb.TokenIds(ids=_ids(6, 1800)), max_new_tokens=1,
              ignore_eos=True)
    whole = time.perf_counter() - started
    assert _all_pages_back(pool) == {w: (0, 0) for w in WORKERS}
    moved = pool.metric("tandem_kv_transfer_bytes_total")
    started = time.perf_counter()
    call = pool.stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=_ids(4, 1800)),
                                                 max_new_tokens=4, ignore_eos=True))
    time.sleep(whole / 3)
    call.cancel()
    assert _all_pages_back(pool) == {w: (0, 0) for w in WORKERS}
    # the transfer never finished (the router counts it when it does)
    assert pool.metric("tandem_kv_transfer_bytes_total") == moved, \
        (time.perf_counter() - started, whole)
    ids, _, _ = _generate(pool.stub, token_ids=pb.TokenIds(ids=_ids(5, 20)), max_new_tokens=3,
                          ignore_eos=True)
    assert len(ids) == 3  # the pairs are still in step after the aborted transfers


def test_a_full_decode_store_is_resource_exhausted_and_leaks_nothing(pool):
    # each hog reserves 120 of a decode store's 128 pages (balanced: one per store)
    hogs = [pool.stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=_ids(60 + i, 20)),
                                                  max_new_tokens=1900, ignore_eos=True))
            for i in range(2)]
    for hog in hogs:
        next(hog)
    with pytest.raises(grpc.RpcError) as err:
        _generate(pool.stub, token_ids=pb.TokenIds(ids=_ids(70, 20)), max_new_tokens=400,
                  ignore_eos=True)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "decode store" in err.value.details()
    for hog in hogs:
        hog.cancel()
    assert _all_pages_back(pool) == {w: (0, 0) for w in WORKERS}


def _holder(svc, workers, tokens, salt):
    for w in workers:
        with _store(svc, w) as client:
            if client.match(tokens, salt).num_tokens:
                return w
    raise AssertionError(f"no store of {workers} caches the prompt")


def _agent_turns_match_offline(svc, salt: str) -> list[int]:
    """Two greedy turns of a conversation (token ids), each equal to the offline
    engine's full recomputation; returns the first prompt and cached_tokens."""
    offline = oracle_engine("tiny-qwen3.5")
    prompt = [(7 * i + 3) % 250 for i in range(40)]
    cached = []
    for turn in range(2):
        ids, _, complete = _generate(svc.stub, token_ids=pb.TokenIds(ids=prompt), sampling=GREEDY,
                                     max_new_tokens=20, ignore_eos=True, cache_salt=salt)
        assert_greedy(offline, prompt, ids, 20, ignore_eos=True, label=f"turn {turn}")
        cached.append(complete.usage.cached_tokens)
        prompt = prompt + ids + [(5 * i + turn) % 250 for i in range(10)]
    assert cached[0] == 0 and cached[1] > 0
    return cached


def _snapshots_equal(svc, prefill: str, decode: str, tokens, salt) -> None:
    with _store(svc, prefill, map_memory=True) as p, _store(svc, decode, map_memory=True) as d:
        mp, md = p.match(tokens, salt), d.match(tokens, salt)
        assert mp.num_tokens == md.num_tokens == 32  # the prompt-end snapshot, both sides
        for name, t in p.arenas.state.tensors().items():
            assert torch.equal(t[mp.snapshot_slot], d.arenas.state.tensor(name)[md.snapshot_slot])
            assert t[mp.snapshot_slot].any(), name


def test_hybrid_state_and_snapshots_travel_over_the_group(pool):
    _agent_turns_match_offline(pool, "agent")
    first = [(7 * i + 3) % 250 for i in range(40)]
    _snapshots_equal(pool, _holder(pool, WORKERS[:2], first, "agent"),
                     _holder(pool, WORKERS[2:], first, "agent"), first, "agent")
    assert _all_pages_back(pool) == {w: (0, 0) for w in WORKERS}


def test_hybrid_state_and_snapshots_travel_by_peer_copies(tmp_path_factory):
    svc = _disaggregated(tmp_path_factory.mktemp("peer"), 1, 1, model="tiny-qwen3.5",
                         method="peer")
    try:
        _agent_turns_match_offline(svc, "agent")
        first = [(7 * i + 3) % 250 for i in range(40)]
        _snapshots_equal(svc, "prefill-0", "decode-0", first, "agent")
        for worker in ("prefill-0", "decode-0"):
            s = _stats(svc, worker)
            assert s.held_pages == 0 and s.held_slots == 0, worker
    finally:
        _stop(svc)
