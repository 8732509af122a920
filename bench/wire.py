"""Host time of one agent turn's prompt traffic between the service's
processes: the router packing the prompt into the internal RPCs, the store
unpacking, checking and matching it in the prefix cache, and the prefill
worker turning its request into a PrefillJob. No server runs: the real
protobuf messages are serialized and parsed in-process, against the real
StoreControl (radix tree included) and the real job_from_pb.

The turn is an agent's next one: the store already caches every whole page
of the prompt, so the match walks all of it (the longest compare). Each
figure is the best of --repeats runs (this is CPU time only; the best run is
the one least disturbed by other processes).

    python -m bench.wire [--tokens 100000] [--page-size 16] [--vocab-size 248320]
                         [--repeats 15] [--json FILE]
"""
from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass
from typing import Callable

from bench.common import environment, now, print_table, write_json


@dataclass
class Step:
    process: str
    what: str
    before_first_token: bool  # on the time to first token's path
    run: Callable[[], object]


def best_seconds(run: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = now()
        run()
        times.append(now() - t0)
    return min(times)


def turn_steps(num_tokens: int, page_size: int, vocab_size: int, seed: int = 0):
    """The steps of one turn over a `num_tokens` prompt, and what they must
    give (checked before timing, so the figures are of work that was right)."""
    from engine.sampling import SamplingParams
    from kvstore.control import StoreControl
    from kvstore.server import insert_to_pb, match_to_pb, tokens_from_pb
    from prefill.server import job_from_pb
    from tandem.internal.v1 import kvstore_pb2 as kpb
    from tandem.internal.v1 import workers_pb2 as wpb
    from tandem.wire import pack_token_ids, packed_prefix, sampling_to_pb

    rng = random.Random(seed)
    prompt = [rng.randrange(vocab_size) for _ in range(num_tokens)]  # as the tokenizer gives it
    whole = num_tokens // page_size * page_size
    max_new_tokens = 256
    total_pages = -(-(num_tokens + max_new_tokens) // page_size)
    control = StoreControl(whole // page_size + total_pages, 0, page_size, hybrid=False,
                           vocab_size=vocab_size, namespace_prefix="bench|int8")
    session = control.open_session("router").id
    # the previous turn left the prompt's whole pages in the cache
    previous = list(control.allocate(session, whole // page_size, 0).pages)
    control.insert(session, "", prompt[:whole], previous, None, lock=False)
    cached = control.match(session, "", prompt, lock=False)
    packed = pack_token_ids(prompt)
    # the request's page table: the cached prefix, then pages reserved for the rest
    reserved = total_pages - len(cached.pages)
    pages = list(cached.pages) + list(range(len(previous), len(previous) + reserved))
    sampling = sampling_to_pb(SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens,
                                             seed=1), (2,))

    def match_request() -> bytes:
        return kpb.MatchRequest(session_id=session, tokens_le32=packed, lock=False) \
            .SerializeToString()

    def prefill_request() -> bytes:
        return wpb.PrefillRequest(request_id="bench", tokens_le32=packed, start=cached.num_tokens,
                                  pages=pages, state_slot=-1, restore_slot=-1,
                                  sampling=sampling).SerializeToString()

    def insert_request() -> bytes:  # the prompt again: the cache holds all its pages
        return kpb.InsertRequest(session_id=session, tokens_le32=packed_prefix(packed, whole),
                                 pages=previous, lock=False).SerializeToString()

    def decode_request() -> bytes:
        return wpb.DecodeRequest(request_id="bench", prompt_le32=packed, first_token=1,
                                 sampling=sampling, pages=pages, state_slot=-1,
                                 boundary_slot=-1).SerializeToString()

    match_wire, prefill_wire, insert_wire = match_request(), prefill_request(), insert_request()

    def store_match():
        r = kpb.MatchRequest.FromString(match_wire)
        return match_to_pb(control.match(r.session_id, r.cache_salt, tokens_from_pb(r), r.lock))

    def store_insert():
        r = kpb.InsertRequest.FromString(insert_wire)
        return insert_to_pb(control.insert(r.session_id, r.cache_salt, tokens_from_pb(r),
                                           r.pages, None, r.lock))

    def prefill_job():
        job = job_from_pb(wpb.PrefillRequest.FromString(prefill_wire))
        job.check(page_size, vocab_size)
        return job

    expected = {"cached_tokens": (num_tokens - 1) // page_size * page_size}
    got = {"cached_tokens": store_match().num_tokens}
    job = prefill_job()
    if got != expected or job.tokens.tolist() != prompt or store_insert().new_pages != 0:
        raise AssertionError(f"the turn's messages do not carry the prompt: {got} != {expected}")
    steps = [
        Step("router", "pack the prompt (once per request)", True,
             lambda: pack_token_ids(prompt)),
        Step("router", "MatchRequest: build + serialize", True, match_request),
        Step("store", "Match: parse + unpack + vocabulary check + radix match", True,
             store_match),
        Step("router", "PrefillRequest: build + serialize (+ page table)", True, prefill_request),
        Step("prefill", "PrefillRequest: parse -> PrefillJob + check", True, prefill_job),
        Step("router", "InsertRequest: build + serialize (whole pages)", False, insert_request),
        Step("store", "Insert: parse + unpack + check + radix insert", False, store_insert),
        Step("router", "DecodeRequest: build + serialize", False, decode_request),
    ]
    sizes = {"match_request_bytes": len(match_wire), "prefill_request_bytes": len(prefill_wire)}
    return steps, {**got, **sizes}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.wire", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=100_000, help="prompt length")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--vocab-size", type=int, default=248_320,
                   help="ids are drawn below it (default: Qwen3.5's vocabulary)")
    p.add_argument("--repeats", type=int, default=15, help="timed runs per step; the best counts")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.tokens < 2 or args.page_size < 1 or args.repeats < 1:
        p.error("--tokens must be >= 2, --page-size and --repeats >= 1")

    steps, facts = turn_steps(args.tokens, args.page_size, args.vocab_size)
    rows, results = [], []
    for step in steps:
        seconds = best_seconds(step.run, args.repeats)
        rows.append([step.process, step.what, "yes" if step.before_first_token else "no",
                     seconds * 1e3])
        results.append({"process": step.process, "step": step.what,
                        "before_first_token": step.before_first_token, "ms": seconds * 1e3})
    ttft_ms = sum(r["ms"] for r in results if r["before_first_token"])
    rows.append(["all", "before the first token", "yes", ttft_ms])
    write_json(args.json, {"env": environment(), "args": vars(args), **facts,
                           "before_first_token_ms": ttft_ms, "results": results})
    print(f"{args.tokens}-token prompt, page size {args.page_size}, {facts['cached_tokens']} "
          f"tokens cached; MatchRequest {facts['match_request_bytes']} bytes, PrefillRequest "
          f"{facts['prefill_request_bytes']} bytes; best of {args.repeats}")
    print_table("host time of one turn's prompt traffic (ms)",
                ["process", "step", "before 1st token", "ms"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
