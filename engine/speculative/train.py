"""`tandem train-mtp`: train an MTP head for a model that ships none, by
self-distillation on text the base model itself generates.

Data: the base model answers a fixed set of chat and code prompts (sampled
at temperature 0.8 for variety). For every position p of that text the label
of the pair (h_p, token p+1) is the base model's own greedy choice at
position p+1, i.e. what greedy speculation must draft to be accepted
(cross-entropy on the base's greedy tokens; decided over KL to its full
distribution because it needs no stored teacher distributions and is exactly
the greedy acceptance criterion).

The head is unrolled `depth` steps as it runs when drafting (step r feeds the
head's own output at p as the hidden of the pair at p+1), with losses
weighted 1, 1/2, 1/4, ... so drafts 2 and 3 are trained too. The decoder
layer starts as a copy of the base model's last layer and fc as
[0 | identity], so training starts from "predict like the last layer".

The head's attention in training is dense causal attention over the
sequence's pairs at one unroll depth; when drafting, the pairs of depth r
attend to depth-1 keys for earlier positions. This is the usual approximation.
"""
from __future__ import annotations

import math
import random
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.loader import LoadedModel
from engine.model import CausalLM, DecoderLayer, MTPHead

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Explain what a hash table is in two paragraphs.",
    "Write a JavaScript function that reverses a string.",
    "What are the main causes of climate change?",
    "Write a SQL query that finds the ten most recent orders.",
    "Give me three tips for a job interview.",
    "Write a bash script that counts the lines in every .txt file.",
    "Summarise the plot of Romeo and Juliet.",
    "Write a Python class for a bank account with deposit and withdraw.",
    "How does photosynthesis work?",
    "Write a function in C that computes the factorial of n.",
    "What is the difference between a list and a tuple in Python?",
    "Write a recipe for pancakes.",
    "Explain recursion to a beginner with an example.",
    "Write a Python script that reads a CSV file and prints the average of a column.",
    "What should I pack for a weekend hiking trip?",
    "Write a Rust function that sums a vector of integers.",
    "Describe the water cycle.",
    "Write a Python function that merges two sorted lists.",
    "Why is the sky blue?",
    "Write an HTML page with a form that asks for a name and an email.",
    "What are the benefits of regular exercise?",
    "Write a Python generator that yields Fibonacci numbers.",
    "Explain the difference between TCP and UDP.",
    "Write a Go program that prints hello world.",
    "Give me a short story about a robot learning to paint.",
    "Write a Python function to parse a date string like 2024-01-31.",
    "What is machine learning?",
    "Write a unit test in Python for a function add(a, b).",
    "How do I make a good cup of coffee?",
    "Write a Java method that finds the maximum in an array.",
    "Explain what an API is.",
    "Write a Python decorator that times a function.",
    "What are some good habits for studying?",
    "Write a regular expression that matches an email address and explain it.",
    "Describe how a car engine works.",
    "Write a Python function that counts word frequencies in a text.",
    "What is the capital of Japan and what is it known for?",
    "Write a TypeScript interface for a user with a name, an age and an email.",
    "Explain Big O notation with examples.",
]


@dataclass(frozen=True)
class TrainConfig:
    samples_per_prompt: int = 2
    new_tokens: int = 96
    depth: int = 3
    lr: float = 1e-3
    time_budget_s: float = 600.0
    seed: int = 0
    max_batch: int = 16

    def __post_init__(self) -> None:
        if self.depth < 1 or self.new_tokens < 8 or self.samples_per_prompt < 1:
            raise ValueError(f"train-mtp: bad settings {self}")


def _log(message: str) -> None:
    print(f"train-mtp: {message}", file=sys.stderr, flush=True)


def generate_corpus(loaded: LoadedModel, cfg: TrainConfig) -> list[list[int]]:
    """Prompt + the base model's sampled answer, one token list per sample."""
    from engine.llm import EngineConfig, OfflineEngine
    from engine.sampling import SamplingParams

    engine = OfflineEngine(loaded, EngineConfig(max_batch=cfg.max_batch, max_context=1024))
    prompts, params = [], []
    for i, text in enumerate(PROMPTS):
        prompt = engine.chat_prompt([{"role": "user", "content": text}])
        for s in range(cfg.samples_per_prompt):
            prompts.append(prompt)
            params.append(SamplingParams(temperature=0.8, top_p=0.95, seed=cfg.seed * 1000 + i * 10 + s,
                                         max_new_tokens=cfg.new_tokens))
    outputs: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    started = time.monotonic()
    for event in engine.generate(prompts, params):
        outputs[event.index].append(event.token_id)
    _log(f"generated {sum(map(len, outputs.values()))} tokens for {len(prompts)} samples in "
         f"{time.monotonic() - started:.0f} s")
    return [prompts[i] + outputs[i] for i in range(len(prompts))]


@torch.no_grad()
def base_features(model: CausalLM, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed final hidden [T, H], the base's greedy choice at each position [T]), dense."""
    from engine.batch import ForwardBatch, SequenceInput
    from engine.cache import CacheShape, PagedKVCache
    from engine.kv import make_format

    page = 16
    pages = -(-len(tokens) // page)
    device = model.output_embedding.device
    cache = PagedKVCache(model.config, CacheShape(pages, page, 1), device,
                         make_format("bf16", dtype=model.output_embedding.dtype))
    seq = SequenceInput(tuple(tokens), 0, tuple(range(pages)), 0)
    logits, hidden = model(ForwardBatch.build([seq], page, device), cache, all_logits=True,
                           return_hidden=True)
    return hidden.float(), logits.argmax(dim=-1)


def dense_layer(layer: DecoderLayer, x: torch.Tensor, cos_sin, rotary) -> torch.Tensor:
    """A full-attention DecoderLayer over one sequence without a cache (training)."""
    attn = layer.self_attn
    t = x.shape[0]
    h = layer.input_layernorm(x)
    q = attn.q_proj(h).view(t, attn.num_heads, -1)
    gate = None
    if attn.output_gate:
        q, gate = q.split(attn.head_dim, dim=-1)
        gate = gate.reshape(t, -1)
    k = attn.k_proj(h).view(t, attn.num_kv_heads, attn.head_dim)
    v = attn.v_proj(h).view(t, attn.num_kv_heads, attn.head_dim)
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = rotary.apply(q, *cos_sin), rotary.apply(k, *cos_sin)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         is_causal=True, scale=attn.head_dim ** -0.5,
                                         enable_gqa=True).transpose(0, 1).reshape(t, -1)
    if gate is not None:
        out = out * torch.sigmoid(gate)
    x = x + attn.o_proj(out)
    return x + layer.mlp(layer.post_attention_layernorm(x))


def head_forward(model: CausalLM, head: MTPHead, hidden: torch.Tensor, next_tokens: torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor:
    """The head's normed output for pairs (hidden[i], next_tokens[i]) at positions."""
    emb = model.model.embed_tokens(next_tokens).float()
    x = head.fc(torch.cat((head.pre_fc_norm_embedding(emb), head.pre_fc_norm_hidden(hidden)), -1))
    cos_sin = model.rotary.cos_sin(positions, x.dtype)
    for layer in head.layers:
        x = dense_layer(layer, x, cos_sin, model.rotary)
    return head.norm(x)


def init_head(model: CausalLM) -> MTPHead:
    """fc = [0 | I], decoder layer = copy of the base's last layer, norm = base norm."""
    from dataclasses import replace

    config = replace(model.config, mtp_num_layers=1)
    head = MTPHead(config).float()
    with torch.no_grad():
        h = config.hidden_size
        head.fc.weight.zero_()
        head.fc.weight[:, h:] = torch.eye(h)
        for norm in (head.pre_fc_norm_embedding, head.pre_fc_norm_hidden):
            norm.weight.fill_(0.0 if norm.zero_centered else 1.0)
        last = model.model.layers[model.config.attention_layers[-1]]
        head.layers[0].load_state_dict({k: v.float() for k, v in last.state_dict().items()})
        head.norm.weight.copy_(model.model.norm.weight.float())
    return head


def train_head(loaded: LoadedModel, cfg: TrainConfig) -> tuple[MTPHead, dict]:
    torch.manual_seed(cfg.seed)
    _log(f"settings {cfg}")
    model = loaded.model
    corpus = generate_corpus(loaded, cfg)
    features = [(torch.tensor(toks), *base_features(model, toks)) for toks in corpus]
    rng = random.Random(cfg.seed)
    # the last prompts' samples are held out whole (no shared prompt text)
    cut = len(features) - max(len(features) // 10, 1)
    training, held_out = features[:cut], features[cut:]
    head = init_head(model)
    params = [p for p in head.parameters()]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    full_head = model.output_embedding.detach().float()
    # The softmax of the training loss runs over the tokens of the corpus only
    # (a sampled softmax: ~15x cheaper on a 49K vocabulary); held-out accuracy
    # below is measured with the full vocabulary.
    vocab = torch.unique(torch.cat([f[0] for f in features] + [f[2] for f in features]))
    remap = torch.full((full_head.shape[0],), -1, dtype=torch.long)
    remap[vocab] = torch.arange(len(vocab))
    lm_head = full_head[vocab]
    training = [(tokens, hidden, remap[greedy]) for tokens, hidden, greedy in training]
    _log(f"{len(training)} training and {len(held_out)} held-out samples, "
         f"{len(vocab)} tokens in the loss vocabulary")
    started, step, epochs = time.monotonic(), 0, 0
    budget = cfg.time_budget_s
    while time.monotonic() - started < budget:
        rng.shuffle(training)
        epochs += 1
        for tokens, hidden, greedy in training:
            elapsed = time.monotonic() - started
            if elapsed >= budget:
                break
            for g in opt.param_groups:  # cosine decay over the time budget
                g["lr"] = cfg.lr * 0.5 * (1 + math.cos(math.pi * min(elapsed / budget, 1.0)))
            loss = _unrolled_loss(model, head, lm_head, tokens, hidden, greedy, cfg.depth)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            if step % 50 == 0:
                _log(f"step {step} epoch {epochs} loss {loss.item():.3f} "
                     f"({time.monotonic() - started:.0f} s)")
    accuracy = evaluate(model, head, full_head, held_out, cfg.depth)
    _log(f"held-out draft accuracy by depth: {[round(a, 3) for a in accuracy]}")
    return head, {"steps": step, "epochs": epochs, "accuracy": accuracy}


def _unrolled_loss(model, head, lm_head, tokens, hidden, greedy, depth):
    """Depth r pairs: (hidden of depth r-1 at p, token p+r) at position p+r-1,
    labelled with the base's greedy choice at p+r."""
    total, weight_sum = 0.0, 0.0
    h = hidden[:-1]
    for r in range(1, depth + 1):
        n = len(tokens) - r  # pairs p = 0..n-1 need token p+r and label greedy[p+r]
        if n < 2:
            break
        h = h[:n]
        positions = torch.arange(r - 1, r - 1 + n)
        out = head_forward(model, head, h, tokens[r:r + n], positions)
        logits = F.linear(out, lm_head)
        weight = 0.5 ** (r - 1)
        total = total + weight * F.cross_entropy(logits, greedy[r:r + n])
        weight_sum += weight
        h = out
    return total / weight_sum


@torch.no_grad()
def evaluate(model, head, lm_head, features, depth) -> list[float]:
    """Fraction of depth-r drafts equal to the base's greedy choice."""
    hits, counts = [0] * depth, [0] * depth
    for tokens, hidden, greedy in features:
        h = hidden[:-1]
        for r in range(1, depth + 1):
            n = len(tokens) - r
            h = h[:n]
            out = head_forward(model, head, h, tokens[r:r + n], torch.arange(r - 1, r - 1 + n))
            pred = F.linear(out, lm_head).argmax(-1)
            hits[r - 1] += int((pred == greedy[r:r + n]).sum())
            counts[r - 1] += n
            h = out
    return [h / max(c, 1) for h, c in zip(hits, counts)]
