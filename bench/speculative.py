"""`python -m bench.speculative`: what speculation costs and buys.

verify   the target forward of k+1 tokens (with per-position GDN slots) vs a
         plain one-token decode step, batch 1, at a given context, on a
         (dummy) model shape; the goal for the 27B shape is <= 1.15x at k=3.
         Both replay CUDA graphs on a GPU (DecodeForward, VerifyForward);
         --no-cuda-graphs times the eager forwards.
tokens   tokens/s and mean accepted length with and without speculation on
         chat and code prompts (offline engine, greedy); --per-prompt also
         each prompt's. --prompts record (default): the 36 chat / 24 code
         held-out prompts the goal is judged on; six: the first six a side
         (the figure of record until 12-05, where one answer moves a side's
         mean by ~0.06); test: the 30 / 18 added on 12-05.
Prints a table last; --json writes the rows."""
from __future__ import annotations

import argparse
import json
import time

import torch

from engine.batch import ForwardBatch, SequenceInput
from engine.cache import CacheShape, PagedKVCache
from engine.kv import make_format
from engine.loader import load_model
from engine.speculative.prompts import HELD_OUT_CHAT, HELD_OUT_CODE, TEST_CHAT, TEST_CODE

# Held out from train-mtp's prompts (engine/speculative/prompts.py; a test checks).
CHAT, CODE = list(HELD_OUT_CHAT), list(HELD_OUT_CODE)
PROMPT_SETS = {"six": (CHAT, CODE), "test": (list(TEST_CHAT), list(TEST_CODE)),
               "record": (CHAT + list(TEST_CHAT), CODE + list(TEST_CODE))}


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


@torch.inference_mode()
def verify_ratio(model_name: str, device: str, context: int, ks, repeats: int,
                 cuda_graphs: bool | None = None) -> list[dict]:
    """The plain row is a decode step through DecodeForward, the verify rows a
    k+1-token forward through VerifyForward (the speculative decoder's), both
    replaying CUDA graphs on a GPU, so the ratio is what a step costs."""
    from engine.cuda_graphs import DecodeForward, VerifyForward

    loaded = load_model(model_name, device=device, progress=False)
    cfg, page = loaded.config, 16
    pages = -(-(context + 8) // page)
    cache = PagedKVCache(cfg, CacheShape(pages, page, 8), device,
                         make_format("bf16", dtype=loaded.dtype))
    table = tuple(range(pages))
    prompt = tuple(int(t) % cfg.vocab_size for t in range(context))
    for start in range(0, context, 512):  # fill the context
        seq = SequenceInput(prompt[start:start + 512], start, table, 0)
        loaded.model(ForwardBatch.build([seq], page, device), cache)
    plain_forward = DecodeForward(loaded.model, cache, context + 8, enabled=cuda_graphs)
    verify_forward = VerifyForward(loaded.model, cache, context + 8, enabled=cuda_graphs,
                                   pool_of=plain_forward)

    def timed(tokens: int) -> float:
        # position slots 0 (the input slot, as the decoder does), then 1..k
        slots = tuple(range(tokens)) if tokens > 1 and cfg.is_hybrid else ()
        seq = SequenceInput((1,) * tokens, context, table, 0, slots)
        batch = ForwardBatch.build([seq], page, device)
        run = plain_forward if tokens == 1 else verify_forward
        times = []
        for _ in range(repeats + 1):  # the first call warms up (and captures)
            cache.copy_state(0, 7)  # keep the slot's state for the next repeat
            _sync(device)
            t = time.perf_counter()
            run(batch)
            _sync(device)
            times.append(time.perf_counter() - t)
            cache.copy_state(7, 0)
        times = times[1:]
        return sorted(times)[len(times) // 2]

    plain = timed(1)
    graphs = {"graphs": plain_forward.enabled}
    rows = [{"bench": "verify", "model": model_name, "context": context, "k": 0,
             "ms": plain * 1e3, "ratio": 1.0, **graphs}]
    for k in ks:
        t = timed(k + 1)
        rows.append({"bench": "verify", "model": model_name, "context": context, "k": k,
                     "ms": t * 1e3, "ratio": t / plain, **graphs})
    errors = plain_forward.capture_errors + verify_forward.capture_errors
    if plain_forward.enabled and (not plain_forward.replays or not verify_forward.replays
                                  or errors):
        print(f"warning: graphs not replayed (decode {plain_forward.replays} replays, verify "
              f"{verify_forward.replays}): {errors}")
    return rows


def _accepted_length(before: dict, after: dict) -> float:
    """Tokens per target forward between two snapshots of spec_totals."""
    steps = after["steps"] - before["steps"]
    return (after["accepted"] - before["accepted"] + steps) / steps if steps else 1.0


def tokens_per_second(model_name, device, methods, ks, new_tokens,
                      per_prompt: bool = False, prompt_set: str = "record") -> list[dict]:
    from engine.llm import EngineConfig, OfflineEngine
    from engine.sampling import SamplingParams
    from engine.speculative import SpeculativeConfig

    loaded = load_model(model_name, device=device, progress=False)
    params = SamplingParams(temperature=0, max_new_tokens=new_tokens)
    rows = []
    chat, code = PROMPT_SETS[prompt_set]
    for kind, texts in (("chat", chat), ("code", code)):
        for method in methods:
            for k in (ks if method != "none" else [1]):
                spec = SpeculativeConfig(method, k)
                engine = OfflineEngine(loaded, EngineConfig(max_batch=1, speculative=spec))
                prompts = [engine.chat_prompt([{"role": "user", "content": t}]) for t in texts]
                engine.generate_ids(prompts[0], SamplingParams(temperature=0, max_new_tokens=4))
                engine.spec_totals = {key: 0 for key in engine.spec_totals}
                count, start, each = 0, time.perf_counter(), []
                for prompt in prompts:
                    before = dict(engine.spec_totals)
                    count += len(engine.generate_ids(prompt, params))
                    each.append(_accepted_length(before, engine.spec_totals))
                _sync(device)
                elapsed = time.perf_counter() - start
                rows.append({"bench": "tokens", "model": model_name, "prompts": kind,
                             "prompt_set": prompt_set, "prompt_count": len(texts),
                             "method": method, "k": k if method != "none" else 0,
                             "tok_s": count / elapsed,
                             "mean_accepted_length": engine.mean_accepted_length or 1.0,
                             **({"per_prompt": [round(a, 3) for a in each]}
                                if per_prompt else {})})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.speculative", description=__doc__)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--verify-model", default=None, help="e.g. qwen3.5-27b (skipped if omitted)")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--tokens-model", default=None, help="e.g. embedded (skipped if omitted)")
    p.add_argument("--methods", nargs="+", default=["none", "ngram", "mtp"])
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="time the verify bench's eager forwards instead of graph replays")
    p.add_argument("--per-prompt", action="store_true",
                   help="also each prompt's mean accepted length (tokens rows)")
    p.add_argument("--prompts", choices=sorted(PROMPT_SETS), default="record",
                   help="which held-out prompts the tokens bench answers (see above)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    rows = []
    if a.verify_model:
        rows += verify_ratio(a.verify_model, a.device, a.context, a.ks, a.repeats,
                             cuda_graphs=False if a.no_cuda_graphs else None)
    if a.tokens_model:
        rows += tokens_per_second(None if a.tokens_model == "embedded" else a.tokens_model,
                                  a.device, a.methods, a.ks, a.new_tokens, a.per_prompt,
                                  a.prompts)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    for r in rows:
        if r["bench"] == "verify":
            mode = "graphs" if r["graphs"] else "eager"
            print(f"verify {r['model']} ctx {r['context']} k={r['k']} ({mode}): "
                  f"{r['ms']:.2f} ms ({r['ratio']:.2f}x plain)")
        else:
            print(f"tokens {r['model']} {r['prompts']} ({r['prompt_set']}, {r['prompt_count']} "
                  f"prompts) {r['method']} k={r['k']}: "
                  f"{r['tok_s']:.1f} tok/s, mean accepted length {r['mean_accepted_length']:.2f}"
                  + (f" (by prompt {r['per_prompt']})" if "per_prompt" in r else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
