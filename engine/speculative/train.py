"""`tandem train-mtp`: train an MTP head for a model that ships none, by
self-distillation on text the base model itself generates.

Data: the base model answers the prompts of prompts.py (the first sample
of each prompt greedy, as speculation will see it, the others sampled at
temperature 0.8 for variety); the corpus can be saved and reused. For every
answer position p of that text the label of the pair (h_p, token p+1) is the
base model's own greedy choice at position p+1, i.e. what greedy speculation
must draft to be accepted (with soft_targets off: cross-entropy on the
base's greedy tokens, exactly the greedy acceptance criterion). The default
`soft_targets` trains on the base's whole distribution instead (recomputed
from the stored final hidden, so nothing more is stored): more signal per
position, as distillation for speculative decoding usually prefers; with 8
packed samples a step it beat greedy labels on one sample a step on the
H200 (12-02 14:18, BENCHMARKS.md). Prompt
positions carry no label: drafting starts after the prompt, and a fixed chat
template is so easy to predict that it inflated the first head's held-out
accuracy (0.57 with the template, 0.28-0.55 on answers alone).

The head is unrolled `depth` steps as it runs when drafting (step r feeds the
head's own output at p as the hidden of the pair at p+1), with losses
weighted 1, 1/2, 1/4, ... so drafts 2 and 3 are trained too. The decoder
layer starts as a copy of the base model's last layer and fc as
[0 | identity], so training starts from "predict like the last layer".

A step trains on `batch_samples` samples packed into one sequence
(pack_examples; the H200 ran ~60 steps/s on one sample of ~260 tokens, far
from its compute). The head's attention in training is dense causal attention over the
sequence's pairs at one unroll depth; when drafting, the pairs of depth r
attend to depth-1 keys for earlier positions. This is the usual approximation.
"""
from __future__ import annotations

import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from engine.loader import LoadedModel
from engine.model import CausalLM, DecoderLayer, MTPHead
from engine.speculative.prompts import (DEV_CHAT, DEV_CODE, HELD_OUT_CHAT, HELD_OUT_CODE,
                                        extract_question, question_requests, training_prompts,
                                        varied_prompts)



# a head's decoder layers at most: each adds a layer's compute to every draft
MAX_HEAD_LAYERS = 4


@dataclass(frozen=True)
class TrainConfig:
    samples_per_prompt: int = 2
    new_tokens: int = 96
    depth: int = 3
    lr: float = 1e-3
    time_budget_s: float = 600.0
    seed: int = 0
    max_batch: int = 16
    max_prompts: int | None = None  # None: every prompt of prompts.py
    corpus_path: str | None = None  # a cache of answers by prompt (generate_corpus)
    max_steps: int | None = None  # stop early (tests); the time budget still applies
    # questions the model writes itself (prompts.question_requests), answered
    # beside the built-in prompts: phrasing the fixed templates do not have
    self_instruct: int = 0
    # naturally phrased prompts of many shapes (prompts.varied_prompts),
    # answered beside the others (after them: the held-out tenth is theirs)
    varied: int = 0
    # samples packed into one sequence per optimizer step (pack_examples);
    # with soft_targets, the shipped head's recipe: on the H200 (12-02 14:18)
    # 8 packed samples on soft targets reached 1.51 chat / 1.82 code in 150 s
    # where one sample on hard labels reached 1.41 / 1.77 in 180 s
    batch_samples: int = 8
    # targets: the base's greedy token (cross-entropy), or its whole
    # distribution over the loss vocabulary (soft_targets)
    soft_targets: bool = True
    # the soft targets' temperature: softmax(base logits / T). Greedy
    # acceptance needs only the base's argmax, so T < 1 spends less of a
    # one-layer head on the distribution's tail (T -> 0 is the greedy loss)
    target_temperature: float = 1.0
    # every N optimizer steps, measure the head on the dev prompts' greedy
    # answers (prompts.DEV_CHAT / DEV_CODE, dev_new_tokens long, as
    # bench.mtp_gap --prompts dev reads them) and return the best head seen,
    # not the last: the held-out tenth is the corpus's own distribution and
    # read 2.09 where the dev chat read 1.83 (12-03 22:42). 0: off
    dev_every_steps: int = 0
    dev_new_tokens: int = 96
    # a head file (an earlier train-mtp's output) to continue training instead
    # of starting from init_head: one device call holds at most ~470 s of
    # training, and the 12-04 head's dev chat was still rising when it ended
    init_head_path: str | None = None
    # processes answering the missing prompts at once, each with its own copy
    # of the model: the engine's batch loop spends ~0.3 ms of Python per
    # sequence and step (the H200 answered 2,400 tok/s at batch 128, 3,040 at
    # 256), so one process leaves the GPU mostly idle
    gen_processes: int = 1
    # the head's decoder layers (Qwen3.5's mtp_num_hidden_layers); None: as
    # many as the --init-head file has, else 1. A head file with fewer grows:
    # its layers are kept and each new one starts as the base's last layer
    # with its two output projections zeroed, an identity on the residual
    # stream, so training starts from exactly the file's head
    head_layers: int | None = None
    # the learning rate of the parameters the init_head file holds, as a
    # fraction of lr; 0 freezes them, so a grown head trains its new layers
    # alone and starts from (and can only add to) a head at its plateau:
    # continuing head D lost dev chat at lr 3e-4 (12-04 21:27, 2.021 -> 1.922)
    init_lr_scale: float = 1.0
    # the unroll's attention: as the engine drafts (EngineKV: a depth-r draft
    # reads the depth-1 keys of verified tokens and its own chain's), or the
    # dense unroll every head up to 12-05 trained with (depth-r keys of the
    # chains before it, which the engine never holds)
    engine_kv: bool = False

    def __post_init__(self) -> None:
        if self.gen_processes < 1:
            raise ValueError(f"train-mtp: --gen-processes must be >= 1, got {self.gen_processes}")
        if self.depth < 1 or self.new_tokens < 8 or self.samples_per_prompt < 1 \
                or self.max_batch < 1 or (self.max_prompts is not None and self.max_prompts < 10) \
                or self.self_instruct < 0 or self.batch_samples < 1 or self.varied < 0 \
                or self.dev_every_steps < 0 or self.dev_new_tokens < 8:
            raise ValueError(f"train-mtp: bad settings {self}")
        if self.head_layers is not None and not 1 <= self.head_layers <= MAX_HEAD_LAYERS:
            raise ValueError(f"train-mtp: --head-layers must be in 1..{MAX_HEAD_LAYERS}, got "
                             f"{self.head_layers}")
        if not 0.0 <= self.init_lr_scale <= 1.0:
            raise ValueError(f"train-mtp: --init-lr-scale must be in [0, 1], got "
                             f"{self.init_lr_scale}")
        if self.init_lr_scale != 1.0 and not self.init_head_path:
            raise ValueError("train-mtp: --init-lr-scale scales the parameters of --init-head's "
                             "file: give --init-head FILE, or drop --init-lr-scale")
        if not 0.0 < self.target_temperature <= 4.0:
            raise ValueError(f"train-mtp: the target temperature must be in (0, 4], got "
                             f"{self.target_temperature}")


def _log(message: str) -> None:
    print(f"train-mtp: {message}", file=sys.stderr, flush=True)


_PARTIAL = ".partial"


def _save_whole(obj, path: str) -> None:
    """torch.save through a side file and a rename: a run killed while saving
    (a device call's limit) leaves the last whole file, never a torn one."""
    import os

    torch.save(obj, path + _PARTIAL)
    os.replace(path + _PARTIAL, path)


@dataclass
class Corpus:
    """Token lists (prompt + answer), where each answer starts, and which
    answers are greedy (the text speculation is measured on)."""
    samples: list[list[int]]
    prompt_lengths: list[int]
    greedy: list[bool]

    def save(self, path: str) -> None:
        """One flat token tensor (uint16 where every id fits) and the lengths:
        2 bytes a token for the embedded model, where lists of ints pickled to
        2.8 and took 12.7 s to load on the 2-core CPU (85,470 samples). The
        files travel to the device in 15 MiB parts, so size is calls."""
        flat = [t for sample in self.samples for t in sample]
        dtype = torch.uint16 if max(flat, default=0) < 2 ** 16 else torch.int32
        _save_whole({"tokens": torch.tensor(flat, dtype=dtype),
                     "lengths": torch.tensor([len(s) for s in self.samples], dtype=torch.int64),
                     "prompt_lengths": torch.tensor(self.prompt_lengths, dtype=torch.int64),
                     "greedy": torch.tensor(self.greedy, dtype=torch.bool)}, path)

    @classmethod
    def load(cls, path: str) -> "Corpus":
        data = torch.load(path)
        if "tokens" not in data:  # written before 2026-12-04 20:00: lists
            return cls(data["samples"], data["prompt_lengths"], data["greedy"])
        flat = data["tokens"].to(torch.int64).tolist()
        ends = data["lengths"].cumsum(0).tolist()
        samples = [flat[end - n:end] for end, n in zip(ends, data["lengths"].tolist())]
        return cls(samples, data["prompt_lengths"].tolist(), data["greedy"].tolist())


def generate_corpus(loaded: LoadedModel, cfg: TrainConfig) -> Corpus:
    """Prompt + the base model's answer, one token list per sample.

    A corpus file is a cache keyed by (prompt tokens, sample number): samples
    already in it are reused, only the missing ones are generated, and the
    file is rewritten with both. Adding prompts to a recipe then costs only
    their answers (the H200 took 174 s for 2,614 answers of 160 tokens, a
    third of a device call). Sampled answers of a prompt first answered in
    another run keep that run's seeds."""
    from engine.llm import EngineConfig, OfflineEngine
    from engine.sampling import SamplingParams

    cached = _cached_answers(cfg.corpus_path)
    leftovers = _leftover_shards(cfg.corpus_path)
    cached.update(leftovers)
    engine = OfflineEngine(loaded, EngineConfig(max_batch=cfg.max_batch,
                                                max_context=_context_for(cfg.new_tokens)))
    texts = corpus_texts(engine, cfg)
    wanted: list[tuple[tuple[int, ...], int]] = []  # (prompt, sample number)
    missing, params = [], []
    for i, text in enumerate(texts):
        prompt = tuple(engine.chat_prompt([{"role": "user", "content": text}]))
        for s in range(cfg.samples_per_prompt):
            wanted.append((prompt, s))
            if (prompt, s) in cached:
                continue
            missing.append((prompt, s))
            # greedy text is what drafts are verified against; sampled text adds variety
            params.append(SamplingParams(temperature=0.0 if s == 0 else 0.8, top_p=0.95,
                                         seed=cfg.seed * 1000 + i * 10 + s,
                                         max_new_tokens=cfg.new_tokens))
    if cached:
        _log(f"{len(wanted) - len(missing)} of {len(wanted)} samples read from {cfg.corpus_path}")
    in_processes = cfg.gen_processes > 1 and len(missing) > cfg.max_batch
    if in_processes:
        cached.update(_answered_in_processes(loaded, cfg, missing, params))
    else:
        def save(answers: dict) -> None:  # the whole cache, every few batches
            if cfg.corpus_path:
                _as_corpus({**cached, **answers}, [*cached, *answers]).save(cfg.corpus_path)
        cached.update(_answered_here(engine, cfg, missing, params, save))
    # answers from other processes or a stopped run's shards are not in the
    # file yet (this process's own were saved as they came)
    if cfg.corpus_path and ((in_processes and missing) or leftovers):
        _as_corpus(cached, list(cached)).save(cfg.corpus_path)
        for shard_file in _shard_files(cfg.corpus_path):  # merged into the corpus file now
            shard_file.unlink()
    return _as_corpus(cached, wanted)


def _answered_here(engine, cfg: TrainConfig, missing: list, params: list, save,
                   label: str = "") -> dict:
    """{(prompt, sample number): answer} for `missing`, generated in this
    process; `save(answers so far)` runs every few batches, so that a run
    stopped early (a device call's limit, a slow CPU) keeps what it had."""
    answers: dict = {}
    started, tokens = time.monotonic(), 0
    every = _SAVE_EVERY_BATCHES * cfg.max_batch
    for lo in range(0, len(missing), every):
        chunk = missing[lo:lo + every]
        outputs = _generated(engine, [list(p) for p, _ in chunk], params[lo:lo + every])
        answers.update(zip(chunk, outputs))
        tokens += sum(map(len, outputs))
        _log(f"{label}generated {tokens} tokens for {lo + len(chunk)} of {len(missing)} "
             f"missing samples in {time.monotonic() - started:.0f} s")
        save(answers)
    return answers


def _shard_path(corpus_path: str | None, shard: int) -> str | None:
    return f"{corpus_path}.shard{shard}" if corpus_path else None


def _shard_files(corpus_path: str | None) -> list[Path]:
    if not corpus_path:
        return []
    return sorted(p for p in Path(corpus_path).parent.glob(Path(corpus_path).name + ".shard*")
                  if not p.name.endswith(_PARTIAL))


def _leftover_shards(corpus_path: str | None) -> dict:
    """Answers a stopped multi-process run left in its shard files (which
    keep each answer's sample number: a shard may hold a prompt's second
    sample without its first)."""
    found: dict = {}
    for path in _shard_files(corpus_path):
        found.update(dict(torch.load(path)))
    return found


def _answered_in_processes(loaded: LoadedModel, cfg: TrainConfig, missing: list,
                           params: list) -> dict:
    """`missing` dealt round-robin to cfg.gen_processes processes, each with
    its own copy of the model (spawned: CUDA cannot be forked); their shard
    files are merged and removed once every process has ended."""
    import multiprocessing
    import os

    ctx = multiprocessing.get_context("spawn")
    n = cfg.gen_processes
    threads = max(1, (os.cpu_count() or 1) // n)
    workers = []
    for shard in range(n):
        # without a corpus file a temporary one carries the answers back
        path = _shard_path(cfg.corpus_path, shard) or _temporary_path(f"shard{shard}.pt")
        work = (missing[shard::n], params[shard::n])
        w = ctx.Process(target=_answer_shard, name=f"train-mtp-shard{shard}",
                        args=(_reload_spec(loaded), str(loaded.device), cfg, work, path, shard,
                              threads))
        w.start()
        workers.append((w, path))
    answers, failed = {}, []
    for w, path in workers:
        w.join()
        if os.path.exists(path):
            answers.update(dict(torch.load(path)))
        if w.exitcode != 0:
            failed.append(f"{w.name} exit code {w.exitcode}")
    if failed:  # the shard files stay: a rerun reads what they hold
        raise RuntimeError(f"train-mtp: answering processes failed ({', '.join(failed)}); "
                           f"{len(answers)} of {len(missing)} answers were kept in the shard files")
    for _, path in workers:
        if os.path.exists(path):
            os.remove(path)
        if not cfg.corpus_path:  # the temporary directory too
            os.rmdir(os.path.dirname(path))
    return answers


def _reload_spec(loaded: LoadedModel) -> str:
    """What load_model takes to build this model again in another process
    (a dummy shape comes back from its default seed, as the tests load it)."""
    return loaded.source.removeprefix("dummy:")


def _temporary_path(name: str) -> str:
    import tempfile

    return str(Path(tempfile.mkdtemp(prefix="train-mtp-")) / name)


def _answer_shard(source: str, device: str, cfg: TrainConfig, work: tuple[list, list],
                  path: str, shard: int, threads: int) -> None:
    """One answering process: its own model copy, its share of the prompts."""
    from engine.llm import EngineConfig, OfflineEngine
    from engine.loader import load_model

    torch.set_num_threads(threads)
    loaded = load_model(source, device=device, progress=False, weights="bf16",
                        trained_head=False)
    engine = OfflineEngine(loaded, EngineConfig(max_batch=cfg.max_batch,
                                                max_context=_context_for(cfg.new_tokens)))
    missing, params = work
    _answered_here(engine, cfg, missing, params,
                   lambda answers: _save_whole(list(answers.items()), path),
                   label=f"shard {shard}: ")


def corpus_texts(engine, cfg: TrainConfig) -> list[str]:
    """The prompts' texts, in corpus order: the built-in ones, the model's own
    questions, then the varied ones (so the held-out tenth is theirs)."""
    texts = training_prompts()[:cfg.max_prompts]
    if cfg.self_instruct:
        texts += self_instructed_prompts(engine, cfg.self_instruct, cfg.seed,
                                         exclude={*texts, *HELD_OUT_CHAT, *HELD_OUT_CODE,
                                                  *DEV_CHAT, *DEV_CODE})
    if cfg.varied:
        known = set(texts)
        texts += [t for t in varied_prompts(cfg.varied, cfg.seed) if t not in known]
    return texts


Answers = dict[tuple[tuple[int, ...], int], list[int]]
_SAVE_EVERY_BATCHES = 4  # generate_corpus saves the cache after this many full batches


def _cached_answers(path: str | None) -> Answers:
    """{(prompt tokens, sample number): answer tokens} from a corpus file, if any."""
    answers: Answers = {}
    if not path or not Path(path).exists():
        return answers
    corpus = Corpus.load(path)
    for tokens, n in zip(corpus.samples, corpus.prompt_lengths):
        prompt = tuple(tokens[:n])
        s = 0
        while (prompt, s) in answers:
            s += 1
        answers[(prompt, s)] = tokens[n:]
    return answers


def _as_corpus(answers: Answers, keys: list[tuple[tuple[int, ...], int]]) -> Corpus:
    return Corpus([list(p) + answers[(p, s)] for p, s in keys], [len(p) for p, _ in keys],
                  [s == 0 for _, s in keys])


def self_instructed_prompts(engine, count: int, seed: int, exclude: set[str],
                            new_tokens: int = 48) -> list[str]:
    """Up to `count` distinct questions the model writes when asked for one
    (prompts.question_requests, sampled at temperature 1.0), none of them in
    `exclude` (the built-in and the benchmark's held-out prompts)."""
    started = time.monotonic()
    # replies that are not one clean question are dropped: ask twice as often
    replies = written_replies(engine, 2 * count, seed, new_tokens)
    questions = pick_questions(replies, count, exclude)
    _log(f"self-instruct: {len(questions)} questions kept from {len(replies)} replies in "
         f"{time.monotonic() - started:.0f} s")
    return questions


def written_replies(engine, asks: int, seed: int, new_tokens: int) -> list[str]:
    """The model's replies to the first `asks` question requests (cycled)."""
    from engine.sampling import SamplingParams

    requests = question_requests()
    texts = [requests[i % len(requests)] for i in range(asks)]
    prompts = [engine.chat_prompt([{"role": "user", "content": t}]) for t in texts]
    params = [SamplingParams(temperature=1.0, top_p=0.95, seed=seed * 100003 + i,
                             max_new_tokens=new_tokens) for i in range(asks)]
    return [engine.tokenizer.decode(reply, skip_special_tokens=True)
            for reply in _generated(engine, prompts, params)]


def _generated(engine, prompts: list[list[int]], params: list) -> list[list[int]]:
    """The tokens the engine generates for each prompt, in prompt order."""
    outputs: list[list[int]] = [[] for _ in prompts]
    for event in engine.generate(prompts, params):
        outputs[event.index].append(event.token_id)
    return outputs


def pick_questions(replies: list[str], count: int, exclude: set[str]) -> list[str]:
    """The first `count` distinct questions in `replies` that are not in `exclude`."""
    questions: dict[str, None] = {}  # insertion-ordered, distinct
    for reply in replies:
        q = extract_question(reply)
        if q is not None and q not in exclude:
            questions.setdefault(q)
    return list(questions)[:count]


def _context_for(new_tokens: int) -> int:
    """Room for the longest chat prompt plus the answer, in whole 256-token steps."""
    return -(-(new_tokens + 128) // 256) * 256


class SampleFeatures(NamedTuple):
    hidden: torch.Tensor  # [T, H], the normed final hidden, in the model's dtype
    greedy: torch.Tensor  # [T], the base's greedy choice at each position
    # [T, S, H]: the residual streams after the layers asked for, or None
    streams: torch.Tensor | None


@torch.no_grad()
def base_features(model: CausalLM, samples: list[list[int]],
                  stream_layers: tuple[int, ...] = ()) -> list[SampleFeatures]:
    """Per sample: its normed final hidden, the base's greedy choices and,
    with `stream_layers`, the residual streams after those layers (in that
    order; CausalLM.forward's `streams`), from one prefill forward of all of
    them (a forward a sample cost the H200 ~250 s of a 600 s call for 8,235
    samples). Everything stays in the model's dtype, bf16 on a GPU: the
    149,470-sample corpus of 12-04 is 28.4 M tokens, 33 GB so against 65 in
    fp32; the loss widens each step's rows (`widened`)."""
    from engine.batch import ForwardBatch, SequenceInput
    from engine.cache import CacheShape, PagedKVCache
    from engine.kv import make_format

    page = 16
    device = model.output_embedding.device
    seqs, first = [], 0
    for slot, tokens in enumerate(samples):
        pages = -(-len(tokens) // page)
        seqs.append(SequenceInput(tuple(tokens), 0, tuple(range(first, first + pages)), slot))
        first += pages
    cache = PagedKVCache(model.config, CacheShape(first, page, len(samples)), device,
                         make_format("bf16", dtype=model.output_embedding.dtype))
    batch = ForwardBatch.build(seqs, page, device)
    streams = dict.fromkeys(stream_layers) if stream_layers else None
    logits, hidden = model(batch, cache, all_logits=True, return_hidden=True, streams=streams)
    stacked = torch.stack([streams[j] for j in stream_layers], 1) if streams else None
    # copies, not views: nothing here says the forward's output is not a workspace
    return [SampleFeatures(hidden[lo:hi].clone(), logits[lo:hi].argmax(dim=-1),
                           None if stacked is None else stacked[lo:hi].clone())
            for lo, hi in zip(batch.offsets, batch.offsets[1:])]


def widened(hidden: torch.Tensor) -> torch.Tensor:
    """Features in fp32 for the head, which trains in fp32 (base_features
    keeps them in the model's dtype; widening is exact)."""
    return hidden.float()


def dense_layer(layer: DecoderLayer, x: torch.Tensor, cos_sin, rotary,
                mask: torch.Tensor | None = None, context: tuple | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A full-attention DecoderLayer over one sequence without a cache
    (training); mask [T, T] bool replaces the causal mask (packed samples).
    context (keys, values, visible): keys and values [C, kv_heads, D] written
    before, which row i reads where visible[i] [T, C] holds; with it each
    row reads its own key besides them and no other row's (EngineKV).
    Returns the layer's output and its rotated keys and its values."""
    attn = layer.self_attn
    t = x.shape[0]
    q, gate, k, v = attn.project(layer.input_layernorm(x))
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = rotary.apply(q, *cos_sin), rotary.apply(k, *cos_sin)
    keys, values = k, v
    if context is not None:
        earlier_k, earlier_v, visible = context
        keys, values = torch.cat((earlier_k, k)), torch.cat((earlier_v, v))
        mask = torch.cat((visible, torch.eye(t, dtype=torch.bool, device=x.device)), 1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1),
                                         values.transpose(0, 1),
                                         attn_mask=mask, is_causal=mask is None,
                                         scale=attn.head_dim ** -0.5, enable_gqa=True)
    out = out.transpose(0, 1).reshape(t, -1)
    if gate is not None:
        out = out * torch.sigmoid(gate.reshape(t, -1))
    x = x + attn.o_proj(out)
    return x + layer.mlp(layer.post_attention_layernorm(x)), k, v


class EngineKV:
    """The head's own KV as the engine holds it while drafting, for an
    unroll that is to see what the engine sees (bench.mtp_gap's
    sim-engine-kv; the engine's drafts equal it). The depth-1 pass over every
    pair is the catch-up the engine runs on verified tokens: its keys and
    values are the bank. The depth-r draft of the chain started at pair i
    then reads the bank up to pair i (of its own sample) and its own chain's
    depth-2..r entries, where the dense unroll lets it read the depth-r
    entries of the chains started before it, which the engine never holds.

    One instance serves one unroll, depths in order (head_forward's `kv`)."""

    def __init__(self, layers: int) -> None:
        self.banks: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * layers
        self.chains: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(layers)]

    def context(self, layer: int, mask: torch.Tensor | None, n: int) -> tuple | None:
        """What layer's n rows read besides their own key: None at depth 1
        (dense_layer's causal mask, the bank being written); mask [n, n] is
        the depth's own causal mask (packed samples), None: one sample."""
        bank = self.banks[layer]
        if bank is None:
            return None
        width = bank[0].shape[0]
        if mask is None:
            visible = torch.ones(n, width, dtype=torch.bool, device=bank[0].device).tril()
        else:
            visible = F.pad(mask, (0, width - n))  # pair i's sample and pairs up to i
        own = torch.eye(n, dtype=torch.bool, device=visible.device)
        keys = [bank[0], *(k[:n] for k, _ in self.chains[layer])]
        values = [bank[1], *(v[:n] for _, v in self.chains[layer])]
        return torch.cat(keys), torch.cat(values), torch.cat([visible] + [own] * len(
            self.chains[layer]), 1)

    def keep(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.banks[layer] is None:
            self.banks[layer] = (k, v)
        else:
            self.chains[layer].append((k, v))


def head_forward(model: CausalLM, head: MTPHead, hidden: torch.Tensor, next_tokens: torch.Tensor,
                 positions: torch.Tensor, mask: torch.Tensor | None = None,
                 kv: EngineKV | None = None) -> torch.Tensor:
    """The head's normed output for pairs (hidden[i], next_tokens[i]) at
    positions; mask: which pairs each pair attends to (None: causal); kv:
    attend as the engine's drafts do instead (EngineKV)."""
    emb = model.model.embed_tokens(next_tokens).float()
    x = head.fc(torch.cat((head.pre_fc_norm_embedding(emb), head.pre_fc_norm_hidden(hidden)), -1))
    cos_sin = model.rotary.cos_sin(positions, x.dtype)
    for i, layer in enumerate(head.layers):
        context = kv.context(i, mask, x.shape[0]) if kv is not None else None
        x, k, v = dense_layer(layer, x, cos_sin, model.rotary, mask if context is None else None,
                              context)
        if kv is not None:
            kv.keep(i, k, v)
    return head.norm(x)


def init_head(model: CausalLM, layers: int = 1) -> MTPHead:
    """fc = [0 | I], decoder layers = copies of the base's last `layers`
    full-attention layers in their order, norm = base norm: the head starts
    as "run the last layers again"."""
    from dataclasses import replace

    sources = model.config.attention_layers[-layers:]
    if len(sources) < layers:
        raise ValueError(f"a {layers}-layer head needs {layers} full-attention layers to start "
                         f"from; the base model has {len(sources)}")
    config = replace(model.config, mtp_num_layers=layers)
    head = MTPHead(config).float()
    with torch.no_grad():
        h = config.hidden_size
        head.fc.weight.zero_()
        head.fc.weight[:, h:] = torch.eye(h)
        for norm in (head.pre_fc_norm_embedding, head.pre_fc_norm_hidden):
            norm.weight.fill_(0.0 if norm.zero_centered else 1.0)
        for layer, source in zip(head.layers, sources):
            base = model.model.layers[source]
            layer.load_state_dict({k: v.float() for k, v in base.state_dict().items()})
        head.norm.weight.copy_(model.model.norm.weight.float())
    return head


def head_from_file(model: CausalLM, path: str, layers: int | None = None) -> MTPHead:
    """The head a train-mtp file holds (checked against this base model), in
    fp32 and the module layout training uses, to continue training it; with
    `layers` more than the file's, grown by identity layers after its own
    (TrainConfig.head_layers)."""
    from engine.speculative.heads import head_layer_count, read_head
    from engine.weights.merge import merge_checkpoint, merge_groups

    tensors = read_head(Path(path), model.config, torch.float32)
    held = head_layer_count(tensors)
    layers = held if layers is None else layers
    if layers < held:
        raise ValueError(f"{path} holds a {held}-layer head; it cannot shrink to {layers} "
                         f"(--head-layers)")
    head = init_head(model, held)
    merge_checkpoint(tensors, merge_groups(head, prefix="mtp."), torch.float32, str(path))
    head.load_state_dict({name.removeprefix("mtp."): t for name, t in tensors.items()})
    if layers == held:
        return head
    grown = init_head(model, layers)
    missing, unexpected = grown.load_state_dict(head.state_dict(), strict=False)
    new = tuple(f"layers.{i}." for i in range(held, layers))
    assert not unexpected and all(name.startswith(new) for name in missing), (missing, unexpected)
    for layer in grown.layers[held:]:
        _make_identity(layer)
    return grown


@torch.no_grad()
def _make_identity(layer: DecoderLayer) -> None:
    """Zero the projections that write into the residual stream (attention's
    o_proj, the MLP's down_proj): the layer then passes its input through
    unchanged, and both get gradients from the first step on."""
    layer.self_attn.o_proj.weight.zero_()
    layer.mlp.down_proj.weight.zero_()


IGNORE = -100  # cross_entropy's ignore_index: labels inside the prompt


@dataclass
class Example:
    tokens: torch.Tensor  # [T]
    hidden: torch.Tensor  # [T, H], the base's normed final hidden
    labels: torch.Tensor  # [T], the base's greedy choice; IGNORE inside the prompt
    greedy: bool          # the answer is the base's greedy text
    # [T, S, H]: the base's residual streams after the layers make_examples
    # was asked for (its stream_layers), in the model's dtype; None: none asked
    streams: torch.Tensor | None = None
    # packed samples (pack_examples): each row's sample, and its position in
    # that sample; None for one sample
    samples: torch.Tensor | None = None
    positions: torch.Tensor | None = None


def pack_examples(examples: list[Example]) -> Example:
    """Several samples as one sequence, so that a step trains on all of them
    in one pass: a pair never spans two samples (its label is IGNORE) and
    attends only to pairs of its own sample, at its position in that sample."""
    if len(examples) == 1:
        return examples[0]
    device = examples[0].tokens.device
    return Example(
        tokens=torch.cat([e.tokens for e in examples]),
        hidden=torch.cat([e.hidden for e in examples]),
        labels=torch.cat([e.labels for e in examples]),
        greedy=all(e.greedy for e in examples),
        samples=torch.cat([torch.full((len(e.tokens),), i, device=device)
                           for i, e in enumerate(examples)]),
        positions=torch.cat([torch.arange(len(e.tokens), device=device) for e in examples]))


@dataclass
class Pairs:
    """Depth r of an example's unroll: n pairs (hidden of depth r-1 at p,
    token p+r) at position p+r-1, each labelled with the base's choice at p+r."""
    n: int
    labels: torch.Tensor  # [n], IGNORE where there is none
    positions: torch.Tensor  # [n]
    mask: torch.Tensor | None  # [n, n] bool, None: causal over the one sample


def pairs_at_depth(example: Example, r: int) -> Pairs:
    n = len(example.tokens) - r
    labels = example.labels[r:r + n]
    if example.samples is None:
        positions = torch.arange(r - 1, r - 1 + n, device=labels.device)
        return Pairs(n, labels, positions, None)
    own = example.samples[:n]
    labels = torch.where(example.samples[r:r + n] == own, labels, IGNORE)
    causal = torch.ones(n, n, dtype=torch.bool, device=labels.device).tril()
    return Pairs(n, labels, example.positions[:n] + (r - 1), causal & (own[:, None] == own[None]))


def make_examples(model: CausalLM, corpus: Corpus,
                  stream_layers: tuple[int, ...] = ()) -> list[Example]:
    """Drafts are only ever made after the prompt (the first answer token comes
    from prefill): labels of prompt positions are ignored, in the loss and in
    the accuracy (a fixed chat template is trivial to predict and would
    inflate both). `stream_layers`: also keep the residual streams after
    those layers (Example.streams), from the same forward."""
    device = model.output_embedding.device
    examples = []
    for group in _token_bounded_groups(corpus.samples, _FEATURE_TOKENS):
        features = base_features(model, [corpus.samples[i] for i in group], stream_layers)
        for i, (hidden, labels, streams) in zip(group, features):
            labels[:corpus.prompt_lengths[i]] = IGNORE
            examples.append(Example(torch.tensor(corpus.samples[i], device=device), hidden,
                                    labels, corpus.greedy[i], streams))
    return examples


# tokens per base_features forward: its logits over a 49K vocabulary in bf16
# take ~1.6 GB at this size
_FEATURE_TOKENS = 16384


def _token_bounded_groups(samples: list[list[int]], limit: int) -> list[list[int]]:
    """Consecutive sample indices in groups of at most `limit` tokens (a
    longer sample makes a group alone)."""
    groups: list[list[int]] = [[]]
    tokens = 0
    for i, sample in enumerate(samples):
        if groups[-1] and tokens + len(sample) > limit:
            groups.append([])
            tokens = 0
        groups[-1].append(i)
        tokens += len(sample)
    return [g for g in groups if g]


def train_head(loaded: LoadedModel, cfg: TrainConfig, corpus: Corpus | None = None,
               on_best: Callable[[MTPHead, int, dict[str, float]], None] | None = None
               ) -> tuple[MTPHead, dict]:
    """Trains a head; with dev_every_steps, `on_best(head, step, dev lengths)`
    runs each time the dev measure finds a new best head, while `head` holds
    it (tandem train-mtp writes it out then: a run killed at a device call's
    time limit keeps its best head)."""
    torch.manual_seed(cfg.seed)
    _log(f"settings {cfg}")
    model = loaded.model
    # each phase before step 0 is timed: on the H200 they took ~190 s of a
    # 570 s call (12-04 21:27), time the training did not get
    began = time.monotonic()
    corpus = corpus or generate_corpus(loaded, cfg)
    _log(f"corpus of {len(corpus.samples)} samples ready in {time.monotonic() - began:.0f} s")
    began = time.monotonic()
    examples = make_examples(model, corpus)
    _log(f"base features of {sum(len(e.tokens) for e in examples)} tokens in "
         f"{time.monotonic() - began:.0f} s")
    device = model.output_embedding.device
    rng = random.Random(cfg.seed)
    # the last prompts' samples are held out whole (no shared prompt text)
    held = max(len(examples) // 10 // cfg.samples_per_prompt, 1) * cfg.samples_per_prompt
    training, held_out = examples[:-held], examples[-held:]
    head = (head_from_file(model, cfg.init_head_path, cfg.head_layers) if cfg.init_head_path
            else init_head(model, cfg.head_layers or 1)).to(device)
    groups = _param_groups(head, _file_layers(cfg, model), cfg.init_lr_scale)
    params = [p for g in groups for p in g["params"]]
    opt = torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=0.0)
    full_head = model.output_embedding.detach().float()
    began = time.monotonic()
    dev = DevChoice(dev_examples(loaded, cfg.dev_new_tokens), full_head, cfg.depth,
                    on_best=on_best) if cfg.dev_every_steps else None
    if dev is not None:
        _log(f"dev prompts answered in {time.monotonic() - began:.0f} s")
        if cfg.init_head_path:
            # the head continued from is a candidate too: a warm restart falls
            # below it first (12-04 21:27: 2.021 -> 1.922 by step 400), and a
            # run that never climbs back must end with the head it started from
            dev.measure(model, head, 0)
    began = time.monotonic()
    # The softmax of the training loss runs over the tokens of the corpus only
    # (a sampled softmax, cheaper on a 49K vocabulary); held-out accuracy
    # below is measured with the full vocabulary.
    vocab = torch.unique(torch.cat([e.tokens for e in examples] +
                                   [e.labels[e.labels != IGNORE] for e in examples]))
    remap = torch.full((full_head.shape[0],), IGNORE, dtype=torch.long, device=device)
    remap[vocab] = torch.arange(len(vocab), device=device)
    lm_head = full_head[vocab]
    for e in training:
        e.labels = torch.where(e.labels == IGNORE, e.labels, remap[e.labels.clamp(min=0)])
    _log(f"{len(training)} training and {len(held_out)} held-out samples, "
         f"{len(vocab)} tokens in the loss vocabulary (remapped in "
         f"{time.monotonic() - began:.0f} s)")
    started, step, epochs = time.monotonic(), 0, 0
    budget = cfg.time_budget_s
    while time.monotonic() - started < budget:
        rng.shuffle(training)
        epochs += 1
        for first in range(0, len(training), cfg.batch_samples):
            elapsed = time.monotonic() - started
            if elapsed >= budget or step == cfg.max_steps:
                budget = 0.0  # ends the outer loop too
                break
            decay = 0.5 * (1 + math.cos(math.pi * min(elapsed / budget, 1.0)))  # cosine
            for g in opt.param_groups:
                g["lr"] = cfg.lr * g["scale"] * decay
            example = pack_examples(training[first:first + cfg.batch_samples])
            loss = unrolled_loss(model, head, lm_head, example, cfg.depth, cfg.soft_targets,
                                  cfg.target_temperature, engine_kv=cfg.engine_kv)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            if dev is not None and step % cfg.dev_every_steps == 0:
                dev.measure(model, head, step)
            if step % 200 == 0:
                _log(f"step {step} epoch {epochs} loss {loss.item():.3f} "
                     f"({time.monotonic() - started:.0f} s)")
    extra = {}
    if dev is not None:
        extra["dev"] = dev.choose(model, head, step)
    stats = evaluate(model, head, full_head, [e for e in held_out if e.greedy], cfg.depth,
                     engine_kv=True)
    _log(f"held-out greedy answers: draft accuracy by depth "
         f"{[round(a, 3) for a in stats['accuracy']]}, expected mean accepted length at "
         f"k={cfg.depth} {stats['expected_length']:.2f}, in the speculative loop "
         f"{stats['loop_length']:.2f}")
    return head, {"steps": step, "epochs": epochs, **stats, **extra}


def dev_examples(loaded: LoadedModel, new_tokens: int) -> dict[str, list[Example]]:
    """The dev prompts' greedy answers as Examples, by kind ("chat", "code"):
    what bench.mtp_gap --prompts dev measures. Never trained on."""
    from engine.llm import EngineConfig, OfflineEngine
    from engine.sampling import SamplingParams

    texts = [*DEV_CHAT, *DEV_CODE]
    engine = OfflineEngine(loaded, EngineConfig(max_batch=len(texts),
                                                max_context=_context_for(new_tokens)))
    prompts = [list(engine.chat_prompt([{"role": "user", "content": t}])) for t in texts]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    answers = _generated(engine, prompts, [greedy] * len(texts))
    examples = make_examples(loaded.model, Corpus([p + a for p, a in zip(prompts, answers)],
                                                  [len(p) for p in prompts], [True] * len(texts)))
    return {"chat": examples[:len(DEV_CHAT)], "code": examples[len(DEV_CHAT):]}


@dataclass
class DevChoice:
    """The head's loop length on the dev answers during training, and the
    best head seen. The goal (>= 2.0 tokens a verify step) holds for chat and
    code alike, so the worse of the two decides which head is best. Choosing
    on the dev set makes its figure a little optimistic; the benchmark's
    prompts (HELD_OUT_*) stay the unbiased measure. Measured as the engine
    drafts (EngineKV), so that the figure is the engine's: before 12-05 it
    was the dense unroll's (bench.mtp_gap's sim-dense), up to ~0.015 higher
    for heads trained dense."""
    examples: dict[str, list[Example]]
    lm_head: torch.Tensor
    depth: int
    history: dict[int, dict[str, float]] = field(default_factory=dict)  # step: loop lengths
    best_step: int = -1
    best_state: dict[str, torch.Tensor] | None = None
    on_best: Callable[[MTPHead, int, dict[str, float]], None] | None = None

    def score(self, step: int) -> float:
        return min(self.history[step].values())

    def measure(self, model, head, step: int) -> None:
        lengths = {kind: evaluate(model, head, self.lm_head, examples, self.depth,
                                  engine_kv=True)["loop_length"]
                   for kind, examples in self.examples.items()}
        self.history[step] = lengths
        if self.best_step < 0 or self.score(step) > self.score(self.best_step):
            self.best_step = step
            self.best_state = {k: v.detach().clone() for k, v in head.state_dict().items()}
            if self.on_best is not None:
                self.on_best(head, step, lengths)
        _log(f"dev at step {step}: " + ", ".join(f"{k} {v:.3f}" for k, v in lengths.items()))

    def choose(self, model, head, last_step: int) -> dict:
        """Measures the last head too, loads the best one into `head`, and
        says which it was."""
        if last_step not in self.history:
            self.measure(model, head, last_step)
        if self.best_step != last_step:
            head.load_state_dict(self.best_state)
        _log(f"dev: the head of step {self.best_step} is kept (of {len(self.history)} measured)")
        return {"chosen_step": self.best_step, "loop_length": self.history[self.best_step],
                "history": self.history}


def _file_layers(cfg: TrainConfig, model: CausalLM) -> int:
    """How many of the head's layers came from cfg.init_head_path (0: none)."""
    if not cfg.init_head_path:
        return 0
    from engine.speculative.heads import head_shape

    return head_shape(Path(cfg.init_head_path), model.config).layers  # the header only


def _param_groups(head: MTPHead, file_layers: int, file_scale: float) -> list[dict]:
    """AdamW groups, each with its fraction of the learning rate ("scale"):
    what a head file supplied (its norms, fc and first `file_layers` layers)
    at file_scale, a grown head's new layers at 1. A frozen group (scale 0)
    is left out and takes no gradients."""
    new_layers = tuple(f"layers.{i}." for i in range(file_layers, len(head.layers)))
    grown, kept = [], []
    for name, param in head.named_parameters():
        is_new = not file_layers or name.startswith(new_layers)
        (grown if is_new else kept).append(param)
    groups = [{"params": grown, "scale": 1.0}] if grown else []
    if kept and file_scale > 0:
        groups.append({"params": kept, "scale": file_scale})
    elif kept:
        for param in kept:
            param.requires_grad_(False)
    if not groups:
        raise ValueError("train-mtp: nothing to train: --init-lr-scale 0 freezes the whole file "
                         "head; grow it with --head-layers or give a scale above 0")
    return groups


def unrolled_loss(model, head, lm_head, example: Example, depth: int,
                  soft_targets: bool = False, temperature: float = 1.0,
                  first_input: torch.Tensor | None = None, engine_kv: bool = False):
    """Depth r pairs (pairs_at_depth), weighted 1, 1/2, 1/4, ...: cross-entropy
    against the base's greedy choice, or with soft_targets against its whole
    distribution over lm_head's rows at `temperature` (the base's logits are
    its normed final hidden times the same rows, so no teacher output is
    stored). `first_input` [T, H] replaces the hidden the first depth reads
    (bench.mtp_features' fused features); the targets stay the base's.
    engine_kv: deeper drafts attend as the engine's do (EngineKV)."""
    total, weight_sum = 0.0, 0.0
    h = widened(example.hidden[:-1]) if first_input is None else first_input[:-1]
    kv = EngineKV(len(head.layers)) if engine_kv else None
    for r in range(1, depth + 1):
        pairs = pairs_at_depth(example, r)
        labelled = pairs.labels != IGNORE
        if pairs.n < 2 or not bool(labelled.any()):
            break
        h = h[:pairs.n]
        out = head_forward(model, head, h, example.tokens[r:r + pairs.n], pairs.positions,
                           pairs.mask, kv)
        logits = F.linear(out, lm_head)
        if soft_targets:
            target = F.softmax(F.linear(widened(example.hidden[r:r + pairs.n]), lm_head)
                               / temperature,
                               dim=-1)
            per_pair = -(target * F.log_softmax(logits, dim=-1)).sum(-1)
            loss = per_pair[labelled].mean()
        else:
            loss = F.cross_entropy(logits, pairs.labels, ignore_index=IGNORE)
        weight = 0.5 ** (r - 1)
        total = total + weight * loss
        weight_sum += weight
        h = out
    return total / weight_sum


def speculation_steps(correct: torch.Tensor, prompt_len: int, answer_len: int,
                      k: int) -> tuple[int, int]:
    """(verify steps, accepted drafts) of greedy speculation with k drafts
    over one answer, as the engine runs it: the first answer token comes from
    the prefill, each step keeps the run of correct drafts plus the target's
    own token and jumps past them. correct [depth >= k, n]: whether the
    depth-r draft of the chain started at pair i (hidden i, token i + 1) is
    the base's choice."""
    steps = accepted = 0
    out = 1
    while out < answer_len:
        cap = min(k, answer_len - out - 1)
        start = prompt_len + out - 2  # the pair (hidden before the last token, the last token)
        run = 0
        while run < cap and start < correct.shape[1] and bool(correct[run, start]):
            run += 1
        steps += 1
        accepted += run
        out += run + 1
    return steps, accepted


@torch.no_grad()
def chain_drafts(model, head, lm_head, e: Example, depth: int,
                 engine_kv: bool = False) -> list[torch.Tensor]:
    """The head's greedy drafts by depth: entry r - 1 [T - r] holds, for the
    chain started at pair i (hidden i, token i + 1), its depth-r draft, the
    depths fed the example's own tokens (in greedy text a correct draft is
    the token the next depth is fed, so only whole-prefix-correct chains
    matter). engine_kv: attend as the engine's drafts do (EngineKV)."""
    h = widened(e.hidden[:-1])
    kv = EngineKV(len(head.layers)) if engine_kv else None
    drafts = []
    for r in range(1, depth + 1):
        n = len(e.tokens) - r
        h = h[:n]
        positions = torch.arange(r - 1, r - 1 + n, device=h.device)
        h = head_forward(model, head, h, e.tokens[r:r + n], positions, kv=kv)
        drafts.append(F.linear(h, lm_head).argmax(-1))
    return drafts


@torch.no_grad()
def evaluate(model, head, lm_head, examples: list[Example], depth: int,
             engine_kv: bool = False) -> dict:
    """On greedy answers: the fraction of depth-r drafts equal to the base's
    greedy choice; the mean accepted length a verify step starting at a
    random answer position would see (1 + the expected run of correct drafts:
    in greedy text a correct draft is the token the next depth is fed); and
    `loop_length`, tokens per verify step of the real loop (speculation_steps),
    which jumps over accepted runs and so counts the easy stretches less: on
    the shipped head's held-out answers 1.88 against an expected_length of
    2.01, and the engine measures what the loop says (bench.mtp_gap).
    engine_kv: the drafts attend as the engine's do (EngineKV), so that the
    figures are the engine's own; else as the dense unroll trains."""
    hits, counts = [0] * depth, [0] * depth
    run_sum, starts, steps, accepted = 0.0, 0, 0, 0
    for e in examples:
        n0 = len(e.tokens) - depth  # start positions whose whole chain is labelled
        chain = torch.ones(max(n0, 0), dtype=torch.bool, device=e.tokens.device)
        answer = e.labels[1:1 + max(n0, 0)] != IGNORE
        by_depth = []
        for r, drafts in enumerate(chain_drafts(model, head, lm_head, e, depth, engine_kv), 1):
            labels = e.labels[r:r + len(drafts)]
            correct = (drafts == labels) & (labels != IGNORE)
            hits[r - 1] += int(correct.sum())
            counts[r - 1] += int((labels != IGNORE).sum())
            chain &= correct[:len(chain)]
            run_sum += float((chain & answer).sum())
            by_depth.append(correct[:max(n0, 0)])
        starts += int(answer.sum())
        prompt_len = int((e.labels == IGNORE).sum())
        s, a = speculation_steps(torch.stack(by_depth).cpu(), prompt_len,
                                 len(e.tokens) - prompt_len, depth)
        steps, accepted = steps + s, accepted + a
    return {"accuracy": [h / max(c, 1) for h, c in zip(hits, counts)],
            "expected_length": 1 + run_sum / max(starts, 1),
            "loop_length": 1 + accepted / max(steps, 1)}
