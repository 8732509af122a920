"""The decode worker's step loop when something fails: every request it was
given ends with a DecodeFinished event (the router's Decode call has no
deadline, so a missing one is a request that never ends and never gives its
pages back), and the loop keeps serving. Real StepLoop thread, scheduler and
tiny model; failures are injected where a real one would come from (the
forward, the drafter, a request's sampler, publishing)."""
import asyncio

import pytest
import torch

from decode.scheduler import DecodeScheduler
from decode.server import ReservedPagesOnly, StepLoop, _Subscriber
from engine.cache import CacheShape, PagedKVCache
from engine.kv import make_format
from engine.loader import load_model
from engine.sampling import SamplingParams
from engine.speculative import SpeculativeConfig
from kvstore.allocator import PageAllocator, SlotAllocator
from tandem.internal.v1 import workers_pb2 as pb
from tests.test_decode_scheduler import PAGE, _prefill

LONG = SamplingParams(temperature=0.0, max_new_tokens=200, ignore_eos=True)


class Harness:
    """A StepLoop over tiny-llama, and the streams of the requests given to it."""

    def __init__(self, pages=ReservedPagesOnly(), speculative=None, model="tiny-llama"):
        self.loaded = load_model(model, seed=1)
        self.cache = PagedKVCache(self.loaded.config, CacheShape(64, PAGE, 8), "cpu",
                                  make_format("bf16", dtype=torch.float32))
        self.pages, self.slots = PageAllocator(64), SlotAllocator(8)
        self.scheduler = DecodeScheduler(self.loaded.model, self.cache, pages, max_batch=4,
                                         speculative=speculative)
        self.steps = StepLoop(self.scheduler)
        self.steps.start()
        self.events = asyncio.new_event_loop()  # the gRPC server's loop, in life
        self.streams: dict[str, _Subscriber] = {}

    def sequence(self, request_id, prompt, params=LONG, extra_pages=0):
        seq = _prefill(self.loaded, self.cache, self.pages, self.slots, prompt, params, request_id)
        seq.pages.extend(self.pages.allocate(extra_pages))  # the router's reservation
        return seq

    def submit(self, seq):
        self.streams[seq.request_id] = _Subscriber(self.events, asyncio.Queue())
        self.steps.submit(seq, self.streams[seq.request_id])

    def stream_of(self, request_id, timeout=30.0):
        """Every event of the request's stream, up to its end (which must come)."""
        sub = self.streams[request_id]

        async def until_finished():
            got = []
            while not (got and got[-1].HasField("finished")):
                got.append(await asyncio.wait_for(sub.events.get(), timeout))
            return got
        return self.events.run_until_complete(until_finished())

    def close(self):
        self.steps.stop()
        self.events.close()


def _tokens(events):
    return [t.token_id for e in events if e.HasField("tokens") for t in e.tokens.tokens]


def test_a_failed_step_ends_the_sequences_it_had_already_dropped():
    """A step drops "a" (it outgrew its pages), then its forward raises: "a"
    was in no list the failure handler looked at, and its stream never ended."""
    h = Harness()
    try:
        forward = h.scheduler.forward

        def broken(batch):
            raise RuntimeError("simulated failure in the forward")
        h.scheduler.forward = broken
        a = h.sequence("a", [1, 2, 3, 4])  # 5 tokens on 1 page: the step needs a 2nd
        b = h.sequence("b", [1, 2])
        h.submit(a)
        h.submit(b)
        end_a = h.stream_of("a")[-1].finished
        assert end_a.reason == pb.DECODE_FINISH_ABORT and "out of KV pages" in end_a.detail
        assert list(end_a.pages) == a.pages
        end_b = h.stream_of("b")[-1].finished
        assert end_b.reason == pb.DECODE_FINISH_ABORT
        assert "decode step failed" in end_b.detail and "simulated failure" in end_b.detail
        assert h.steps.abort_and_wait("a") is False and not h.steps.subscribers
        # the loop serves on
        h.scheduler.forward = forward
        c = h.sequence("c", [5, 6, 7], SamplingParams(temperature=0.0, max_new_tokens=3,
                                                      ignore_eos=True), extra_pages=1)
        h.submit(c)
        events = h.stream_of("c")
        assert events[-1].finished.reason == pb.DECODE_FINISH_LENGTH
        assert _tokens(events) == c.output[1:] and len(c.output) == 3
    finally:
        h.close()


def test_a_sequence_that_finished_before_its_step_failed_keeps_its_end():
    """Speculative step: "a" reaches max_new_tokens and leaves, then drafting
    for "b" raises. "a" is complete (its tokens sampled, KV written, state
    committed): it gets its last tokens and LENGTH. "b" ends with the error."""
    h = Harness(speculative=SpeculativeConfig("ngram", 2))
    try:
        def broken(running):
            raise RuntimeError("simulated drafter failure")
        h.scheduler.spec.draft = broken
        a = h.sequence("a", [1, 2], SamplingParams(temperature=0.0, max_new_tokens=2,
                                                   ignore_eos=True), extra_pages=1)
        b = h.sequence("b", [1, 2], extra_pages=1)
        h.submit(a)
        h.submit(b)
        events = h.stream_of("a")
        assert events[-1].finished.reason == pb.DECODE_FINISH_LENGTH
        assert _tokens(events) == a.output[1:] and len(a.output) == 2
        assert events[-1].finished.final_tokens == 3  # prompt + first token: KV in the pages
        end_b = h.stream_of("b")[-1].finished
        assert end_b.reason == pb.DECODE_FINISH_ABORT and "simulated drafter failure" in end_b.detail
        assert not h.scheduler.has_work and not h.steps.subscribers
    finally:
        h.close()


def test_a_request_the_batch_cannot_take_ends_alone():
    """Joining the batch raised on the step thread (outside a step's error
    handler): the thread died and every stream waited for ever."""
    h = Harness()
    try:
        bad = h.sequence("bad", [1, 2, 3])

        def broken(*args):
            raise RuntimeError("simulated failure seeding the sampler")
        bad.sampling.skip_draws = broken
        good = h.sequence("good", [4, 5, 6], SamplingParams(temperature=0.0, max_new_tokens=3,
                                                            ignore_eos=True), extra_pages=1)
        h.submit(bad)
        h.submit(good)
        end = h.stream_of("bad")[-1].finished
        assert end.reason == pb.DECODE_FINISH_ABORT and "could not join" in end.detail
        assert "simulated failure seeding the sampler" in end.detail
        assert h.stream_of("good")[-1].finished.reason == pb.DECODE_FINISH_LENGTH
        assert h.steps.thread.is_alive()
    finally:
        h.close()


def test_the_loop_survives_a_failure_outside_a_step_and_ends_what_it_held():
    h = Harness()
    try:
        publish = h.steps._publish_tokens

        def broken(outs):
            h.steps._publish_tokens = publish  # once
            raise RuntimeError("simulated failure publishing tokens")
        h.steps._publish_tokens = broken
        h.submit(h.sequence("a", [1, 2, 3], extra_pages=4))
        end = h.stream_of("a")[-1].finished
        assert end.reason == pb.DECODE_FINISH_ABORT
        assert "the decode step loop failed" in end.detail and "publishing tokens" in end.detail
        assert h.steps.thread.is_alive() and not h.scheduler.has_work
        h.submit(h.sequence("b", [4, 5], SamplingParams(temperature=0.0, max_new_tokens=2,
                                                        ignore_eos=True), extra_pages=1))
        assert h.stream_of("b")[-1].finished.reason == pb.DECODE_FINISH_LENGTH
    finally:
        h.close()


def test_a_stopped_loop_ends_every_stream_and_answers_later_requests():
    h = Harness()
    try:
        a = h.sequence("a", [1, 2, 3], extra_pages=60)
        h.submit(a)
        while len(a.output) < 3:
            h.events.run_until_complete(asyncio.sleep(0.01))
        h.steps.stop()
        assert not h.steps.thread.is_alive()
        end = h.stream_of("a")[-1].finished
        assert end.reason == pb.DECODE_FINISH_ABORT and "stopped" in end.detail
        h.submit(h.sequence("late", [4, 5]))
        end = h.stream_of("late")[-1].finished
        assert end.reason == pb.DECODE_FINISH_ABORT and "not running" in end.detail
    finally:
        h.close()


def test_ids_outside_the_pools_are_invalid_argument_at_the_rpc_edge():
    """The step's kernels index the pools unchecked: on a GPU a bad id writes
    another allocation's memory, and a slot of -1 is the last slot, another
    request's. The worker refuses them as the request arrives, naming the id
    and the pool."""
    import grpc

    from decode.server import DecodeService
    from tandem.wire import pack_token_ids

    class Aborted(Exception):
        pass

    class Context:
        async def abort(self, code, details):
            raise Aborted(code, details)

    async def decode(service, request):
        return [event async for event in service.Decode(request, Context())]

    h = Harness(model="tiny-qwen3.5")  # 64 pages, 8 GDN state slots
    try:
        service = DecodeService(h.steps)
        good = dict(pages=[0, 1], state_slot=0, boundary_slot=1, spare_slots=[2, 3])
        cases = [
            (dict(pages=[0, 64]), r"page id 64 is outside the store's 64 page ids [0, 64)"),
            (dict(state_slot=8), "state_slot 8 is outside the store's 8 GDN state slots [0, 8)"),
            (dict(state_slot=-1), "state_slot -1 is outside"),
            (dict(boundary_slot=-5), "boundary_slot -5 is outside the store's 8 GDN state "
                                     "slots [0, 8) or -1 (none)"),
            (dict(spare_slots=[2, 99]), "spare slot 99 is outside the store's 8"),
            (dict(spare_slots=[2, 0]), "a state slot is named twice"),
        ]
        for fields, message in cases:
            request = pb.DecodeRequest(request_id="bad", prompt_le32=pack_token_ids([1, 2, 3]),
                                       first_token=4, **{**good, **fields},
                                       sampling=pb.Sampling(top_p=1.0, repetition_penalty=1.0))
            with pytest.raises(Aborted) as err:
                h.events.run_until_complete(decode(service, request))
            code, details = err.value.args
            assert code == grpc.StatusCode.INVALID_ARGUMENT and message in details
        assert not h.scheduler.has_work and not h.steps.subscribers
    finally:
        h.close()
