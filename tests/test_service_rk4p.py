"""`tandem serve --kv-format rk4p`: the whole-page 4-bit format in the service.
The store lays out bf16 staging pages; a request's sink page is a staging page
in its page table (shared through the prefix cache), its open pages travel
from the prefill worker to the decode worker, and every whole page a request
leaves is final before the cache takes it. Checked against the offline
engine, which runs the same format in one process."""
import os
import time

import grpc
import pytest
import torch

from engine.batch import ForwardBatch, SequenceInput
from engine.cache import CacheShape, PagedKVCache
from engine.kv import make_format
from engine.llm import EngineConfig, OfflineEngine
from engine.loader import load_model
from engine.sampling import SamplingParams
from tandem.internal.v1 import workers_pb2 as wpb
from tandem.internal.v1 import workers_pb2_grpc as wpb_grpc
from tandem.v1 import generation_pb2 as pb
from tandem.wire import pack_token_ids
from tests.test_service import DEVICE, GREEDY, Service, _chat, _generate

PAGE = 32  # rk4p's default page: its per-page K scales fit 4.5 bits from 32 tokens on


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    svc = Service(tmp_path_factory.mktemp("rk4p"), extra=("--kv-format", "rk4p"))
    yield svc
    svc.close()


@pytest.fixture(scope="module")
def offline():
    return OfflineEngine(load_model(progress=False),
                         EngineConfig(max_batch=1, max_context=8192, kv_format="rk4p",
                                      page_size=PAGE))


def test_greedy_matches_the_offline_engine_and_again_from_the_cache(service, offline):
    for i, prompt in enumerate(["Name three colours.", "What is 2 + 2? Explain."]):
        ids = offline.chat_prompt([{"role": "user", "content": prompt}])
        expected = offline.generate_ids(ids, SamplingParams(temperature=0.0, max_new_tokens=40))
        runs = [_generate(service.stub, chat=_chat(prompt), sampling=GREEDY, max_new_tokens=40,
                          cache_salt=f"greedy-{i}") for _ in range(2)]
        assert runs[0][0] == expected
        # the prompt's whole pages (the sink a staging page) came back from the cache
        assert [r[2].usage.cached_tokens for r in runs] == [0, (len(ids) - 1) // PAGE * PAGE]
        assert runs[1][0] == expected
    stats = service.store_stats()
    assert stats.held_pages == 0 and stats.total_staging == 12 * (5 + 1)


def test_prompts_that_share_their_first_page_share_one_sink(service):
    before = service.store_stats()
    head = [(13 * i + 5) % 1000 + 100 for i in range(PAGE + 8)]
    usages = [_generate(service.stub, token_ids=pb.TokenIds(ids=head + [2000 + k] * 9),
                        sampling=GREEDY, max_new_tokens=4, cache_salt="shared-sink")[2].usage
              for k in range(2)]
    assert [u.cached_tokens for u in usages] == [0, PAGE]
    after = service.store_stats()
    cached_sinks = lambda s: s.total_staging - s.free_staging  # noqa: E731 (nothing is held now)
    assert after.held_pages == 0 and cached_sinks(after) == cached_sinks(before) + 1


def test_cancel_gives_back_every_page_and_staging_page(service):
    baseline = service.store_stats()
    call = service.stub.Generate(pb.GenerateRequest(chat=_chat("Count to one hundred."),
                                                    max_new_tokens=300, ignore_eos=True,
                                                    cache_salt="cancelled"))
    next(call)
    call.cancel()
    deadline = time.time() + 5
    while service.store_stats().held_pages and time.time() < deadline:
        time.sleep(0.05)
    stats = service.store_stats()
    assert stats.held_pages == baseline.held_pages == 0
    # what is not free is in the cache: the cancelled prompt's whole pages and its sink
    assert stats.free_staging + (stats.cached_pages - (stats.total_pages - stats.free_pages)) \
        == stats.total_staging


def test_a_prefill_without_its_open_pages_is_invalid_argument(service):
    with grpc.insecure_channel(f"unix:{os.path.join(service.dir, 'prefill.sock')}") as channel:
        stub = wpb_grpc.PrefillServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Prefill(wpb.PrefillRequest(
                request_id="bad", tokens_le32=pack_token_ids([1, 2, 3]), start=0, pages=[0],
                state_slot=-1, sampling=wpb.Sampling(top_p=1.0, repetition_penalty=1.0)),
                timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "needs 4 open (staging) page ids" in err.value.details()


def _bf16_kv_margins(loaded, prompt, ids):
    """How far below the best logit each of `ids` was, from one forward over
    prompt + ids with exact (fp32) KV: 0 where the token was the argmax."""
    tokens = list(prompt) + list(ids)
    cache = PagedKVCache(loaded.config, CacheShape(-(-len(tokens) // PAGE), PAGE, 1), "cpu",
                         make_format("bf16", dtype=torch.float32))
    seq = SequenceInput(tuple(tokens), 0, tuple(range(cache.shape.num_pages)), 0)
    with torch.inference_mode():
        logits = loaded.model(ForwardBatch.build([seq], PAGE, "cpu"), cache, all_logits=True)
    logits = logits[len(prompt) - 1:len(tokens) - 1]
    return logits.max(-1).values - logits[torch.arange(len(ids)), torch.tensor(ids)]


def test_hybrid_agent_turns_with_mtp_follow_exact_kv(tmp_path):
    """Tiny Qwen3.5 (GDN snapshots) with MTP drafts: each turn resends the
    conversation and restores the cached part (sink and sealed pages, GDN
    snapshot). The first turn equals the offline engine's rk4p output; a
    later turn reads its newest cached pages in 4-bit where a fresh prefill
    would still read them in bf16 (docs/ARCHITECTURE.md), so it is checked
    against exact KV instead: every token is the exact-KV argmax or within
    0.05 of it (a near-tie; a wrong page or state misses by whole units)."""
    svc = Service(tmp_path, model="tiny-qwen3.5",
                  extra=("--kv-format", "rk4p", "--speculative", "mtp", "--draft-tokens", "3"))
    try:
        loaded = load_model("tiny-qwen3.5", device=DEVICE)
        offline = OfflineEngine(loaded, EngineConfig(max_batch=1, kv_format="rk4p"))
        prompt = [(7 * i + 3) % 250 for i in range(70)]
        cached, restorable = [], [0]
        for turn in range(3):
            ids, _, complete = _generate(svc.stub, token_ids=pb.TokenIds(ids=prompt),
                                         sampling=pb.SamplingParameters(temperature=0.0),
                                         max_new_tokens=40, ignore_eos=True, cache_salt="agent")
            if turn == 0:
                assert ids == offline.generate_ids(prompt, SamplingParams(
                    temperature=0.0, max_new_tokens=40, ignore_eos=True))
            assert float(_bf16_kv_margins(loaded, prompt, ids).max()) < 0.05, f"turn {turn}"
            cached.append(complete.usage.cached_tokens)
            # the next turn restores the last page boundary this one's state passed
            restorable.append((len(prompt) + len(ids) - 1) // PAGE * PAGE)
            prompt = prompt + ids + [(5 * i + turn) % 250 for i in range(10)]
        assert cached == restorable[:3] and cached[1:] == [96, 128]
        stats = svc.store_stats()
        assert stats.held_pages == 0 and stats.held_slots == 0 and stats.snapshots >= 2
    finally:
        svc.close()
