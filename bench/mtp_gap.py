"""`python -m bench.mtp_gap`: why the MTP head's benchmark acceptance
(bench/speculative.py, engine-measured) differs from train-mtp's held-out
estimate (engine/speculative/train.py `evaluate`).

On the 12 held-out prompts of bench/speculative.py (HELD_OUT_CHAT/CODE; with
--prompts dev the 36 of prompts.DEV_CHAT/CODE instead):
  * the greedy answer without speculation (offline engine, 96 tokens);
  * train.evaluate on Examples built exactly as train.make_examples does
    (prompt labels IGNORE) with the shipped head: per-depth accuracy and
    "expected mean accepted length" (1 + mean run of correct drafts over
    every answer position);
  * the same per-position draft chains (evaluate's dense depth-r attention)
    fed through a simulation of the real loop (start after the first answer
    token, draft k, keep the matching prefix + the target's token, jump on;
    draft_cap and EOS as the engine), "sim-dense";
  * the same loop with the head's attention as the engine runs it (a depth-r
    draft attends to depth-1 keys for earlier positions, then the chain's own
    earlier drafts), "sim-engine-kv";
  * the engine with --speculative mtp k=3: engine.mean_accepted_length, and
    its drafts compared with sim-engine-kv's at the same positions.
Prints one line per prompt set; CPU, about 6 minutes on 2 cores.

--corpus PATH (a train-mtp corpus, e.g. the one the shipped head was trained
on) instead runs evaluate and the two loop simulations on that corpus's
held-out greedy samples, split as train_head splits them
(--samples-per-prompt, --new-tokens as it was generated): what the
"expected mean accepted length" train-mtp printed becomes in the real loop.

--breakdown instead prints the first draft's accuracy on the answers by
where in the answer the drafted token stands and by its kind (a word's
start, the rest of a word, punctuation, a newline): where the head misses.
"""
from __future__ import annotations

import argparse

import torch

from engine.loader import load_model
from engine.speculative import train
from engine.speculative.prompts import DEV_CHAT, DEV_CODE, HELD_OUT_CHAT, HELD_OUT_CODE


def _answers(loaded, texts, new_tokens, spec=None):
    """(prompts, greedy answers, per-prompt (steps, accepted), drafts log) for texts."""
    from engine.llm import EngineConfig, OfflineEngine
    from engine.sampling import SamplingParams
    from engine.speculative import SpeculativeConfig

    config = EngineConfig(max_batch=1, speculative=spec or SpeculativeConfig())
    engine = OfflineEngine(loaded, config)
    prompts = [engine.chat_prompt([{"role": "user", "content": t}]) for t in texts]
    params = SamplingParams(temperature=0, max_new_tokens=new_tokens)
    drafts_log: list[list[tuple[int, list[int]]]] = []
    if engine.spec is not None:
        inner = engine.spec.draft

        def draft(seqs):
            inner(seqs)
            for s in seqs:
                if s.spec is not None and s.spec.drafts:
                    # (tokens so far, drafts for the next positions)
                    drafts_log[-1].append((len(s.prompt) + len(s.output), list(s.spec.drafts)))
        engine.spec.draft = draft
    answers, per_prompt = [], []
    for prompt in prompts:
        drafts_log.append([])
        engine.spec_totals = {key: 0 for key in engine.spec_totals}
        answers.append(engine.generate_ids(prompt, params))
        per_prompt.append(dict(engine.spec_totals))
    return prompts, answers, per_prompt, drafts_log


@torch.no_grad()
def chains(model, head, e: train.Example, depth: int, engine_kv: bool):
    """preds [depth, n0]: the depth-r draft of the chain starting at pair i
    (pair (h_i, token i+1) drafts token i+2; depth r is fed the true token
    i+r, as evaluate does: only full-prefix-correct chains matter); with
    engine_kv the head attends as the engine's drafts do (train.EngineKV)."""
    n0 = len(e.tokens) - depth
    drafts = train.chain_drafts(model, head, model.output_embedding.float(), e, depth, engine_kv)
    return torch.stack([d[:n0] for d in drafts])


def chain_labels(e: train.Example, depth: int) -> torch.Tensor:
    """[depth, n0]: the token the depth-r draft of chain i must equal (e.labels[i + r])."""
    n0 = len(e.tokens) - depth
    return torch.stack([e.labels[r:r + n0] for r in range(1, depth + 1)])


def corpus_gap(model, head, path: str, samples_per_prompt: int, k: int) -> None:
    corpus = train.Corpus.load(path)
    n = len(corpus.samples)
    held = max(n // 10 // samples_per_prompt, 1) * samples_per_prompt
    keep = [i for i in range(n - held, n) if corpus.greedy[i]]
    sub = train.Corpus([corpus.samples[i] for i in keep], [corpus.prompt_lengths[i] for i in keep],
                       [True] * len(keep))
    examples = train.make_examples(model, sub)
    stats = train.evaluate(model, head, model.output_embedding.detach().float(), examples, k)
    sims = {}
    for variant in ("dense", "engine_kv"):
        st = ac = 0
        for e, toks, plen in zip(examples, sub.samples, sub.prompt_lengths):
            preds = chains(model, head, e, k, variant == "engine_kv")
            s, c = train.speculation_steps(preds == chain_labels(e, k), plen, len(toks) - plen,
                                           k)
            st, ac = st + s, ac + c
        sims[variant] = (ac + st) / st
    print(f"corpus held-out ({len(keep)} greedy samples): evaluate expected length "
          f"{stats['expected_length']:.3f} (its loop {stats['loop_length']:.3f}), depth accuracy "
          f"{[round(x, 3) for x in stats['accuracy']]}; loop sim-dense {sims['dense']:.3f}, "
          f"sim-engine-kv {sims['engine_kv']:.3f}", flush=True)


def token_kind(text: str) -> str:
    """The kind of a drafted token's text: newline, punct, word-start (a
    leading space before letters or digits) or continuation (inside a word)."""
    if "\n" in text:
        return "newline"
    if text.strip() and not any(c.isalnum() for c in text):
        return "punct"
    return "word-start" if text.startswith(" ") else "continuation"


def _position_bucket(answer_index: int) -> str:
    for bound, name in ((4, "answer 0-3"), (16, "answer 4-15"), (48, "answer 16-47")):
        if answer_index < bound:
            return name
    return "answer 48+"


def breakdown(loaded, kind: str, texts, new_tokens: int) -> None:
    """Depth-1 draft accuracy (the dense chains, as evaluate computes them)
    on the greedy answers to `texts`, by answer position and token kind."""
    import collections

    model, head = loaded.model, loaded.model.mtp
    prompts, answers, _, _ = _answers(loaded, texts, new_tokens)
    corpus = train.Corpus([p + o for p, o in zip(prompts, answers)],
                          [len(p) for p in prompts], [True] * len(prompts))
    tally = collections.defaultdict(lambda: [0, 0])
    for e, prompt in zip(train.make_examples(model, corpus), prompts):
        labels = chain_labels(e, 1)[0]
        right = chains(model, head, e, 1, False)[0] == labels
        for i in range(len(prompt) - 1, right.shape[0]):  # drafts of answer tokens
            token = loaded.tokenizer.decode([int(labels[i])])
            for key in (_position_bucket(i + 2 - len(prompt)), token_kind(token)):
                tally[key][0] += int(right[i])
                tally[key][1] += 1
    rows = "; ".join(f"{key} {hit / n:.3f} of {n}" for key, (hit, n) in tally.items())
    print(f"{kind}: first-draft accuracy by {rows}", flush=True)


def main(argv=None) -> int:
    from engine.speculative import SpeculativeConfig

    ap = argparse.ArgumentParser(prog="python -m bench.mtp_gap", description=__doc__)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--corpus", default=None)
    ap.add_argument("--samples-per-prompt", type=int, default=2)
    ap.add_argument("--prompts", choices=("bench", "dev"), default="bench",
                    help="the benchmark's 12 prompts, or the 36 dev prompts (prompts.DEV_*) "
                         "that recipes are compared on, keeping the benchmark's for the test")
    ap.add_argument("--breakdown", action="store_true",
                    help="only the first draft's accuracy by answer position and token kind")
    a = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    loaded = load_model(None, device="cpu", progress=False)
    model, head = loaded.model, loaded.model.mtp
    assert head is not None, "no MTP head loaded"
    lm = model.output_embedding.detach().float()
    if a.corpus:
        corpus_gap(model, head, a.corpus, a.samples_per_prompt, a.k)
        return 0
    sets = ((("chat", HELD_OUT_CHAT), ("code", HELD_OUT_CODE)) if a.prompts == "bench" else
            (("dev chat", DEV_CHAT), ("dev code", DEV_CODE)))
    if a.breakdown:
        for kind, texts in sets:
            breakdown(loaded, kind, texts, a.new_tokens)
        return 0
    for kind, texts in sets:
        prompts, answers, _, _ = _answers(loaded, texts, a.new_tokens)
        _, spec_answers, totals, drafts_log = _answers(
            loaded, texts, a.new_tokens, SpeculativeConfig("mtp", a.k))
        same = sum(x == y for x, y in zip(answers, spec_answers))
        corpus = train.Corpus([p + o for p, o in zip(prompts, answers)],
                              [len(p) for p in prompts], [True] * len(prompts))
        examples = train.make_examples(model, corpus)
        stats = train.evaluate(model, head, lm, examples, a.k)
        sims = {}
        agree = [0, 0]
        for variant in ("dense", "engine_kv"):
            st = ac = 0
            for j, e in enumerate(examples):
                preds = chains(model, head, e, a.k, variant == "engine_kv")
                labels = chain_labels(e, a.k)
                s, c = train.speculation_steps(preds == labels, len(prompts[j]), len(answers[j]),
                                               a.k)
                st, ac = st + s, ac + c
                if variant == "engine_kv":  # the engine's drafts vs this simulation's
                    for length, drafts in drafts_log[j]:
                        i = length - 2
                        if i >= preds.shape[1]:
                            continue
                        for r, d in enumerate(drafts):
                            agree[0] += int(preds[r, i]) == d
                            agree[1] += 1
                            # the simulation feeds depth r+1 the true token: compare while
                            # the engine's draft was that token
                            if d != int(labels[r, i]):
                                break
            sims[variant] = (ac + st) / st
        t = {key: sum(p[key] for p in totals) for key in totals[0]}
        engine_len = (t["accepted"] + t["steps"]) / t["steps"]
        print(f"{kind}: evaluate expected length {stats['expected_length']:.3f} (its loop "
              f"{stats['loop_length']:.3f}), depth accuracy "
              f"{[round(x, 3) for x in stats['accuracy']]}; loop sim-dense {sims['dense']:.3f}, "
              f"sim-engine-kv {sims['engine_kv']:.3f}; engine {engine_len:.3f} "
              f"({t['steps']} steps); spec output == plain {same}/{len(texts)}; engine drafts "
              f"== sim-engine-kv drafts {agree[0]}/{agree[1]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
