"""KV-format quality: how much quantizing the KV cache changes the model's
next-token predictions, measured teacher-forced on real English text.

For each context length L, L tokens of Pride and Prejudice (from its first
sentence on) run through the model as one sequence, prefilled in chunks into a
PagedKVCache of each KV format: every chunk's queries attend to the stored
(quantized) KV of all earlier tokens and of the chunk itself, as in serving.
The logits of every position are compared with those of a bf16-KV reference
run: KL(ref || format) of the next-token distributions, top-1 agreement, and
the perplexity of the text's actual next tokens.

All runs advance in lockstep, one reference chunk at a time, so only one
chunk of logits per run is alive at once (never [L, vocab] per format). The
first row, "bf16 vs bf16", is a second bf16-KV run that differs from the
reference only in its prefill chunking: the noise floor of the measurement.

Formats are make_format names with options, e.g. `rk4:block=16,scale_format=e8m0`
or `rk4:rotate=false`; plain `bf16` is the reference (bf16 KV). A format that
keeps open pages in staging (rk4p) runs decode-like whatever --chunk says:
chunks of one of its pages, each staged in bf16 and sealed when the next chunk
starts, so every position is scored as a decoding sequence would see it.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common import environment, now, print_table, write_json

DEFAULT_TEXT = Path(__file__).resolve().parents[2] / "shared/data/pride-and-prejudice.txt"
TEXT_START = "It is a truth universally acknowledged"
REFERENCE_SPEC = "bf16"
PAGE_SIZE = 16
METRIC_ROWS = 128  # rows of logits turned into fp64 log-probs at a time
# What rk4 should reach against the bf16-KV reference.
GOAL_MEAN_KL = 0.01
GOAL_TOP1_PCT = 97.0
GOAL_PPL_CHANGE_PCT = 1.0


# ------------------------------------------------------------ format specs


@dataclass(frozen=True)
class FormatSpec:
    """A KV format as written on the command line: `name[:key=value,...]`."""

    text: str
    name: str
    options: dict = field(default_factory=dict)

    def build(self):
        from engine.kv import make_format

        options = dict(self.options)
        if self.name == "bf16":
            options.setdefault("dtype", torch.bfloat16)
        return make_format(self.name, **options)


def parse_format_spec(text: str) -> FormatSpec:
    """`rk4:block=16,scale_format=e8m0,rotate=false` -> FormatSpec."""
    name, _, rest = text.partition(":")
    options = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"format {text!r}: option {item!r} is not key=value")
        options[key.strip()] = _option_value(key.strip(), value.strip())
    return FormatSpec(text, name.strip(), options)


def _option_value(key: str, value: str):
    if key == "dtype":
        dtype = getattr(torch, value, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtype={value!r} is not a torch dtype")
        return dtype
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def build_formats(texts: list[str]) -> dict[str, object]:
    """Spec text -> KVFormat for every non-reference spec (each built once, to fail early)."""
    formats = {}
    for text in texts:
        if text == REFERENCE_SPEC or text in formats:
            continue
        spec = parse_format_spec(text)
        try:
            formats[text] = spec.build()
        except TypeError as e:  # an option the format does not take
            raise ValueError(f"format {text!r}: {e}") from e
    return formats


# -------------------------------------------------------------------- text


def text_tokens(tokenizer, path: Path, count: int) -> list[int]:
    """The first `count` tokens of the text from its first sentence on."""
    text = path.read_text(encoding="utf-8")
    start = text.find(TEXT_START)
    text = text[max(start, 0):]
    chars = count * 8
    while True:
        ids = tokenizer.encode(text[:chars], add_special_tokens=False)
        # the last token may be cut by the slice; keep only whole ones
        if len(ids) > count or chars >= len(text):
            break
        chars *= 2
    if len(ids) < count:
        raise ValueError(f"{path} has only {len(ids)} tokens after {TEXT_START!r}; "
                         f"context {count} needs more")
    return ids[:count]


# ------------------------------------------------------------ chunked runs


class ChunkedPrefill:
    """One sequence prefilled in fixed chunks into its own cache of one KV format.

    logits(lo, hi) hands out the logits of positions [lo, hi) in order,
    running as many chunks as needed and keeping the surplus for next time,
    so runs with different chunk sizes can be compared window by window.
    """

    def __init__(self, loaded, tokens: list[int], kv_format, chunk: int) -> None:
        from engine.cache import CacheShape, PagedKVCache
        from engine.kv.open_pages import OpenPages, staging_per_sequence

        page_size = getattr(kv_format, "page_size", PAGE_SIZE)
        pages = -(-len(tokens) // page_size)
        staging = staging_per_sequence(kv_format)
        self.model, self.device = loaded.model, loaded.device
        self.page_size = page_size
        # A staged format runs decode-like: chunks of one page, each written to
        # an open (bf16) page and sealed once the next chunk starts, so every
        # query sees its own page unquantized as a decoding sequence would.
        self.tokens, self.chunk = tokens, page_size if staging else chunk
        self.cache = PagedKVCache(loaded.config, CacheShape(num_pages=pages, page_size=page_size,
                                                            staging_pages=staging),
                                  loaded.device, kv_format)
        self.page_table = tuple(range(pages))
        self.open_pages = (OpenPages.for_format(kv_format, range(staging), pages, page_size)
                           if staging else None)
        self.prefilled = 0  # tokens whose KV is in the cache
        self.delivered = 0  # positions whose logits were handed out
        self.pending: torch.Tensor | None = None  # logits of [delivered, prefilled)
        self.seconds = 0.0

    def logits(self, lo: int, hi: int) -> torch.Tensor:
        if lo != self.delivered:
            raise ValueError(f"logits are handed out in order: asked from {lo}, "
                             f"next is {self.delivered}")
        while self.prefilled < hi:
            self._prefill_next_chunk()
        wanted, surplus = self.pending[:hi - lo], self.pending[hi - lo:]
        # clone the surplus so the chunk it came from can be freed
        self.pending = surplus.clone() if surplus.shape[0] else None
        self.delivered = hi
        return wanted

    def _prefill_next_chunk(self) -> None:
        from engine.batch import ForwardBatch, SequenceInput

        start = self.prefilled
        piece = tuple(self.tokens[start:start + self.chunk])
        table = self.page_table
        if self.open_pages is not None:
            table = self.open_pages.prepare(self.cache, self.page_table, start,
                                            start + len(piece), prefill=False)
        batch = ForwardBatch.build([SequenceInput(piece, start, table)], self.page_size,
                                   self.device)
        t0 = now()
        logits = self.model(batch, self.cache, all_logits=True).float()
        self.seconds += now() - t0
        self.pending = logits if self.pending is None else torch.cat([self.pending, logits])
        self.prefilled += len(piece)


# ---------------------------------------------------------------- metrics


class PredictionStats:
    """Per-position KL, top-1 agreement and next-token NLL of one run vs the reference."""

    def __init__(self) -> None:
        self.kl: list[torch.Tensor] = []
        self.top1: list[torch.Tensor] = []
        self.nll: list[torch.Tensor] = []

    def add(self, ref_logprobs: torch.Tensor, ref_top1: torch.Tensor, logits: torch.Tensor,
            targets: torch.Tensor) -> None:
        """ref_logprobs [n, V] fp64, ref_top1 [n], logits [n, V], targets [n]."""
        for lo in range(0, logits.shape[0], METRIC_ROWS):
            rows = slice(lo, lo + METRIC_ROWS)
            logprobs = F.log_softmax(logits[rows].double(), dim=-1)
            ref = ref_logprobs[rows]
            self.kl.append((ref.exp() * (ref - logprobs)).sum(-1))
            self.nll.append(-logprobs.gather(1, targets[rows, None])[:, 0])
        self.top1.append(logits.argmax(-1) == ref_top1)

    def summary(self) -> dict:
        kl = torch.cat(self.kl)
        return {
            "positions": int(kl.numel()),
            "mean_kl": float(kl.mean()),
            "p99_kl": float(torch.quantile(kl, 0.99)),
            "max_kl": float(kl.max()),
            "top1_agreement_pct": 100.0 * float(torch.cat(self.top1).double().mean()),
            "perplexity": float(torch.cat(self.nll).mean().exp()),
        }


def reference_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """fp64 log-probs of the reference window (fp64 so that the noise floor is
    not drowned in the rounding of the metric itself)."""
    return torch.cat([F.log_softmax(logits[lo:lo + METRIC_ROWS].double(), dim=-1)
                      for lo in range(0, logits.shape[0], METRIC_ROWS)])


def reference_nll(ref_logprobs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return -ref_logprobs.gather(1, targets[:, None])[:, 0]


# -------------------------------------------------------------- evaluation


def evaluate_context(loaded, tokens: list[int], formats: dict, chunk: int,
                     noise_chunk: int) -> tuple[float, dict[str, dict]]:
    """Reference perplexity and, per run label, its summary vs the bf16 reference."""
    reference, runs = make_runs(loaded, tokens, formats, chunk, noise_chunk)
    stats = {label: PredictionStats() for label in runs}
    ref_nll = []
    next_tokens = torch.tensor(tokens[1:], dtype=torch.long, device=loaded.device)
    predicted = len(tokens) - 1  # the last position has no next token to score
    for lo in range(0, len(tokens), chunk):  # one reference chunk at a time
        hi = min(lo + chunk, len(tokens))
        scored = min(hi, predicted) - lo
        targets = next_tokens[lo:lo + scored]
        ref_logits = reference.logits(lo, hi)[:scored]
        ref_logprobs, ref_top1 = reference_logprobs(ref_logits), ref_logits.argmax(-1)
        del ref_logits
        ref_nll.append(reference_nll(ref_logprobs, targets))
        for label, run in runs.items():
            stats[label].add(ref_logprobs, ref_top1, run.logits(lo, hi)[:scored], targets)
        _progress(f"  context {len(tokens)}: {hi}/{len(tokens)} tokens")
    ref_ppl = float(torch.cat(ref_nll).mean().exp())
    return ref_ppl, {label: run_summary(stats[label], run, ref_ppl) for label, run in runs.items()}


def make_runs(loaded, tokens: list[int], formats: dict, chunk: int, noise_chunk: int
              ) -> tuple[ChunkedPrefill, dict[str, ChunkedPrefill]]:
    """The bf16 reference, then the noise-floor run and one run per format, by label."""
    ref_format = parse_format_spec(REFERENCE_SPEC).build()
    reference = ChunkedPrefill(loaded, tokens, ref_format, chunk)
    runs = {noise_floor_label(noise_chunk): ChunkedPrefill(loaded, tokens, ref_format, noise_chunk)}
    runs.update({label: ChunkedPrefill(loaded, tokens, fmt, chunk)
                 for label, fmt in formats.items()})
    return reference, runs


def run_summary(stats: PredictionStats, run: ChunkedPrefill, ref_ppl: float) -> dict:
    summary = stats.summary()
    summary["ppl_change_pct"] = 100.0 * (summary["perplexity"] / ref_ppl - 1.0)
    summary["forward_s"] = run.seconds
    return summary


def noise_floor_label(noise_chunk: int) -> str:
    return f"bf16 vs bf16 (chunk {noise_chunk})"


def goal_check(label: str, summary: dict) -> dict | None:
    """Which rk4 goals a result meets (None for formats that have no goals)."""
    if not label.startswith(("rk4", "rk4p")):
        return None
    return {
        "mean_kl": summary["mean_kl"] <= GOAL_MEAN_KL,
        "top1": summary["top1_agreement_pct"] >= GOAL_TOP1_PCT,
        "ppl": summary["ppl_change_pct"] <= GOAL_PPL_CHANGE_PCT,
    }


def goal_text(goals: dict | None) -> str:
    if goals is None:
        return "-"
    missed = [name for name, met in goals.items() if not met]
    return "met" if not missed else "missed " + "+".join(missed)


def _kl_text(value: float) -> str:
    return f"{value:.4f}" if abs(value) >= 1e-3 else f"{value:.1e}"


def table_row(r: dict) -> list:
    return [r["context"], r["format"], f"{r['bits_per_element']:g}", _kl_text(r["mean_kl"]),
            _kl_text(r["p99_kl"]), f"{r['top1_agreement_pct']:.2f}", f"{r['perplexity']:.3f}",
            f"{r['ppl_change_pct']:+.2f}", goal_text(r["goals"])]


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -------------------------------------------------------------------- main


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem bench kv-quality", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M GGUF")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="compute dtype (default: the device's, fp32 on the CPU, bf16 on a "
                        "GPU); bfloat16 on the CPU reproduces what a GPU computes")
    p.add_argument("--formats", nargs="+", default=["bf16", "int8", "rk4"],
                   help="KV formats as name[:key=value,...]; bf16 is the reference "
                        "(e.g. rk4:block=16,scale_format=e8m0,rotate=false)")
    p.add_argument("--context", type=int, nargs="+", default=[2048, 8192],
                   help="context lengths in tokens")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk in tokens")
    p.add_argument("--noise-chunk", type=int, default=None,
                   help="prefill chunk of the second bf16 run (default: 3/4 of --chunk)")
    p.add_argument("--text", default=str(DEFAULT_TEXT),
                   help="English text file (default: the shared Pride and Prejudice)")
    p.add_argument("--json", default=None)
    return p


def _checked_args(p: argparse.ArgumentParser, argv):
    args = p.parse_args(argv)
    if not Path(args.text).is_file():
        p.error(f"--text {args.text}: no such file; pass --text with a plain-text file "
                "(the default is shared/data/pride-and-prejudice.txt next to the repo)")
    args.noise_chunk = args.noise_chunk or max(1, args.chunk * 3 // 4)
    if args.chunk < 1 or args.noise_chunk == args.chunk:
        p.error("--chunk must be >= 1 and --noise-chunk must differ from it")
    if min(args.context) < 2:
        p.error("--context lengths must be >= 2 tokens")
    return args


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = _checked_args(p, argv)
    try:
        formats = build_formats(args.formats)
    except ValueError as e:
        p.error(f"--formats: {e}")

    from engine.loader import load_model

    dtype = getattr(torch, args.dtype) if args.dtype else None
    loaded = load_model(args.model, device=args.device, progress=False, dtype=dtype)
    if max(args.context) > loaded.config.max_position_embeddings:
        p.error(f"--context {max(args.context)} is over the model's "
                f"{loaded.config.max_position_embeddings} positions")
    try:
        tokens = text_tokens(loaded.tokenizer, Path(args.text), max(args.context))
    except ValueError as e:
        p.error(f"--text: {e}")
    t_start = now()
    results = [record for context in args.context
               for record in evaluate_length(loaded, args, formats, tokens[:context])]
    write_json(args.json, {"env": environment(), "model": loaded.source, "args": vars(args),
                           "text_start": TEXT_START, "chunk": args.chunk,
                           "noise_chunk": args.noise_chunk,
                           "goals": {"mean_kl_max": GOAL_MEAN_KL, "top1_pct_min": GOAL_TOP1_PCT,
                                     "ppl_change_pct_max": GOAL_PPL_CHANGE_PCT},
                           "wall_s": now() - t_start, "results": results})
    print_report(loaded, args, results)
    return 0


def evaluate_length(loaded, args, formats: dict, tokens: list[int]) -> list[dict]:
    """JSON records of every run over one context of tokens."""
    context = len(tokens)
    t0 = now()
    ref_ppl, summaries = evaluate_context(loaded, tokens, formats, args.chunk, args.noise_chunk)
    wall = now() - t0
    _progress(f"context {context}: {wall:.1f} s")
    records = []
    for label, summary in summaries.items():
        fmt = formats.get(label)
        records.append({
            "context": context, "format": label,
            "kv_format": repr(fmt) if fmt else "Bf16Format(dtype=torch.bfloat16)",
            "bits_per_element": fmt.bits_per_element(loaded.config.head_dim) if fmt else 16.0,
            "reference_perplexity": ref_ppl, "context_wall_s": wall,
            "goals": goal_check(label, summary), **summary})
    return records


def print_report(loaded, args, results: list[dict]) -> None:
    ref_ppls = {r["context"]: r["reference_perplexity"] for r in results}
    title = (f"KV quality vs bf16 KV, teacher-forced ({Path(loaded.source).name}, {args.device}, "
             f"{str(loaded.dtype).removeprefix('torch.')} compute, "
             f"chunk {args.chunk})\nreference ppl: "
             + ", ".join(f"{c}: {ppl:.3f}" for c, ppl in ref_ppls.items())
             + f"; rk4 goals: mean KL <= {GOAL_MEAN_KL}, top-1 >= {GOAL_TOP1_PCT:g}%, "
               f"ppl <= +{GOAL_PPL_CHANGE_PCT:g}%")
    print_table(title, ["context", "format", "bits", "mean KL", "p99 KL", "top-1 %", "ppl",
                        "ppl %", "rk4 goals"], [table_row(r) for r in results])


if __name__ == "__main__":
    sys.exit(main())
