"""Which launch shape the decode GEMV (engine/quant/gemv.py) runs on which
weight shape: GemvConfig, the block shapes a sweep times (`python -m
bench.quant --sweep`), TUNED (the H200's sweeps, by weight shape and batch),
a sweep's own JSON in place of TUNED (TANDEM_GEMV_TUNED, for another card)
and the heuristic for shapes none of them names. Owns no kernel and launches
nothing: gemv.py reads a config and runs it."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import triton

MAX_SPLIT_K = 16


@dataclass(frozen=True)
class GemvConfig:
    """One launch shape of the GEMV: BLOCK_N output features per program, BLOCK_K
    of K per loop step, SPLIT_K programs along K, and the launch's warps/stages."""
    block_n: int = 16
    block_k: int = 512
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 2
    tensor_cores: bool = False  # the tl.dot kernel (rows padded to 16): for rows >= 2
    prefetch: bool = False      # CUDA-core kernel: load tile i+1 before computing tile i
    int8_x: bool = False        # one row, 4-bit codes, groups of 32: int8 activations, DP4A
    stream_k: int = 0           # DP4A only: stream-K over ~stream_k programs an SM (split_k unused)

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"GemvConfig.{name} must be a power of two, got {value}")
        if self.split_k < 1 or self.num_stages < 1:
            raise ValueError(f"GemvConfig split_k and num_stages must be >= 1, got {self}")
        if self.stream_k < 0 or (self.stream_k and not self.int8_x):
            raise ValueError(f"GemvConfig.stream_k (programs an SM) is >= 0 and only for the "
                             f"int8_x kernel, got {self}")

    def key(self) -> str:
        return (f"{'tc-' if self.tensor_cores else ''}{'x8-' if self.int8_x else ''}"
                f"n{self.block_n}-k{self.block_k}"
                f"-{f'sk{self.stream_k}' if self.stream_k else f's{self.split_k}'}"
                f"-w{self.num_warps}-p{self.num_stages}{'-pf' if self.prefetch else ''}")


# Block shapes the sweep (`python -m bench.quant --sweep`) times on every
# shape, each with split-K 1/2/4/8 (the best then with other stage counts).
CANDIDATES = tuple(GemvConfig(bn, bk, 1, nw, 2, prefetch=pf)
                   for bn, bk, nw, pf in ((8, 512, 4, False), (16, 512, 4, False),
                                          (32, 512, 4, False), (16, 1024, 4, False),
                                          (32, 1024, 4, False), (32, 1024, 8, False),
                                          (64, 1024, 8, False), (32, 512, 4, True),
                                          (16, 1024, 4, True), (32, 1024, 4, True)))
# The int8-activation (DP4A) kernel's, timed for one row of 4-bit codes in
# groups of 32.
# (8-warp prefetching shapes, n32/n64 x k512/k1024, lost 3-4x on every merged
# 27B shape of the H200 sweep of 2026-12-03 18:30 and are not swept.)
X8_CANDIDATES = tuple(GemvConfig(bn, bk, 1, nw, 2, int8_x=True, prefetch=pf)
                      for bn, bk, nw, pf in ((16, 512, 4, False), (32, 512, 4, False),
                                             (32, 1024, 4, False), (64, 1024, 8, False),
                                             (64, 512, 4, False), (16, 512, 4, True),
                                             (32, 512, 4, True), (16, 1024, 4, True),
                                             (32, 1024, 4, True)))
# Stream-K DP4A launches (_gemv_x8_stream_kernel) with as many programs an
# SM as their registers let run at once, and one fewer. Static sm_90 builds
# (2026-12-03, its run end on the split-K fix-up): n32-k1024 167 registers,
# three 4-warp programs an SM, as the prefetching split kernel's 168;
# n16-k1024 96, five. The sweep times each once: split-K has no meaning for them.
STREAM_CANDIDATES = tuple(GemvConfig(bn, bk, 1, 4, 2, int8_x=True, prefetch=True, stream_k=sk)
                          for bn, bk, sk in ((32, 1024, 2), (32, 1024, 3), (16, 1024, 4),
                                             (16, 1024, 5)))
# The tensor-core kernel's, timed for rows >= 2.
DOT_CANDIDATES = tuple(GemvConfig(bn, bk, 1, nw, 2, tensor_cores=True)
                       for bn, bk, nw in ((32, 256, 4), (64, 256, 4), (64, 512, 8),
                                          (128, 256, 8)))

# Tuned configs by (bits, group, N, K, rows bucket): paste the sweep's "TUNED"
# lines here. rows bucket: 1, 2, 4 or 8 (the batch rounded up to a power of two).
# The merged projections (gate_up, gdn in_proj, attn qkv) and gdn out / attn o:
# the H200 sweep of 2026-12-02 with the DP4A configs (BENCHMARKS.md, "int8
# activations on the H200"); gate_up's prefetching config from the DP4A
# sweep of 2026-12-03 14:18 (35.7 -> 30.5 us; prefetch lost on the other
# four shapes, whose programs walk 1-3 K tiles or fill under one wave). The
# rest: the sweep of 2026-12-01 ("decode step profile"); the unmerged shapes
# stay for checkpoints whose formats differ within a merge (SplitLinear).
TUNED: dict[tuple[int, int, int, int, int], GemvConfig] = {
    (4, 32, 34816, 5120, 1): GemvConfig(32, 1024, 1, 4, 3, prefetch=True, int8_x=True),  # gate_up 30.5 us, 79%
    (4, 32, 34816, 5120, 4): GemvConfig(64, 256, 4, 4, 2, tensor_cores=True),  # 97.2 us
    (4, 32, 16480, 5120, 1): GemvConfig(32, 1024, 1, 4, 2, int8_x=True),  # gdn in_proj 16.7, 69%
    (4, 32, 16480, 5120, 4): GemvConfig(128, 256, 2, 8, 2, tensor_cores=True),  # 47.3 us
    (4, 32, 14336, 5120, 1): GemvConfig(32, 1024, 1, 4, 3, int8_x=True),  # attn qkv 15.5 us, 65%
    (4, 32, 14336, 5120, 4): GemvConfig(64, 256, 4, 4, 2, tensor_cores=True),  # 43.0 us
    (4, 32, 5120, 17408, 1): GemvConfig(32, 1024, 8, 4, 3, int8_x=True),  # down 21.6 us, 57%
    (4, 32, 5120, 17408, 4): GemvConfig(64, 256, 4, 4, 2, tensor_cores=True),  # 66.3 us
    (4, 32, 5120, 6144, 1): GemvConfig(32, 1024, 4, 4, 1, int8_x=True),  # gdn out / attn o 9.6 us
    (4, 32, 5120, 6144, 4): GemvConfig(64, 256, 7, 4, 2, tensor_cores=True),  # 22.5 us
    (8, 16, 5120, 17408, 1): GemvConfig(16, 512, 8, 4, 1),  # down Q6_K 33.1 us, 68%
    (8, 16, 5120, 17408, 4): GemvConfig(64, 256, 8, 4, 2, tensor_cores=True),  # 66.5 us
    (4, 32, 17408, 5120, 1): GemvConfig(32, 1024, 8, 4, 3),  # gate/up 25.0 us, 49% of floor
    (4, 32, 17408, 5120, 4): GemvConfig(64, 256, 8, 4, 2, tensor_cores=True),  # 52.8 us
    (4, 32, 10240, 5120, 1): GemvConfig(16, 1024, 1, 4, 3),  # gdn qkv 16.5 us, 43%
    (4, 32, 10240, 5120, 4): GemvConfig(64, 256, 8, 4, 2, tensor_cores=True),  # 34.9 us
    (4, 32, 6144, 5120, 1): GemvConfig(16, 1024, 8, 4, 2, prefetch=True),  # gdn z 12.7 us
    (4, 32, 6144, 5120, 4): GemvConfig(64, 256, 4, 4, 2, tensor_cores=True),  # 22.3 us
    (4, 32, 48, 5120, 1): GemvConfig(16, 1024, 8, 4, 1, prefetch=True),  # gdn a/b 3.7 us
    (4, 32, 48, 5120, 4): GemvConfig(16, 1024, 8, 4, 2),  # 5.9 us
    (4, 32, 12288, 5120, 1): GemvConfig(32, 1024, 8, 4, 3),  # attn q+gate 19.4 us, 44%
    (4, 32, 12288, 5120, 4): GemvConfig(64, 256, 2, 4, 2, tensor_cores=True),  # 39.2 us
    (4, 32, 1024, 5120, 1): GemvConfig(16, 1024, 8, 4, 1, prefetch=True),  # attn k/v 4.9 us
    (4, 32, 1024, 5120, 4): GemvConfig(64, 256, 16, 4, 2, tensor_cores=True),  # 8.3 us
    # lm_head: DP4A, swept on the H200 2026-12-02 16:15 (float 271.7 us)
    (4, 32, 248320, 5120, 1): GemvConfig(32, 1024, 1, 4, 3, int8_x=True),  # 207.0 us, 84%
    (4, 32, 248320, 5120, 4): GemvConfig(128, 256, 1, 8, 2, tensor_cores=True),  # 579.2 us
}


# Rows=1 block shapes with their K loop's instructions per weight on sm_90
# (bench.gemv_sass): the heuristic weighs these against how evenly the
# programs spread over the SMs.
ROW1_SHAPES = ((8, 512, 4, 8.8), (16, 512, 4, 6.6), (32, 512, 4, 5.1), (16, 1024, 4, 5.3),
               (32, 1024, 4, 4.5), (64, 1024, 8, 4.5))
# The DP4A kernel's (one row, 4-bit, groups of 32): n32-k1024-w4 (2.1
# instructions per weight; narrower blocks cost 5.7-10) was the best block
# shape on all five merged 27B shapes of the H200 sweep of 2026-12-02.
ROW1_X8_SHAPES = ((32, 1024, 4, 2.1),)


def rows_bucket(rows: int) -> int:
    return 1 << (rows - 1).bit_length()


TUNED_FILE_ENV = "TANDEM_GEMV_TUNED"


def tuned_from_sweep(path: str) -> dict[tuple[int, int, int, int, int], GemvConfig]:
    """The best config per shape of a sweep's JSON (`python -m bench.quant
    --sweep --json PATH`): TUNED for this card without editing the source.
    A file that is not such a sweep is an error that says what to give."""
    import json

    try:
        with open(path) as f:
            swept = json.load(f).get("sweep")
    except (OSError, ValueError, AttributeError) as exc:
        raise ValueError(f"{TUNED_FILE_ENV}={path!r}: cannot read a sweep's JSON ({exc}); "
                         f"give the file `python -m bench.quant --sweep --json` wrote") from exc
    if not isinstance(swept, list) or not swept:
        raise ValueError(f"{TUNED_FILE_ENV}={path!r} holds no sweep results; run "
                         f"`python -m bench.quant --sweep --json {path}`")
    tuned = {}
    for r in swept:  # sweeps before stream-K stored 8 fields
        bn, bk, sk, nw, ns, tc, pf, x8, *stream = r["best_config"]
        tuned[(r["bits"], r["group"], r["N"], r["K"], r["bucket"])] = GemvConfig(
            bn, bk, sk, nw, ns, tensor_cores=tc, prefetch=pf, int8_x=x8,
            stream_k=stream[0] if stream else 0)
    return tuned


@functools.lru_cache(maxsize=8)
def _tuned_file(path: str) -> dict[tuple[int, int, int, int, int], GemvConfig]:
    return tuned_from_sweep(path)


def tuned_config(key: tuple[int, int, int, int, int]) -> GemvConfig | None:
    """The sweep file's config for `key` (TANDEM_GEMV_TUNED names one; read
    per call, in a CUDA graph at capture), else TUNED's."""
    import os

    path = os.environ.get(TUNED_FILE_ENV, "")
    if path:
        swept = _tuned_file(path).get(key)
        if swept is not None:
            return swept
    return TUNED.get(key)


def pick_config(bits: int, n: int, k: int, rows: int, group: int, sms: int) -> GemvConfig:
    """The sweep file's or TUNED's config if the shape is there
    (tuned_config); else for one row the block shape and even K split with
    the fewest loop instructions per weight times the busiest SM's share of
    programs, and for more rows the tensor-core kernel."""
    tuned = tuned_config((bits, group, n, k, rows_bucket(rows)))
    if tuned is not None:
        return tuned
    want = 4 * sms
    if rows >= 2:
        # the CUDA-core loop pays each row's x separately (~12 instructions
        # per weight at 4 rows, bench.gemv_sass); tensor cores take any row
        # count at ~7
        programs = triton.cdiv(n, 64)
        split_k = 1
        if programs < want:
            split_k = min(triton.cdiv(want, programs), triton.cdiv(k, max(group, 256)),
                          MAX_SPLIT_K)
        return GemvConfig(64, max(group, 256), split_k, 4, 2, tensor_cores=True)
    best = None
    shapes = [(*shape, False) for shape in ROW1_SHAPES]
    if bits == 4 and group == 32:  # takes_int8_x's reach
        shapes += [(*shape, True) for shape in ROW1_X8_SHAPES]
    for block_n, block_k, warps, cost, int8_x in shapes:
        block_k = max(block_k, group)
        tiles = triton.cdiv(k, block_k)
        n_blocks = triton.cdiv(n, block_n)
        for want_split in range(1, min(tiles, MAX_SPLIT_K) + 1):
            per_split = triton.cdiv(tiles, want_split)
            split = triton.cdiv(tiles, per_split)
            programs = n_blocks * split
            per_sm = programs / sms
            # the busiest SM sets the time: whole programs, at least one each;
            # a split that does not divide the tiles runs its longest share
            imbalance = max(1.0, -(-programs // sms) / per_sm) if programs >= sms else \
                sms / programs
            uneven = per_split * split / tiles * (1.0 if tiles % split == 0 else 1.03)
            score = cost * imbalance * uneven * (1 + 0.02 * (split - 1))
            if best is None or score < best[0]:
                best = (score, GemvConfig(block_n, block_k, split, warps, 2, int8_x=int8_x))
    return best[1]
