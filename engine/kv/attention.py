"""Causal attention of new queries over paged (quantized) KV: the PyTorch
reference (the CPU path) and the dispatch to the Triton kernels
(attention_kernels.py) on CUDA.

Owns which keys each query sees: a batch of sequences, sequence b with
n_b new query tokens at the end of its kv_len_b keys (so its cached prefix is
kv_len_b - n_b tokens and the new tokens' K/V are already written), each new
query attending causally. Decode is n_b == 1, prefill any n_b; a batch may mix
both. It does not own who holds which page (the page table is handed in)
nor how pages are written (formats.py).
"""
from __future__ import annotations

import contextlib
import contextvars
import math
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.gpu_facts import multiprocessors
from engine.kv.formats import (Bf16Format, Int8Format, KVFormat, PagedRk4Format,
                               RotatedInt4Format)
from engine.switches import on_off, one_of
from engine.uploads import upload


@dataclass
class AttentionMetadata:
    """Which keys each sequence's queries see, on the device and on the host.

    q_offsets:  [B+1] int32, sequence b's queries are rows [q_offsets[b], q_offsets[b+1]);
    kv_lens:    [B] int32, keys of sequence b (its new tokens included);
    page_table: [B, P] int32, page ids, rows padded with page 0 past their need;
    max_new_tokens, max_kv_len: host bounds that size the kernel's grid;
    host_offsets, host_kv_lens, page_tables: the same on the host, for the
    reference path (page_tables: one unpadded long tensor per sequence).
    num_splits: fixed key splits (CUDA graphs); None picks per call.
    """

    q_offsets: torch.Tensor
    kv_lens: torch.Tensor
    page_table: torch.Tensor
    max_new_tokens: int
    max_kv_len: int
    host_offsets: list[int]
    host_kv_lens: list[int]
    page_tables: list[torch.Tensor] = field(default_factory=list)
    num_splits: int | None = None
    # the same sequences over a dense workspace (dense_prefill_attention),
    # built by the first layer that needs it
    _workspace: "AttentionMetadata | None" = field(default=None, repr=False)

    @classmethod
    def build(cls, offsets: list[int], kv_lens: list[int], page_tables: list[torch.Tensor],
              device: torch.device | str,
              host_page_tables: list | None = None) -> "AttentionMetadata":
        """host_page_tables: the same tables as host sequences, when the caller
        has them (reading device tables back is a stream sync)."""
        if len(offsets) != len(kv_lens) + 1 or len(page_tables) != len(kv_lens):
            raise ValueError(f"attention metadata: {len(offsets)} offsets, {len(kv_lens)} "
                             f"lengths and {len(page_tables)} page tables do not match")
        width = max(1, max(t.numel() for t in page_tables))
        table = torch.zeros(len(page_tables), width, dtype=torch.int32)
        for row, pages in enumerate(host_page_tables or page_tables):
            table[row, :len(pages)] = (torch.as_tensor(pages) if host_page_tables
                                       else pages.cpu())
        new_tokens = [hi - lo for lo, hi in zip(offsets, offsets[1:])]
        return cls(
            q_offsets=upload(offsets, torch.int32, device),
            kv_lens=upload(kv_lens, torch.int32, device),
            page_table=upload(table, torch.int32, device),
            max_new_tokens=max(new_tokens), max_kv_len=max(kv_lens),
            host_offsets=list(offsets), host_kv_lens=list(kv_lens),
            page_tables=list(page_tables))

    @property
    def is_decode(self) -> bool:
        return self.max_new_tokens == 1

    def workspace_bases(self, page_size: int) -> list[int]:
        """Where each sequence's keys start in a dense workspace that holds
        them back to back, each from a page boundary; the last entry is the
        workspace's size in tokens."""
        bases = [0]
        for kv_len in self.host_kv_lens:
            bases.append(bases[-1] + -(-kv_len // page_size) * page_size)
        return bases

    def over_workspace(self, page_size: int) -> "AttentionMetadata":
        """These queries and lengths over the dense workspace (workspace_bases)."""
        if self._workspace is None:
            bases = self.workspace_bases(page_size)
            device = self.kv_lens.device
            # host tables: build() reads them back to the host, which for
            # device ones is a stream sync inside the forward's first layer
            tables = [torch.arange(lo // page_size, hi // page_size)
                      for lo, hi in zip(bases, bases[1:])]
            self._workspace = AttentionMetadata.build(self.host_offsets, self.host_kv_lens,
                                                      tables, device)
        return self._workspace


# ----------------------------------------------------------------- reference


def paged_attention_reference(fmt: KVFormat, buffers: dict[str, torch.Tensor], q: torch.Tensor,
                              meta: AttentionMetadata, softmax_scale: float,
                              rotary=None) -> torch.Tensor:
    """q [T, Hq, D] -> out [T, Hq, D]: per sequence, read its dense K/V through
    the format's reference and run masked SDPA (GQA). The CPU path. A format
    that stores K before RoPE gets it applied here, from the key positions."""
    _check_rotary(fmt, rotary)
    out = torch.empty_like(q)
    for i, pages in enumerate(meta.page_tables):
        lo, hi = meta.host_offsets[i], meta.host_offsets[i + 1]
        kv_len = meta.host_kv_lens[i]
        start = kv_len - (hi - lo)
        k, v = fmt.read(buffers, pages, kv_len, q.dtype)
        key_pos = torch.arange(kv_len, device=q.device)
        if fmt.k_pre_rope:
            k = rotary.apply(k.float(), *rotary.cos_sin(key_pos, torch.float32)).to(q.dtype)
        query_pos = torch.arange(start, kv_len, device=q.device)
        mask = key_pos[None, :] <= query_pos[:, None]
        o = F.scaled_dot_product_attention(
            q[lo:hi].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=mask, scale=softmax_scale, enable_gqa=True)
        out[lo:hi] = o.transpose(0, 1)
    return out


def _check_rotary(fmt: KVFormat, rotary) -> None:
    if fmt.k_pre_rope and rotary is None:
        raise ValueError(f"KV format {fmt!r} stores K before RoPE: attention needs the "
                         "model's rotary embedding (rotary=...)")


# -------------------------------------------------------------------- triton


@dataclass(frozen=True)
class Tiles:
    """Kernel tile sizes: rows of (token, head) per program, keys per step."""

    rows: int
    block_n: int
    num_warps: int | None = None
    num_stages: int | None = None  # None: Triton's default
    dot_bf16: bool = False  # the two dots take bf16 operands (bf16 queries only)


# Batches with more new tokens per sequence than this are prefill chunks
# (speculative verify runs at most 9: GEMV_MAX_ROWS + 1).
PREFILL_DOT_BF16_FROM = 16
# A verify batch's (and a prefill's short tail's) tiles: 32 (token, head)
# rows on 8 warps, which hold a k=4 verify's 5 x 6 rows of a 27B KV head.
# At 64 rows on 4 warps the fp32 tiles spilled at head_dim 256 (sm_90 build,
# bench.attention_sass: 416 B a thread over int8 pages, 1,568 B over rk4,
# 440 B over rk4p; 8 / 0 / 0 B now), and a spilling kernel raises its
# context's stack limit for good: the H200's 24 GiB run (2026-12-03) found
# the decode worker's at 2,448 B, a 631 MiB local-memory reservation.
VERIFY_ROWS, VERIFY_WARPS = 32, 8


DECODE_BLOCK_N_ENV = "TANDEM_DECODE_BLOCK_N"


def decode_block_n(default: int) -> int:
    """Keys per step of decode's attention tiles: `default`, or the A/B
    override TANDEM_DECODE_BLOCK_N (16, 32, 64 or 128), the A/B switch of
    bench.decode and of the GPU parity tests."""
    return one_of(DECODE_BLOCK_N_ENV, default, (16, 32, 64, 128))


DECODE_STAGES_ENV = "TANDEM_DECODE_STAGES"


def decode_stages(default: int | None) -> int | None:
    """Pipeline stages of decode's attention tiles: `default` (None: Triton's),
    or the A/B override TANDEM_DECODE_STAGES (1 to 4). Stages reorder loads,
    not sums, so verify tiles need not follow. On the H200 (12-03 08:24) int8's
    decode attention alone ran 0.266-0.274 ms a 128K layer on one stage
    against 0.304-0.308 on Triton's default: a whole-step A/B is to decide."""
    return one_of(DECODE_STAGES_ENV, default, (1, 2, 3, 4))


PREFILL_BLOCK_N_ENV = "TANDEM_PREFILL_BLOCK_N"


def prefill_block_n(default: int) -> int:
    """Keys per step of a bf16 prefill chunk's 128-row tiles: `default`, or
    the A/B override TANDEM_PREFILL_BLOCK_N (32 or 64). At head_dim 256
    the 128 x 64 tile's fp32 accumulator fills the registers: its static
    sm_90 build keeps 16 B of stack over rk4 pages and 192 B over int8, the
    128 x 32 tile none and 80 B (BENCHMARKS.md, 2026-12-03 12:20); which is
    faster at the agent loop's shape (1.1K new over 100K) is for the GPU."""
    return one_of(PREFILL_BLOCK_N_ENV, default, (32, 64))


DECODE_DOT_BF16_ENV = "TANDEM_DECODE_DOT_BF16"


def decode_dot_bf16() -> bool:
    """Whether decode's and verify's tiles take bf16 dot operands (both or
    neither: speculative parity). Nsight Compute on the H200 (2026-12-03
    06:09) found the 128K rk4 decode attention bound by its shared memory
    (L1/TEX 92% busy, DRAM 8%), where the fp32 K and V tiles pass on their
    way into the tf32 dots; bf16 operands halve that traffic. At 06:19 one
    128K layer took 0.392 -> 0.190 ms (rk4) and 0.203 -> 0.185 ms (int8), the
    rk4 step 21.04 -> 18.66 ms (60.2 -> 68.5% of the roofline). The softmax
    and accumulators stay fp32; K, V, q and P round to bf16, well inside
    4-bit or int8 KV's own error. TANDEM_DECODE_DOT_BF16=0 gives fp32 back;
    read when tiles are chosen (at graph capture)."""
    return on_off(DECODE_DOT_BF16_ENV, True, on="bf16 dot operands in decode and verify",
                  off="fp32 (tf32) dot operands in decode and verify")


# With bf16 dot operands the 128K decode attention still took ~0.185 ms a
# layer on the H200 (rk4 and int8) where its bytes need ~0.05: the key
# tiles' instructions are the limit, and I2F (1/8 of FADD's rate on sm_90)
# runs once per K and V element. Both switches are read at every launch
# (attention_kernels.program_switches), so bench.attention's A/B takes them.
RK4_PAIRS_ENV = "TANDEM_RK4_PAIRS"
INT8_NO_I2F_ENV = "TANDEM_INT8_NO_I2F"


def rk4_pairs() -> bool:
    """Whether rk4 attention runs on even and odd channel tiles (rk4p's
    way: a byte's nibbles are one element of each, made fp32 by bit tricks)
    instead of channel-order tiles (an I2F per element, an interleave of the
    nibble tiles); the same K and V values, dots summed in another order."""
    return on_off(RK4_PAIRS_ENV, True, on="rk4 attention on channel-pair tiles",
                  off="rk4 attention on channel-order tiles")


INT8_CODES_DOT_ENV = "TANDEM_INT8_CODES_DOT"


def int8_codes_dot() -> bool:
    """Whether int8 attention puts the codes themselves into its dots and
    each key's scales on the scores and the probabilities
    (attention_kernels._attend_int8_codes) instead of dequantized tiles.
    The 27B's decode attention + combine, one int8 layer in CUDA graphs
    (H100, 2026-12-06, bench.attention --graph 20): 4K 12.2 -> 11.3 us,
    32K 51.8 -> 46.2, 128K 172.8 -> 150.1; the sm_90 decode build 255
    registers with spills -> 202 without, 2,396 -> 1,817 loop instructions.
    Read at every launch (program_switches)."""
    return on_off(INT8_CODES_DOT_ENV, True, on="int8 codes in the dots, scales outside",
                  off="dequantized int8 tiles in the dots")


def int8_no_i2f() -> bool:
    """Whether int8 attention makes its codes fp32 by bit tricks (2**23 +
    code + 128 from the bits, minus 2**23 + 128) instead of an I2F per
    element; exact either way, so the outputs are the same bits."""
    return on_off(INT8_NO_I2F_ENV, True, on="int8 codes to fp32 by bit tricks",
                  off="int8 codes to fp32 by I2F")


def tiles_for(head_dim: int, group: int, decode: bool, on_gpu: bool,
              fmt: KVFormat | None = None, q_dtype: torch.dtype | None = None,
              new_tokens: int = 0) -> Tiles:
    """new_tokens: the most new tokens of a sequence in the batch. Verify
    batches (a few tokens) take decode's key tiles and dot operands, so that
    speculative and plain decoding read the same numbers; prefill chunks
    take their own tiles."""
    if not on_gpu:  # the interpreter: the smallest tiles tl.dot takes
        return Tiles(rows=16, block_n=16)
    # rk4p at head_dim 256 (the 27B) asked for 248 KB of shared memory at
    # Triton's default stages, over the H200's 227 KB (2026-12-01): its K tiles
    # are dequantized and rotated in registers, so one stage loses little.
    # Since rk4p's key tiles branch once on whether their page is staged
    # (bench.attention_sass, static sm_90 build; BENCHMARKS.md, "rk4p
    # attention on even and odd channel tiles"), Triton no longer pipelines
    # the loads: 2 and 3 stages take the same 55 KB (verify 115 KB) and add
    # loop instructions (decode 1834 -> 1857, 1869). One stage; at 216
    # registers and 55 KB two programs share an SM, as a 131K-context
    # batch-1 decode's 256 programs need to run in one wave.
    rk4p_wide = isinstance(fmt, PagedRk4Format) and head_dim > 128
    stages = 1 if rk4p_wide else None
    block_n = 64 if head_dim <= 128 else 32
    if decode:  # one token: its GQA group's rows, padded to tl.dot's minimum of 16
        rows = max(16, 1 << (group - 1).bit_length())
        # rk4's nibbles and per-channel-block scales with fp32 dot operands
        # spilled 288 B a thread on 4 warps (bench.attention_sass, sm_90), so
        # those take 8; with bf16 operands 4 warps need no stack (188
        # registers) and ran a 128K layer in 0.185-0.188 ms against 8 warps'
        # 0.190-0.192 (H200, 2026-12-03 06:19 and 06:28)
        dot_bf16 = decode_dot_bf16()
        wide_rk4 = isinstance(fmt, RotatedInt4Format) and head_dim > 128
        warps = 8 if wide_rk4 and not dot_bf16 else 4
        if wide_rk4 and dot_bf16 and rk4_pairs():
            # rk4's channel-pair program (static sm_90 build, bench.attention_sass):
            # Triton's default 3 stages spill (255 registers, 24 B of stack), 8
            # warps take 186 registers, one program an SM (a 131K batch-1
            # decode's 256 programs in two waves); one stage takes 245, no
            # stack, two programs an SM, 1,869 loop instructions against
            # the channel-order tiles' 2,152 (no I2F among them)
            stages = 1
        return Tiles(rows=rows, block_n=_decode_keys(block_n, rk4p_wide), num_warps=warps,
                     num_stages=decode_stages(stages), dot_bf16=dot_bf16)
    chunk = new_tokens > PREFILL_DOT_BF16_FROM
    if chunk and q_dtype == torch.bfloat16 and not rk4p_wide:
        # bench.attention on the H200 (27B shape, 4K new over 32K, 2026-12-01):
        # bf16 dots at 128 x 64 tiles ran 4.1x (int8 pages) and 8.3x (bf16)
        # faster than fp32 dots at 64 x 32, at 216 / 276 TFLOP/s (SDPA: 318)
        return Tiles(rows=128, block_n=prefill_block_n(64), num_warps=8, dot_bf16=True)
    if not chunk:  # a verify batch walks the keys in decode's steps (the same sums)
        return Tiles(rows=VERIFY_ROWS, block_n=_decode_keys(block_n, rk4p_wide),
                     num_warps=VERIFY_WARPS, num_stages=stages, dot_bf16=decode_dot_bf16())
    return Tiles(rows=64, block_n=block_n, num_warps=4, num_stages=stages,
                 dot_bf16=q_dtype == torch.bfloat16)


def _decode_keys(block_n: int, rk4p_wide: bool) -> int:
    """Keys per tile of decode and verify: 64 at head_dim 256 too (H200, 27B
    shape, int8, 2026-12-02): decode attention alone at 131,072 tokens 0.307
    -> 0.256 ms a layer, the whole step 18.86 -> 18.44 ms, 4K unchanged; the
    speculative parity tests pass with it. rk4p's wide tiles keep theirs
    (registers and shared memory, above)."""
    return decode_block_n(block_n if rk4p_wide else 64)


def _kind_args(fmt: KVFormat, buffers: dict[str, torch.Tensor], rotary=None) -> tuple:
    from engine.kv import attention_kernels as K

    if isinstance(fmt, PagedRk4Format):
        _check_rotary(fmt, rotary)
        num_pages, page_size = buffers["k_codes"].shape[:2]
        inv_freq = rotary.inv_freq_on(buffers["k_codes"].device)
        if rotary.rotary_dim % 4:
            raise ValueError(f"rk4p attention pairs each rotary channel c with c + half on "
                             f"even/odd channel tiles: rotary_dim must be a multiple of 4, got "
                             f"{rotary.rotary_dim}")
        # the kernel reads channel pairs: k_min as int32 (two fp16), k_step as
        # int16 (two e5m3 codes), the bf16 staging pages as int32 (two bf16)
        return (K.RK4P, buffers["k_codes"], buffers["k_min"].view(torch.int32),
                buffers["v_codes"], buffers["v_scales"],
                fmt.v_block_for(buffers["k_min"].shape[-1]), False,
                buffers["k_step"].view(torch.int16),
                buffers["k_open"].view(torch.int32), buffers["v_open"].view(torch.int32),
                inv_freq, num_pages * page_size, rotary.rotary_dim)
    if isinstance(fmt, Bf16Format):
        k, v = buffers["k"], buffers["v"]
        if k.dtype == torch.bfloat16:
            k, v = k.view(torch.int16), v.view(torch.int16)
            return (K.DENSE_BF16, k, k, v, v, 1, False)
        return (K.DENSE, k, k, v, v, 1, False)
    if isinstance(fmt, Int8Format):
        return (K.INT8, buffers["k_codes"], buffers["k_scales"], buffers["v_codes"],
                buffers["v_scales"], 1, False)
    if isinstance(fmt, RotatedInt4Format):
        return (K.RK4, buffers["k_codes"], buffers["k_scales"], buffers["v_codes"],
                buffers["v_scales"], fmt.block, fmt.scale_format == "e8m0")
    raise ValueError(f"no attention kernel for KV format {fmt!r}")


# A prefill chunk's (row block, KV head) programs run about one per SM at
# head_dim 256. A short chunk over a long context (an agent turn: ~1.1K new
# tokens after 100K cached) leaves the last wave part-empty: on the H200,
# 27B shape, 1,100 queries x 100K keys are 208 programs on 132 SMs, and
# splitting the keys took 12.64 ms to 10.63 (4 ways) and 9.83 (8 ways) on
# the bf16 workspace, 15.97 to 13.78 and 12.64 on int8 pages in-kernel
# (bench.attention, BENCHMARKS.md 2026-12-02 12:04; 2 ways gained 1-4%).
# One split count besides 1 keeps the compiled variants (which the prefill
# warm-up compiles) at two.
PREFILL_KEY_SPLITS = 8
# Each split walks at least this many key tiles (512 keys at the prefill's
# 64-key tiles), so the combine's extra reads and writes stay small beside
# the split's own work.
PREFILL_MIN_TILES_PER_SPLIT = 8


def prefill_key_splits(row_programs: int, max_kv_len: int, block_n: int,
                       multiprocessors: int) -> int:
    """1 or PREFILL_KEY_SPLITS: split when, counting whole waves of one
    program per multiprocessor, the split grid finishes >10% sooner."""
    splits = PREFILL_KEY_SPLITS
    if max_kv_len < splits * PREFILL_MIN_TILES_PER_SPLIT * block_n:
        return 1

    def waves(s: int) -> float:  # in units of an unsplit program's time
        return math.ceil(row_programs * s / multiprocessors) / s

    return splits if waves(splits) < 0.9 * waves(1) else 1


def _multiprocessors(device: torch.device) -> int:
    # off the GPU: tests' short prefill chunks leave a wave part-empty
    return multiprocessors(device, off_gpu=8)


def _programs_wanted(device: torch.device) -> int:
    if device.type == "cuda":
        return 2 * _multiprocessors(device)
    return 4  # the interpreter: enough to exercise the split combine


def kernel_output(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The attention kernel's output buffer, written whole by it (a test
    poisons it)."""
    return torch.empty(shape, dtype=dtype, device=device)


# New tokens per sequence up to which rk4's attention kernel rotates q itself
# (decode, and verify's k + 1 <= 5 with room).
ROTATE_Q_MAX_NEW_TOKENS = 8


def paged_attention_triton(fmt: KVFormat, buffers: dict[str, torch.Tensor], q: torch.Tensor,
                           meta: AttentionMetadata, softmax_scale: float,
                           num_splits: int | None = None, rotary=None,
                           tiles: Tiles | None = None,
                           output_gate: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel path; same contract as paged_attention_reference. `tiles`
    replaces tiles_for's choice. With output_gate, the output times its
    sigmoid (gated_output says how), in the split combine where there is one."""
    from engine.kv import attention_kernels as K

    kind_args = _kind_args(fmt, buffers, rotary)
    page_size = next(iter(buffers.values())).shape[1]
    kv_heads = next(iter(buffers.values())).shape[2]
    rotated = isinstance(fmt, RotatedInt4Format) and fmt.rotate
    # rk4: attention runs in the stored space, in fp32 so the rotation adds no
    # rounding of its own: (q R).(k R) = q.k and softmax(.) (V R) = out R.
    # rk4p rotates V only: q as is, the output un-rotated.
    # rk4's channel-pair program can rotate q as it loads it (one launch
    # fewer). Every key split of the launch rotates its rows again: free for
    # decode's and verify's few rows, real work over a prefill chunk's
    # thousands, which keep the row kernel.
    kernel_rotates_q = (rotated and q.dtype in (torch.float32, torch.bfloat16)
                        and meta.max_new_tokens <= ROTATE_Q_MAX_NEW_TOKENS
                        and K.rotates_q_in_kernel(kind_args[0], q.shape[-1])
                        and fmt.rotates_in_kernels(q, "query"))
    q_in = fmt.to_stored_space(q).contiguous() if rotated and not kernel_rotates_q \
        else q.contiguous()
    rotated = rotated or isinstance(fmt, PagedRk4Format)
    group = q.shape[1] // kv_heads
    tiles = tiles or tiles_for(q.shape[-1], group, meta.is_decode, q.is_cuda, fmt, q.dtype,
                               meta.max_new_tokens)
    if num_splits is None:
        num_splits = meta.num_splits
    if num_splits is None and meta.max_new_tokens > PREFILL_DOT_BF16_FROM:
        row_programs = (-(-meta.max_new_tokens * group // tiles.rows)
                        * len(meta.host_kv_lens) * kv_heads)
        num_splits = prefill_key_splits(row_programs, meta.max_kv_len, tiles.block_n,
                                        _multiprocessors(q.device))
    if num_splits is None:
        # Decode, verify and a prefill's few-token tail (cut at its snapshot
        # page) split the keys: on one program per KV head such a tail walked
        # a 100K context alone. Past 64 key tiles the split count stays 64,
        # so long contexts compile no new NUM_SPLITS variants.
        row_blocks = -(-max(meta.max_new_tokens, 1) * group // tiles.rows)
        num_splits = K.splits_for(len(meta.host_kv_lens) * row_blocks, kv_heads,
                                  meta.max_kv_len, tiles.block_n, _programs_wanted(q.device))
    # the split combine can rotate the output back itself (one launch fewer)
    combine_rotates = (rotated and num_splits > 1 and q.dtype in (torch.float32, torch.bfloat16)
                       and fmt.rotates_in_kernels(q, "combine"))
    out = kernel_output(q.shape, torch.float32 if rotated and not combine_rotates else q.dtype,
                        q.device)
    signs = fmt.rotation_signs(q.shape[-1], q.device) \
        if combine_rotates or kernel_rotates_q else None
    # a combine that stores the final output (q's dtype) can gate it
    combine_gates = (output_gate is not None and out.dtype == q.dtype
                     and not K.gate_refusal(output_gate, out, num_splits)
                     and combine_gates_wanted())
    K.launch(kind_args, q_in, meta.q_offsets, meta.kv_lens, meta.page_table, page_size,
             kv_heads, meta.max_new_tokens, softmax_scale, out, num_splits,
             tiles.rows, tiles.block_n, tiles.num_warps, tiles.num_stages,
             tiles.dot_bf16 and q.dtype == torch.bfloat16,
             signs if combine_rotates else None, signs if kernel_rotates_q else None,
             output_gate if combine_gates else None)
    if rotated and not combine_rotates:
        # fp32 out: the rotation back and the cast to q's dtype in one pass
        out = fmt.unrotate_output(out, dtype=q.dtype)
    if output_gate is not None and not combine_gates:
        return gated_output(out, output_gate)
    return out


COMBINE_GATE_ENV = "TANDEM_COMBINE_GATE"


def combine_gates_wanted() -> bool:
    """Whether the split combine applies the gated attention's output gate
    (TANDEM_COMBINE_GATE, on by default; read at launch, in a CUDA graph at
    capture): one launch fewer per attention layer where the combine runs
    (decode, verify), with the separate gate's rounding steps (its numbers
    to an ulp: _gated says why)."""
    return on_off(COMBINE_GATE_ENV, True, on="the output gate in the split combine",
                  off="the output gate in its own launch")


def gated_output(out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """out [T, Hq, D] * round(sigmoid(gate)) in out's dtype by engine/fused's
    kernel (its reference where the fused ops do not run): the model's
    output gate, where no split combine took it."""
    from engine.fused import load_kernels, reference, use_fused

    flat = out.reshape(out.shape[0], -1)
    if use_fused(out):
        return load_kernels().sigmoid_gate(flat, gate).view(out.shape)
    return reference.sigmoid_gate(flat, gate.reshape(flat.shape)).view(out.shape)


# ------------------------------------------------------- dense prefill chunks

# Keys dequantized per step of dense_prefill_attention: bounds the reads'
# fp32 temporaries (rk4p: ~5 x 4 bytes per element) whatever the context.
DENSE_READ_SLICE_TOKENS = 4096
# The workspace's bound in tokens (K and V of one layer, bf16; 256 MiB on the
# 27B): a prefill batch whose keys reach further keeps the in-kernel
# dequantization, so a 262K context fits a 24 GiB plan. kvstore/plan.py
# reserves this much. TANDEM_PREFILL_WORKSPACE_TOKENS moves it (a card with
# room: long-context prefills stay on the dense path), for the plan too.
DENSE_PREFILL_MAX_TOKENS = 65536


def dense_prefill_max_tokens() -> int:
    raw = os.environ.get("TANDEM_PREFILL_WORKSPACE_TOKENS", "")
    if not raw:
        return DENSE_PREFILL_MAX_TOKENS
    if not raw.isdigit():
        raise ValueError(f"TANDEM_PREFILL_WORKSPACE_TOKENS must be a token count, got {raw!r}")
    return int(raw)


# Set inside paged_prefill_attention(): per thread of one process, never shared.
_PAGED_PREFILL = contextvars.ContextVar("tandem_paged_prefill", default=False)


@contextlib.contextmanager
def paged_prefill_attention():
    """Prefill chunks run inside this block dequantize their keys inside the
    attention kernel, as chunks whose keys outgrow the workspace do. The
    prefill warm-up compiles that path on a short context: a 260,000-token
    prompt otherwise met it at its 129th chunk and waited 1.3-2.5 s for two
    compiles mid-request (BENCHMARKS.md, 2026-12-05 14:56)."""
    token = _PAGED_PREFILL.set(True)
    try:
        yield
    finally:
        _PAGED_PREFILL.reset(token)


def paged_prefill_asked() -> bool:
    """Whether prefill chunks must dequantize in-kernel: this thread is inside
    paged_prefill_attention(), or TANDEM_PREFILL_ATTENTION=paged."""
    return (_PAGED_PREFILL.get()
            or os.environ.get("TANDEM_PREFILL_ATTENTION", "dense") == "paged")


def dense_prefill_wanted(fmt: KVFormat, buffers: dict[str, torch.Tensor], q: torch.Tensor,
                         meta: AttentionMetadata) -> bool:
    """A prefill chunk in bf16 over quantized pages whose keys fit the
    workspace, unless paged_prefill_asked()."""
    if (q.dtype != torch.bfloat16 or isinstance(fmt, Bf16Format)
            or meta.max_new_tokens <= PREFILL_DOT_BF16_FROM or paged_prefill_asked()):
        return False
    page_size = next(iter(buffers.values())).shape[1]
    return meta.workspace_bases(page_size)[-1] <= dense_prefill_max_tokens()


def dequantize_into(fmt: KVFormat, buffers: dict[str, torch.Tensor], pages: torch.Tensor,
                    kv_len: int, k_out: torch.Tensor, v_out: torch.Tensor, rotary=None,
                    slice_tokens: int | None = None, use_triton: bool = True) -> None:
    """A sequence's first kv_len keys and values as attention over the pages
    sees them, into k_out / v_out [kv_len, H, D]: in the stored space (the
    caller maps the query with fmt.rotate_query and the output with
    fmt.unrotate_output), RoPE applied to a K stored before it. Rotating a
    100K-token prefix back per layer cost two [100K * H, D] x [D, D] fp32
    matmuls per prefill chunk; the query and output are a chunk's rows only.

    The kernels read in one pass straight into the outputs (rk4p: one kernel
    that also applies RoPE); the PyTorch reference (use_triton=False) reads a
    few pages at a time, which bounds its fp32 temporaries whatever the
    context."""
    if use_triton:
        if isinstance(fmt, PagedRk4Format):
            from engine.kv import attention_kernels as K

            K.rk4p_dense(_kind_args(fmt, buffers, rotary), pages, kv_len, k_out, v_out,
                         buffers["k_codes"].shape[1])
        else:
            fmt.read_rotated_into(buffers, pages, kv_len, k_out, v_out, use_triton=True)
        return
    page_size = next(iter(buffers.values())).shape[1]
    step = max(1, (slice_tokens or DENSE_READ_SLICE_TOKENS) // page_size) * page_size
    # RoPE runs in fp32 like the reference's; other formats read bf16
    dtype = torch.float32 if fmt.k_pre_rope else torch.bfloat16
    for lo in range(0, kv_len, step):
        hi = min(kv_len, lo + step)
        k, v = fmt.read_rotated(buffers, pages[lo // page_size:], hi - lo, dtype,
                                use_triton=False)
        if fmt.k_pre_rope:
            k = rotary.apply(k, *rotary.cos_sin(torch.arange(lo, hi, device=k.device),
                                                torch.float32))
        k_out[lo:hi] = k
        v_out[lo:hi] = v


def workspace(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """bf16 scratch for dense_prefill_attention (a test poisons it)."""
    return torch.empty(shape, dtype=torch.bfloat16, device=device)


def dense_prefill_attention(fmt: KVFormat, buffers: dict[str, torch.Tensor], q: torch.Tensor,
                            meta: AttentionMetadata, softmax_scale: float,
                            rotary=None) -> torch.Tensor:
    """Attention of a prefill chunk over quantized pages, through a bf16
    workspace: every sequence's keys dequantized once per layer (in the
    format's stored space, RoPE applied: dequantize_into), then the
    bf16-page kernel (bf16 dots at 128 x 64 tiles) on the query mapped into
    that space, and the output mapped back. Dequantizing inside the
    attention kernel instead repeats it for every 128-row block of queries
    and, at head_dim 256, spills registers: on the H200 (27B shape, 32K
    tokens, 2026-12-02) rk4 prefill ran at 21% MFU and rk4p at 3.5% against
    int8's 57%. The workspace is one layer's K and V at the batch's length,
    the plan's "one layer's K and V dequantized" (kvstore/plan.py), up to
    dense_prefill_max_tokens()."""
    _check_rotary(fmt, rotary)
    page_size, kv_heads = next(iter(buffers.values())).shape[1:3]
    bases = meta.workspace_bases(page_size)
    shape = (bases[-1] // page_size, page_size, kv_heads, q.shape[-1])
    k_ws, v_ws = workspace(shape, q.device), workspace(shape, q.device)
    k_flat, v_flat = k_ws.view(-1, *shape[2:]), v_ws.view(-1, *shape[2:])
    for base, pages, kv_len in zip(bases, meta.page_tables, meta.host_kv_lens):
        dequantize_into(fmt, buffers, pages, kv_len, k_flat[base:base + kv_len],
                        v_flat[base:base + kv_len], rotary)
    out = paged_attention_triton(Bf16Format(), {"k": k_ws, "v": v_ws}, fmt.rotate_query(q),
                                 meta.over_workspace(page_size), softmax_scale)
    return fmt.unrotate_output(out)


def paged_attention(fmt: KVFormat, buffers: dict[str, torch.Tensor], q: torch.Tensor,
                    meta: AttentionMetadata, softmax_scale: float | None = None,
                    use_triton: bool | None = None, rotary=None,
                    output_gate: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of q [T, Hq, D] over the pages: the Triton kernels on CUDA
    tensors (prefill chunks over quantized pages through a dense bf16
    workspace), the PyTorch reference elsewhere (use_triton forces either).
    rotary: the model's Rotary, needed by formats that store K before RoPE.
    output_gate ([T, Hq, D] in q's dtype, unit stride along D): the output
    times round(sigmoid(gate)) (gated_output), in the split combine where
    one runs (combine_gates_wanted)."""
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    choice = fmt.use_triton if use_triton is None else use_triton
    if (q.is_cuda if choice is None else choice):
        if dense_prefill_wanted(fmt, buffers, q, meta):
            out = dense_prefill_attention(fmt, buffers, q, meta, scale, rotary=rotary)
        else:
            return paged_attention_triton(fmt, buffers, q, meta, scale, rotary=rotary,
                                          output_gate=output_gate)
    else:
        out = paged_attention_reference(fmt, buffers, q, meta, scale, rotary=rotary)
    return out if output_gate is None else gated_output(out, output_gate)
