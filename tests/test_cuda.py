"""The same forward on a CUDA device (skipped where there is none; run by hand
on the GPU machine, see BENCHMARKS.md): logits against transformers on the CPU,
and a batch of mixed sequences through the offline engine."""
import pytest
import torch

from engine.batch import ForwardBatch, SequenceInput
from engine.cache import CacheShape, PagedKVCache
from engine.kv import make_format
from engine.llm import EngineConfig, OfflineEngine
from engine.loader import load_model
from engine.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_5"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_logits_match_transformers(tiny_hf_dir, family, dtype):
    directory, hf_model = tiny_hf_dir(family)
    loaded = load_model(str(directory), device="cuda", dtype=dtype, progress=False)
    ids = [(13 * i + 5) % 512 for i in range(50)]
    cache = PagedKVCache(loaded.config, CacheShape(16, 4, 2), "cuda", make_format("bf16", dtype=dtype))
    # prefill 40, then 10 single steps: both GDN forms and paged reads on the GPU
    out = [loaded.model(ForwardBatch.build([SequenceInput(tuple(ids[:40]), 0, tuple(range(13)), 1)],
                                           4, "cuda"), cache, all_logits=True)]
    for t in range(40, 50):
        out.append(loaded.model(ForwardBatch.build([SequenceInput((ids[t],), t, tuple(range(13)), 1)],
                                                   4, "cuda"), cache))
    ours = torch.cat(out).float().cpu()
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0]
    if dtype == torch.float32:
        torch.testing.assert_close(ours, ref, rtol=1e-3, atol=1e-3)
    else:
        assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
        assert (ours - ref).abs().max() < 0.1 * ref.abs().max()


def test_cuda_engine_matches_cpu_engine_greedy():
    params = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], list(range(30, 60))]
    results = []
    for device in ("cpu", "cuda"):
        loaded = load_model("tiny-qwen3.5", dtype=torch.float32, seed=3)  # same weights on both
        loaded.model.to(device)
        loaded.device = torch.device(device)
        engine = OfflineEngine(loaded, EngineConfig(max_batch=3, max_context=128))
        got = {i: [] for i in range(3)}
        for e in engine.generate(prompts, params):
            got[e.index].append(e.token_id)
        results.append(got)
    assert results[0] == results[1]


def test_worker_stream_reuses_the_memory_its_earlier_work_freed():
    """One WorkerStream per worker: the caching allocator serves a request's
    tensors from what the previous request on that stream freed (a new
    stream per request would reserve fresh memory every time)."""
    from engine.streams import WorkerStream

    def one_request(stream: WorkerStream) -> None:
        with stream.active():
            x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
            x.fill_(1)
            del x

    stream = WorkerStream("cuda", high_priority=False)
    one_request(stream)
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    for _ in range(3):
        one_request(stream)
    torch.cuda.synchronize()
    assert torch.cuda.memory_reserved() == reserved
    # the premise: what one stream freed, a new stream does not get
    for _ in range(2):
        one_request(WorkerStream("cuda", high_priority=False))
    torch.cuda.synchronize()
    assert torch.cuda.memory_reserved() >= reserved + 2 * (64 << 20)


@pytest.mark.parametrize("kv_format", ["int8", "rk4"])
def test_prefill_compiles_nothing_new_for_new_request_lengths(kv_format, monkeypatch):
    """Once prefills have run, prefills of other lengths after other cached
    prefixes reuse their compiled kernels: the sizes that change per request
    are not Triton specializations (engine/compiles.py; on the H200 an agent
    turn that met a new variant waited 1-5 s for it). Each job is cut as the
    router cuts it: a snapshot at the last page boundary before its end, left
    inside the chunk (the GDN part after it on the step kernels or fla). The
    warm-up's jobs (prefill/warmup.py) come first, its chunk of in-kernel
    dequantizing attention last; a chunk whose keys pass the dense workspace
    then compiles nothing either (a 260,000-token prompt waited 1.3-2.5 s at
    its 129th chunk before that job existed)."""
    from engine.chunking import snapshot_points
    from engine.compiles import CompileWatch
    from engine.kv.attention import paged_prefill_attention
    from prefill.runner import PrefillJob, run_prefill
    from prefill.warmup import paged_chunk_job, warm_up_jobs

    loaded = load_model("tiny-qwen3.5", device="cuda", dtype=torch.bfloat16, seed=5)
    cache = PagedKVCache(loaded.config, CacheShape(320, 16, 4), "cuda", make_format(kv_format))
    watch = CompileWatch().install()
    tokens = tuple((7 * i + 3) % 512 for i in range(5000))
    pages = tuple(range(300))
    # past 64 key tiles (4096 tokens at the tiny model's 64-key tiles) a
    # short batch's key splits stay at 64: below, each power of two of them
    # is a variant of its own, compiled once

    def prefill(start: int, end: int) -> None:
        snapshots = tuple((p, 1) for p in snapshot_points(start, end, 16))
        run_prefill(loaded.model, cache, PrefillJob("r", tokens[:end], start, pages, 0,
                                                    snapshots=snapshots), 64)

    for start, end in warm_up_jobs(4096, 16):
        prefill(start, end)
    with paged_prefill_attention():
        prefill(*paged_chunk_job(4096, 16, 64, 320 * 16))
    assert watch.take(), "the watch saw no compile during the warm-up"
    # then chunks of 49 (GDN parts 47 + 2), 47 (46 + 1), 64 (63 + 1) and 10,
    # 64 and 23 (21 + 2), 31 (30 + 1); the last past a 2K-key dense workspace
    chunks = [(4353, 4402), (4402, 4449), (4449, 4523), (4523, 4610), (4610, 4641), (4641, 4705)]
    for start, end in chunks:
        if start == 4641:
            monkeypatch.setenv("TANDEM_PREFILL_WORKSPACE_TOKENS", "2048")
        prefill(start, end)
        compiled = watch.take()
        assert not compiled, f"{end - start} new tokens after {start} compiled {compiled}"


@pytest.mark.parametrize("kv_format", ["int8", "rk4"])
def test_a_prefill_chunk_over_a_cached_prefix_never_waits_for_the_gpu(kv_format):
    """A chunk's batch indices and its forward make no stream sync: the host
    keeps queueing kernels while the GPU runs. Each sync drains the queue,
    then the GPU waits on the host's launches; on the H200 a 1.1K-token turn
    after 99K cached took 0.42 s against 0.31 s of kernels (BENCHMARKS.md,
    2026-12-02 11:39), when every GDN layer made a new cu_seqlens (two syncs
    a layer) and the first attention layer read the page tables back. The
    13:50 run found the last one: the dense workspace's metadata, a pageable
    upload (engine/uploads.py). torch's sync debug mode raises at the
    syncing line."""
    loaded = load_model("tiny-qwen3.5", device="cuda", dtype=torch.bfloat16, seed=5)
    page = 16
    cache = PagedKVCache(loaded.config, CacheShape(80, page, 2), "cuda", make_format(kv_format))
    ids = tuple((7 * i + 3) % 512 for i in range(1200))
    pages = tuple(range(-(-1200 // page)))
    loaded.model(ForwardBatch.build([SequenceInput(ids[:1000], 0, pages, 0)], page, "cuda"), cache)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        batch = ForwardBatch.build([SequenceInput(ids[1000:], 1000, pages, 0)], page, "cuda")
        logits = loaded.model(batch, cache)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not logits.float().isnan().any()
