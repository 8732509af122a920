"""`python -m bench.mtp_features --corpus PATH`: would the MTP head draft
better if it read more than the target's last layer (EAGLE-3's fusion of
low, middle and high features)? A probe that changes neither the head's
structure nor the engine, so that the answer comes before the plumbing.

A trained head (the shipped one unless --head) stays frozen. Its depth-1
input, today h (the target's normed final hidden), becomes

    h + fuse(concat(rms(s_a), rms(s_b), rms(s_c)))

where s_i is the base's residual stream after layer i (--layers; EAGLE-3's
choice by default: layer 2, the middle one, the third from last), rms a
parameter-free RMS scaling, and fuse a linear map that starts at zero, so
the probe starts as the head itself, bit for bit. Only fuse trains: depth-1
pairs against the base's whole next-token distribution (train-mtp's soft
targets, over the slice's tokens), on a random slice of a train-mtp corpus,
for --time-budget seconds. The control trains the same fuse fed h in each
slot: the same parameters, steps and budget, and no information the head
does not already read. What the features variant gains over the control is
what the other layers carry.

Both, and the untouched head, are measured as train-mtp measures heads
(train.evaluate: draft accuracy by depth, tokens per verify step in the
loop) on the 36 dev prompts' greedy answers and on the slice's held-out
greedy samples; later drafts read the head's own output, as when drafting.
On the 2-core CPU the defaults take ~20 minutes; `--device cuda` runs the
same at a larger --samples.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import time

import torch
from torch import nn

from engine.loader import load_model
from engine.speculative import train

VARIANTS = ("features", "control")


def default_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low, middle and high layers."""
    return 2, num_layers // 2, num_layers - 3


def rms(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Each stream at unit root-mean-square: the layers' residual scales
    differ by orders of magnitude, and fuse should not have to learn that."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class Fusion(nn.Module):
    """h + fuse(concat of the streams, each RMS-scaled); zero at the start."""

    def __init__(self, hidden: int, streams: int) -> None:
        super().__init__()
        self.fuse = nn.Linear(streams * hidden, hidden, bias=False)
        nn.init.zeros_(self.fuse.weight)

    def forward(self, hidden: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        return hidden + self.fuse(rms(streams).flatten(1))


def probe_inputs(variant: str, e: train.Example) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, the streams fuse reads) in fp32: the layers' streams, or for the
    control h in every slot."""
    hidden = train.widened(e.hidden)
    if variant == "control":
        return hidden, hidden[:, None].expand(-1, e.streams.shape[1], -1)
    return hidden, train.widened(e.streams)


def depth1_loss(model, head, fusion: Fusion, variant: str, batch: list[train.Example],
                lm_head: torch.Tensor) -> torch.Tensor:
    """train-mtp's soft-target loss at depth 1 over lm_head's rows, on packed
    samples, the head's input made by `fusion`."""
    inputs = torch.cat([fusion(*probe_inputs(variant, e)) for e in batch])
    return train.unrolled_loss(model, head, lm_head, train.pack_examples(batch), 1,
                               soft_targets=True, first_input=inputs)


def train_fusion(model, head, variant: str, training: list[train.Example], budget_s: float,
                 lr: float, batch_samples: int, seed: int) -> tuple[Fusion, int]:
    """fuse trained for budget_s on `training` (cosine decay over the budget);
    returns it and the steps it took."""
    torch.manual_seed(seed)
    hidden, streams = model.config.hidden_size, training[0].streams.shape[1]
    fusion = Fusion(hidden, streams).to(model.output_embedding.device)
    opt = torch.optim.AdamW(fusion.parameters(), lr=lr, weight_decay=0.0)
    # the softmax over the slice's tokens only, as train-mtp's loss vocabulary
    vocab = torch.unique(torch.cat([e.tokens for e in training]))
    lm_head = model.output_embedding.detach().float()[vocab]
    rng = random.Random(seed)
    order = list(range(len(training)))
    started, step = time.monotonic(), 0
    while (elapsed := time.monotonic() - started) < budget_s:
        if step * batch_samples % len(order) < batch_samples:
            rng.shuffle(order)
        first = step * batch_samples % len(order)
        batch = [training[i] for i in order[first:first + batch_samples]]
        for g in opt.param_groups:
            g["lr"] = lr * 0.5 * (1 + math.cos(math.pi * elapsed / budget_s))
        loss = depth1_loss(model, head, fusion, variant, batch, lm_head)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(fusion.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 100 == 0:
            print(f"  {variant}: step {step} loss {loss.item():.3f} "
                  f"({time.monotonic() - started:.0f} s)", flush=True)
    return fusion, step


@torch.no_grad()
def with_probe_input(fusion: Fusion | None, variant: str,
                     examples: list[train.Example]) -> list[train.Example]:
    """The examples with their depth-1 input replaced by the probe's (None:
    as they are); labels and tokens unchanged, so train.evaluate measures
    the drafts the probed head would make."""
    if fusion is None:
        return examples
    return [train.Example(e.tokens, fusion(*probe_inputs(variant, e)), e.labels, e.greedy)
            for e in examples]


def measure(model, head, lm_head, sets: dict[str, list[train.Example]], fusion, variant: str,
            depth: int) -> dict[str, dict]:
    return {name: train.evaluate(model, head, lm_head, with_probe_input(fusion, variant, ex),
                                 depth)
            for name, ex in sets.items()}


def corpus_slice(corpus: train.Corpus, samples: int, per_prompt: int, held_fraction: float,
                 seed: int) -> tuple[train.Corpus, train.Corpus]:
    """A random slice of whole prompts (train-mtp writes a prompt's
    `per_prompt` samples one after the other), split into training and
    held-out prompts."""
    if len(corpus.samples) % per_prompt:
        raise SystemExit(f"the corpus's {len(corpus.samples)} samples are not whole groups of "
                         f"{per_prompt} (--samples-per-prompt)")
    prompts = list(range(len(corpus.samples) // per_prompt))
    random.Random(seed).shuffle(prompts)
    chosen = prompts[:max(samples // per_prompt, 2)]
    held = max(int(len(chosen) * held_fraction), 1)

    def pick(ids):
        rows = [p * per_prompt + j for p in ids for j in range(per_prompt)]
        return train.Corpus([corpus.samples[i] for i in rows],
                            [corpus.prompt_lengths[i] for i in rows],
                            [corpus.greedy[i] for i in rows])
    return pick(chosen[held:]), pick(chosen[:held])


def dev_sets(loaded, new_tokens: int, layers: tuple[int, ...]) -> dict[str, list]:
    """The dev prompts' greedy answers (train.dev_examples) with their streams."""
    model = loaded.model
    sets = {}
    for kind, examples in train.dev_examples(loaded, new_tokens).items():
        prompt_lengths = [int((e.labels == train.IGNORE).sum()) for e in examples]
        corpus = train.Corpus([e.tokens.tolist() for e in examples], prompt_lengths,
                              [True] * len(examples))
        sets[f"dev {kind}"] = train.make_examples(model, corpus, layers)
    return sets


def _row(name: str, results: dict[str, dict]) -> str:
    cells = [f"{r['loop_length']:.3f} ({', '.join(f'{a:.3f}' for a in r['accuracy'])})"
             for r in results.values()]
    return f"| {name} | " + " | ".join(cells) + " |"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.mtp_features", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", required=True, help="a train-mtp corpus (Corpus.save)")
    ap.add_argument("--head", default=None, help="a head file (default: the shipped head)")
    ap.add_argument("--layers", type=int, nargs="+", default=None,
                    help="the streams fuse reads (default: 2, the middle layer, the third "
                         "from last)")
    ap.add_argument("--samples", type=int, default=640, help="corpus samples in the slice")
    ap.add_argument("--samples-per-prompt", type=int, default=2,
                    help="as the corpus was generated (train-mtp's)")
    ap.add_argument("--held-out", type=float, default=0.15, help="held-out share of its prompts")
    ap.add_argument("--time-budget", type=float, default=300.0, help="seconds of training a variant")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch-samples", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=96, help="tokens of each dev answer")
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.time_budget <= 0 or a.samples < 4 or not 0 < a.held_out < 1:
        ap.error("--time-budget must be positive, --samples at least 4, --held-out in (0, 1)")

    loaded = load_model(None, device=a.device, progress=False)
    model = loaded.model
    layers = tuple(a.layers or default_layers(model.config.num_layers))
    if any(not 0 <= i < model.config.num_layers for i in layers):
        ap.error(f"--layers must lie in 0..{model.config.num_layers - 1}")
    head_path = a.head or str(_shipped_head())
    head = train.head_from_file(model, head_path).to(model.output_embedding.device)
    head.requires_grad_(False)
    print(f"head {head_path}; streams after layers {layers}", flush=True)

    began = time.monotonic()
    training_corpus, held_corpus = corpus_slice(train.Corpus.load(a.corpus), a.samples,
                                                a.samples_per_prompt, a.held_out, a.seed)
    training = train.make_examples(model, training_corpus, layers)
    held = [e for e in train.make_examples(model, held_corpus, layers) if e.greedy]
    sets = {**dev_sets(loaded, a.new_tokens, layers), "corpus held-out": held}
    print(f"features of {sum(len(e.tokens) for e in training)} training tokens "
          f"({len(training)} samples), {len(held)} held-out greedy samples, and the dev "
          f"answers in {time.monotonic() - began:.0f} s", flush=True)

    lm_head = model.output_embedding.detach().float()
    results = {"head": measure(model, head, lm_head, sets, None, "", a.depth)}
    steps = {}
    for variant in VARIANTS:
        fusion, steps[variant] = train_fusion(model, head, variant, training, a.time_budget,
                                              a.lr, a.batch_samples, a.seed)
        results[variant] = measure(model, head, lm_head, sets, fusion, variant, a.depth)

    print(f"\nloop length at k={a.depth} (draft accuracy by depth); steps: {steps}")
    print("| probe | " + " | ".join(sets) + " |")
    print("| --- |" + " --- |" * len(sets))
    for name, by_set in results.items():
        print(_row(name, by_set))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"layers": layers, "steps": steps, "head": head_path,
                       "results": results, "args": vars(a)}, f, indent=1)
    return 0


def _shipped_head():
    from engine.speculative.heads import head_path_for
    from engine.weights.gguf import embedded_model_path

    path = head_path_for(embedded_model_path())
    if path is None:
        raise SystemExit("no MTP head ships with the embedded model")
    return path


if __name__ == "__main__":
    raise SystemExit(main())
