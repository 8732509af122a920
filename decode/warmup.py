"""The decode worker's warm-up: before it serves, one short request runs
through the worker's own scheduler on scratch pages (a one-page prompt
prefilled here, then a few decode steps), so the first real request's first
step replays a captured CUDA graph instead of loading or compiling its
kernels and capturing one: on the H200 that step waited 0.47 s (12-02 14:15;
11 Triton kernels, `_rms_norm_kernel` 0.42 s). Its prompt is prefilled in
chunks of the decode steps' width, so the worker loads no prefill-only
kernels (fla-core's) it would never run again. Batch size 1, the one-user
case this engine is for: each other batch size captures its graph on first
use (the worker logs a step that waited for a compile). With speculation on,
the drafter and the verify graph at batch 1 warm up the same way, at the
full draft width (`warm_up_tokens`).
The caller runs it on the GPU only (off it nothing compiles or captures).
Every page and slot goes back to the store, whatever happens."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from decode.scheduler import DecodeScheduler, DecodeSequence
from engine.sampling import SamplingParams
from kvstore.client import StoreClient
from prefill.runner import PrefillJob, run_prefill

WARM_UP_ID = "decode-warm-up"
# a first token from the prefill, then steps: enough for a speculative step
# to draft, verify and run again
WARM_UP_TOKENS = 4
# a small store may be lent out to the prefill worker's own warm-up, which
# starts at the same time: wait for it this long, then give up (and serve)
CAPACITY_WAIT_S = 30.0


@dataclass(frozen=True)
class WarmedUp:
    seconds: float
    tokens: int  # the request's output, the prefill's token included
    drafted: int  # drafts its speculative steps verified (0: plain decoding)


def warm_up_tokens(spec) -> int:
    """The warm-up request's output length. With speculation, long enough for
    one step to draft k deep and verify all k: the first step after the
    prefill has no drafts (the decode worker never holds the prefill's last
    hidden state) and drafts are capped by the tokens left, so 4 tokens
    warmed a k=3 drafter one deep, and a real request's first full step
    compiled kernels while serving (1.1 s on the H200, BENCHMARKS.md 12-05)."""
    if not spec.enabled:
        return WARM_UP_TOKENS
    # the prefill's token, the plain step's, then k drafts and the target's own
    return max(WARM_UP_TOKENS, spec.num_draft_tokens + 3)


def warm_up(store: StoreClient, scheduler: DecodeScheduler,
            after_prefill: Callable[[], None] = lambda: None) -> WarmedUp:
    """Runs the warm-up request on pages and slots taken from the store and
    given back; `after_prefill` runs between its prefill and its steps (the
    worker reports its memory there, to tell the two apart)."""
    if scheduler.has_work:
        raise RuntimeError("the decode warm-up runs before the worker takes requests")
    info, cache = store.info, store.cache
    page = info.page_size
    spec = info.speculative
    tokens = warm_up_tokens(spec)
    # the prompt, the output, and the drafts a verify step writes past it
    draft = spec.num_draft_tokens + 1 if spec.enabled else 0
    hybrid = info.config.is_hybrid
    slots = 2 + info.spare_slots_per_sequence if hybrid else 0
    started = time.perf_counter()
    with store.scratch_sequence(page + tokens + draft, slots,
                                wait_s=CAPACITY_WAIT_S) as scratch:
        pages = scratch.pages
        state, boundary = scratch.slots[:2] if hybrid else (-1, -1)
        prompt = [(7 * i + 3) % info.config.vocab_size for i in range(page)]
        open_pages = cache.open_pages_for(scratch.open_pages, pages)
        try:
            first = run_prefill(store.model, cache,
                                PrefillJob(WARM_UP_ID, prompt, 0, pages, state,
                                           open_pages=scratch.open_pages),
                                _prefill_chunk(page), open_pages=open_pages)
            after_prefill()
            seq = DecodeSequence(
                request_id=WARM_UP_ID, prompt=prompt, output=[first.token_ids[0]],
                params=SamplingParams(max_new_tokens=tokens), pages=list(pages),
                state_slot=state, eos_token_ids=(), boundary_slot=boundary,
                spare_slots=list(scratch.slots[2:]), open_pages=open_pages)
            scheduler.add(seq)
            drafted = 0
            while scheduler.has_work:
                outs, _ = scheduler.step()
                drafted += sum(out.drafted for out in outs)
        finally:
            scheduler.abort(WARM_UP_ID)  # after a failed step; a no-op once it finished
    return WarmedUp(time.perf_counter() - started, len(seq.output), drafted)


def _prefill_chunk(page: int) -> int:
    """Chunks the fused GDN steps take, as the decode steps do: a longer one
    would run fla-core's chunked kernels, whose first call autotunes through
    Triton's benchmark and leaves its 256 MiB L2-flush buffer (and fla's
    temporaries) in this worker's reserve for good, for kernels it never
    runs again."""
    from engine.gdn_kernels import MAX_TOKENS

    return min(page, MAX_TOKENS)

