"""Speculative decoding through `tandem serve`: the store lays out the
drafter's memory (MTP KV pools, k spare GDN slots per sequence), the router
reserves and passes the spare slots, the decode worker drafts and verifies.
The oracle is the offline engine's plain (non-speculative) greedy output.

KV is stored unquantized (`--kv-format bf16`, fp32 on the CPU) on both sides:
what is under test is speculation, not a KV format's rounding."""
from __future__ import annotations

import subprocess
import sys
import threading
import time

import grpc
import pytest

from engine.llm import EngineConfig, OfflineEngine
from engine.loader import load_model
from engine.sampling import SamplingParams
from tandem.v1 import generation_pb2 as pb
from tandem.ports import free_port
from tests.test_service import DEVICE, Service, _chat, _generate

GREEDY = pb.SamplingParameters(temperature=0.0)
DRAFTED, ACCEPTED = "tandem_spec_drafted_tokens_total", "tandem_spec_accepted_tokens_total"


def _serve(tmp_path_factory, name, model, method):
    return Service(tmp_path_factory.mktemp(name), model=model,
                   extra=("--kv-format", "bf16", "--speculative", method, "--draft-tokens", "3"))


@pytest.fixture(scope="module")
def ngram_service(tmp_path_factory):
    svc = _serve(tmp_path_factory, "ngram", None, "ngram")
    yield svc
    svc.close()


@pytest.fixture(scope="module")
def mtp_service(tmp_path_factory):
    svc = _serve(tmp_path_factory, "mtp", "tiny-qwen3.5", "mtp")
    yield svc
    svc.close()


@pytest.fixture(scope="module")
def hybrid_ngram_service(tmp_path_factory):
    svc = _serve(tmp_path_factory, "hybrid-ngram", "tiny-qwen3.5", "ngram")
    yield svc
    svc.close()


def _concurrently(stub, requests: list[dict]) -> list:
    results = [None] * len(requests)

    def one(i):
        try:
            results[i] = _generate(stub, timeout=300, **requests[i])
        except grpc.RpcError as e:
            results[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [r for r in results if isinstance(r, grpc.RpcError)]
    assert not errors, errors[0]
    return results


def _wait_for_idle_store(service, baseline, timeout=5.0):
    """Pages and slots held by sessions return to `baseline` (a Stats reply)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        stats = service.store_stats()
        if (stats.held_pages, stats.held_slots) == (baseline.held_pages, baseline.held_slots):
            return stats
        time.sleep(0.05)
    stats = service.store_stats()
    assert (stats.held_pages, stats.held_slots) == (baseline.held_pages, baseline.held_slots)
    return stats


TEXTS = ["Repeat exactly: the cat sat on the mat, the cat sat on the mat.",
         "Write a Python function that returns the square of a number.",
         "What is the capital of France?"]


def test_ngram_on_the_embedded_model_equals_plain_greedy(ngram_service):
    """Three concurrent requests, drafts accepted to different depths (the
    repeat prompt lets prompt lookup hit), each token-identical to the
    offline engine without speculation; the router counts drafts."""
    svc = ngram_service
    assert svc.stub.GetModelInfo(pb.GetModelInfoRequest()).speculative == "ngram:3"
    drafted, accepted = svc.metric(DRAFTED), svc.metric(ACCEPTED)
    results = _concurrently(svc.stub, [dict(chat=_chat(t), sampling=GREEDY, max_new_tokens=24,
                                            cache_salt=f"ngram-{i}") for i, t in enumerate(TEXTS)])
    offline = OfflineEngine(load_model(None, device=DEVICE, progress=False),
                            EngineConfig(max_batch=1, max_context=1024))
    for text, (ids, out_text, complete) in zip(TEXTS, results):
        prompt = offline.chat_prompt([{"role": "user", "content": text}])
        expected = offline.generate_ids(prompt, SamplingParams(temperature=0.0, max_new_tokens=24))
        assert ids == expected, text
        assert out_text == offline.tokenizer.decode(ids, skip_special_tokens=True)
        assert complete.usage.completion_tokens == len(ids)
    assert svc.metric(DRAFTED) > drafted
    assert accepted < svc.metric(ACCEPTED) <= svc.metric(DRAFTED)


def test_a_stop_string_inside_a_speculative_step_ends_there(ngram_service):
    """A step emits several tokens at once; the router must not count or
    cache those after the token that completed a stop string."""
    from engine.loader import load_tokenizer

    svc = ngram_service
    request = dict(chat=_chat(TEXTS[0]), sampling=GREEDY, max_new_tokens=24, cache_salt="stop")
    full_ids, full_text, _ = _generate(svc.stub, **request)
    stop = " sat"  # prompt lookup drafts " sat on the" after " cat": one step, several tokens
    assert stop in full_text
    ids, text, complete = _generate(svc.stub, stop=[stop], **request)
    assert text == full_text[:full_text.index(stop)]
    assert complete.finish_reason == pb.FINISH_REASON_STOP
    assert complete.usage.completion_tokens == len(ids) and ids == full_ids[:len(ids)]
    # the last token kept is the one whose text completed the stop string
    decode = load_tokenizer(None).decode
    assert stop in decode(ids) and stop not in decode(ids[:-1])


def test_mtp_on_the_hybrid_shape_equals_plain_greedy(mtp_service):
    """Tiny Qwen3.5 (GDN + MTP layer): the prefill fills the MTP KV, decode
    drafts with the head and verifies with k spare GDN slots per sequence;
    three concurrent requests equal the offline plain greedy output, and
    every page and slot is given back afterwards."""
    svc = mtp_service
    assert svc.stub.GetModelInfo(pb.GetModelInfoRequest()).speculative == "mtp:3"
    prompts = [[(7 * i + 3 + j) % 250 for i in range(30)] for j in range(3)]
    drafted = svc.metric(DRAFTED)
    results = _concurrently(svc.stub, [dict(token_ids=pb.TokenIds(ids=p), sampling=GREEDY,
                                            max_new_tokens=20, ignore_eos=True,
                                            cache_salt=f"mtp-{i}") for i, p in enumerate(prompts)])
    offline = OfflineEngine(load_model("tiny-qwen3.5", device=DEVICE, progress=False),
                            EngineConfig(max_batch=1, max_context=1024))
    for prompt, (ids, _, complete) in zip(prompts, results):
        assert ids == offline.generate_ids(prompt, SamplingParams(temperature=0.0, max_new_tokens=20,
                                                                  ignore_eos=True))
        assert complete.usage.completion_tokens == 20
    # 19 decode tokens per request; every step after the first drafts (random
    # weights: the head's drafts are almost never accepted)
    assert svc.metric(DRAFTED) - drafted >= 3 * 3 * 10
    stats = svc.store_stats()
    assert stats.held_pages == 0 and stats.held_slots == 0


def test_ngram_on_the_hybrid_shape_selects_gdn_states_across_turns(hybrid_ngram_service):
    """Accepted drafts on a GDN model: the state after the kept prefix is in
    one of the spare slots, whose id the decode worker swaps in. A negative
    presence penalty makes the random model repeat itself, so lookup drafts
    get accepted to different depths. Each turn (three concurrent
    conversations) equals plain greedy, and the next turn restores the
    snapshot a verify step left at the last page boundary."""
    svc = hybrid_ngram_service
    page = 16
    plain = SamplingParams(temperature=0.0, presence_penalty=-2.0, max_new_tokens=24,
                           ignore_eos=True)
    sampling = pb.SamplingParameters(temperature=0.0, presence_penalty=-2.0)
    offline = OfflineEngine(load_model("tiny-qwen3.5", device=DEVICE, progress=False),
                            EngineConfig(max_batch=1, max_context=1024))
    prompts = [[(7 * i + 3 + j) % 250 for i in range(30)] for j in range(3)]
    accepted = svc.metric(ACCEPTED)
    previous = None
    for turn in range(2):
        results = _concurrently(svc.stub, [
            dict(token_ids=pb.TokenIds(ids=p), sampling=sampling, max_new_tokens=24,
                 ignore_eos=True, cache_salt=f"turns-{i}") for i, p in enumerate(prompts)])
        for i, (ids, _, complete) in enumerate(results):
            assert ids == offline.generate_ids(prompts[i], plain), (turn, i)
            if previous is not None:  # the last page boundary the previous turn passed
                assert complete.usage.cached_tokens == (previous[i] - 1) // page * page
        previous = [len(p) + len(r[0]) for p, r in zip(prompts, results)]
        prompts = [p + r[0] + [(5 * k + i) % 250 for k in range(6)]
                   for i, (p, r) in enumerate(zip(prompts, results))]
    assert svc.metric(ACCEPTED) > accepted
    stats = svc.store_stats()
    assert stats.held_pages == 0 and stats.held_slots == 0


def test_cancel_mid_stream_gives_back_every_page_and_slot(mtp_service):
    svc = mtp_service
    baseline = svc.store_stats()
    call = svc.stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(range(3, 40))),
                                                max_new_tokens=400, ignore_eos=True,
                                                cache_salt="cancel"), timeout=120)
    for _ in range(4):  # the first token (prefill), then decode steps
        next(call)
    during = svc.store_stats()
    assert during.held_slots >= 2 + 3  # live + boundary + 3 spare slots at least
    call.cancel()
    _wait_for_idle_store(svc, baseline)
    # and by Abort: the request ends with ABORT and gives everything back too
    call = svc.stub.Generate(pb.GenerateRequest(request_id="spec-abort",
                                                token_ids=pb.TokenIds(ids=list(range(5, 50))),
                                                max_new_tokens=400, ignore_eos=True), timeout=120)
    next(call)
    assert svc.stub.Abort(pb.AbortRequest(request_id="spec-abort")).found
    assert list(call)[-1].complete.finish_reason == pb.FINISH_REASON_ABORT
    _wait_for_idle_store(svc, baseline)


@pytest.mark.parametrize("flags,message", [
    (["--draft-tokens", "0"], "1..4"),
    (["--draft-tokens", "5"], "1..4"),
    (["--speculative", "eagle"], "invalid choice"),
    (["--model", "tiny-llama", "--speculative", "mtp"], "train-mtp"),
])
def test_serve_rejects_bad_speculation(tmp_path, flags, message):
    run = subprocess.run([sys.executable, "-m", "tandem.cli", "serve", "--device", "cpu",
                          "--http-port", "0", "--metrics-port", "0", "--grpc-port", str(free_port()),
                          "--max-context-tokens", "1024", "--socket-dir", str(tmp_path), *flags],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and message in run.stderr, run.stderr
    assert "Traceback" not in run.stderr


def test_the_cli_knows_the_engines_draft_limit():
    from engine.speculative import MAX_DRAFT_TOKENS
    from tandem import cli

    assert cli._MAX_DRAFT_TOKENS == MAX_DRAFT_TOKENS
