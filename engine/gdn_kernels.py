"""Fused Gated DeltaNet steps for short runs of new tokens (decode: 1 token per
sequence; speculative verify: k+1), as Triton kernels with their PyTorch
references beside them.

Two kernels per GDN layer replace the dozens of small ones of the batched
PyTorch path (engine/gdn_batched.py):

- `conv_step`: the depthwise causal conv + SiLU over each sequence's new
  tokens, reading the conv window of its input slot (zeros for a fresh
  sequence) and writing the window after token j to that token's write slot;
- `recurrence_step`: q/k L2 norm, the decay g and the gate beta from the raw
  a/b projections, and the gated delta rule, reading the fp32 state of the
  input slot (zeros when fresh) and writing the state after token j to that
  token's write slot.

And for the chunked prefill (longer runs): `conv_chunk`, the conv + SiLU of
a whole batch in one launch, and `l2_normalize_heads`, q/k's L2 norm ahead
of fla-core's chunked rule.

The batch layout is the model's: tokens packed along rows, sequence i owns
rows [offsets[i], offsets[i+1]) with at most `max_tokens` rows. Per token a
write slot says where the state (and conv window) after it goes, -1 for
nowhere: decode writes only the last token's, to the input slot; verify
writes every token's to its position slot. A sequence is fresh when its first
new token sits at position 0. An input slot of -1 marks a padding copy that
no program computes: CUDA graphs pad a batch with copies of its last
sequence, and a copy reading the slot its original has just written would
see the wrong state, so the caller copies the original's output rows
instead. Every index is a device tensor and nothing syncs with the host, so
both steps can be captured in a CUDA graph.

Owns only the arithmetic of these steps; it does not know about caches,
batches or slot allocation (callers hand in tensors). The references call
engine/gdn.py, the CPU path, which stays the ground truth.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engine.gdn import causal_conv1d, l2_normalize, recurrent_gated_delta_rule
from engine.kv.kernels import _load_dense, _store_dense
from engine.kv.kernels import as_kernel_dense as _as_kernel
from engine.pdl import pdl_launch, pdl_prologue
from engine.switches import on_off, one_of

MAX_TOKENS = 8  # new tokens per sequence these kernels take (verify is k+1 <= 5)

# Tile widths of the decode/verify steps: how many programs a step's GDN
# layer spreads over (27B at batch 1: 80 conv programs of 128 channels, 192
# recurrence programs of 32 value columns). Both kernels are latency bound
# there; the A/B overrides below found no width faster on the H200 (conv
# 64/128/256, columns 16/32/64: every rk4 step within 0.1 ms, 2026-12-03
# 16:30, BENCHMARKS.md). Any width computes the same values (programs own
# disjoint channels or columns). (GDN's gated output norm as the
# recurrence's last op, one 16-warp program a whole head so that it sees the
# head's row, lost 0.06 ms of the int4 step on an H100 against four programs
# of 32 columns and the norm's own launch: 12-07 15:17.)
CONV_BLOCK_ENV = "TANDEM_GDN_CONV_BLOCK"
BLOCK_V_ENV = "TANDEM_GDN_BLOCK_V"


def conv_block_c() -> int:
    """Channels per conv-step program: 128, or TANDEM_GDN_CONV_BLOCK."""
    return one_of(CONV_BLOCK_ENV, 128, (32, 64, 128, 256))


def recurrence_block_v(dv: int) -> int:
    """Value columns per recurrence-step program: 32 (at most dv, a power
    of two), or TANDEM_GDN_BLOCK_V."""
    width = triton.next_power_of_2(dv)
    return min(one_of(BLOCK_V_ENV, 32, (8, 16, 32, 64, 128)), width)


STATE_EARLY_ENV = "TANDEM_GDN_STATE_EARLY"


def recurrence_state_early() -> bool:
    """Whether the recurrence step reads its state tiles before waiting for
    the kernel before it: on by default (TANDEM_GDN_STATE_EARLY=0 reads them
    after; read at launch, in a CUDA graph at capture). Safe under
    programmatic dependent launch: a kernel launches only when the one
    before it has passed its own wait, so every kernel but the one right
    before has finished, and that one (in_proj's GEMV, or the conv step)
    writes no state. The int4 27B step, alternating runs (BENCHMARKS.md,
    2026-12-06 08:11-08:45): H200 5.32 ms in three runs against 5.34-5.36
    without, H100 6.62 against 6.66-6.67; the recurrence's share of a step
    5.23 -> 3.83 us a layer."""
    return on_off(STATE_EARLY_ENV, True, on="states read before the wait",
                  off="states read after it")


def fits(max_new_tokens: int) -> bool:
    """Whether a batch whose longest sequence runs `max_new_tokens` can use them."""
    return 1 <= max_new_tokens <= MAX_TOKENS


def _bucket(max_tokens: int) -> int:
    """The kernels' MAX_T (a constexpr: one compile per value): 1 for decode,
    else MAX_TOKENS, since each token is guarded by its sequence's own count.
    A prefill's tail after its snapshot page runs 1..page_size tokens, and
    with MAX_T = its length every new length compiled both kernels anew
    (1-5 s of an agent turn on the H200, 2026-12-02)."""
    return 1 if max_tokens == 1 else MAX_TOKENS


# ---------------------------------------------------------------- conv step


# A prefill chunk cut at a snapshot runs its part after it on these kernels
# over row slices of the chunk's per-token tensors (engine/batch.py
# SnapshotSplit): positions[47:] of an int64 tensor starts 376 bytes in, and
# Triton compiles a variant per pointer that is or is not 16-byte aligned. A
# request whose part began at an odd row compiled both kernels anew (H100,
# 12-05 17:33, tests/test_cuda.py: 0.3-1.7 s each). These pointers feed
# scalar loads only, so their alignment buys nothing.
_SCALAR_POINTERS = ("offsets_ptr", "positions_ptr", "in_slots_ptr", "write_slots_ptr")


@triton.jit(do_not_specialize_on_alignment=_SCALAR_POINTERS)
def _conv_step_kernel(mixed_ptr, mixed_stride, windows_ptr, w_stride_slot, w_stride_c,
                      weight_ptr, out_ptr, offsets_ptr, positions_ptr, in_slots_ptr,
                      write_slots_ptr, channels,
                      KERNEL: tl.constexpr, MAX_T: tl.constexpr, HIST: tl.constexpr,
                      BLOCK_C: tl.constexpr, X_BF16: tl.constexpr, WIN_BF16: tl.constexpr,
                      W_BF16: tl.constexpr, PDL: tl.constexpr):
    """One (sequence, channel block). The history tile holds, per channel, the
    K-1 window inputs then the new tokens' inputs: column i < K-1 is window
    column i, column K-1+t is token t. It is read whole before the first
    write, so a write slot equal to the input slot (verify's position 0,
    decode's only write) cannot feed back into this program's reads; other
    programs touch other channels or other slots."""
    pdl_prologue(PDL)
    seq = tl.program_id(0)
    cb = tl.program_id(1)
    lo = tl.load(offsets_ptr + seq)
    n = tl.load(offsets_ptr + seq + 1) - lo
    warm = tl.load(positions_ptr + lo) > 0  # not fresh: the input slot holds its state
    slot = tl.load(in_slots_ptr + seq).to(tl.int64)
    live = slot >= 0  # -1: a padding copy of another sequence, computed by none
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < channels
    cols = tl.arange(0, HIST)
    token = cols - (KERNEL - 1)
    in_window = (cols < KERNEL - 1) & warm & live
    in_tokens = (token >= 0) & (token < n)
    win = _load_dense(windows_ptr, slot * w_stride_slot + c[:, None] * w_stride_c + cols[None, :],
                    c_ok[:, None] & in_window[None, :], WIN_BF16)
    new = _load_dense(mixed_ptr, (lo + token[None, :]).to(tl.int64) * mixed_stride + c[:, None],
                    c_ok[:, None] & in_tokens[None, :], X_BF16)
    hist = win + new
    for t in tl.static_range(MAX_T):
        if (t < n) & live:
            # y_t = sum_j w[c, j] * hist[c, t + j]: the weights laid along the tile
            tap = cols - t
            w = _load_dense(weight_ptr, c[:, None] * KERNEL + tap[None, :],
                          c_ok[:, None] & ((tap >= 0) & (tap < KERNEL))[None, :], W_BF16)
            y = tl.sum(hist * w, axis=1)
            y = y / (1.0 + tl.exp(-y))  # SiLU
            _store_dense(out_ptr, (lo + t).to(tl.int64) * channels + c, y, c_ok, X_BF16)
            dst = tl.load(write_slots_ptr + lo + t)
            if dst >= 0:  # the window after token t: history columns t+1 .. t+K-1
                keep = (cols > t) & (cols < t + KERNEL)
                _store_dense(windows_ptr, dst.to(tl.int64) * w_stride_slot
                           + c[:, None] * w_stride_c + (cols - t - 1)[None, :],
                           hist, c_ok[:, None] & keep[None, :], WIN_BF16)


def conv_step(mixed: torch.Tensor, windows: torch.Tensor, weight: torch.Tensor,
              offsets: torch.Tensor, positions: torch.Tensor, in_slots: torch.Tensor,
              write_slots: torch.Tensor, max_tokens: int, block_c: int | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """mixed [T, C] (rows of each sequence's new tokens); windows [S, C, K-1]
    updated at the write slots; weight [C, K]; offsets [B+1] int32; positions
    [T] long; in_slots [B] long (-1: a padding sequence, skipped, its rows
    left as they are); write_slots [T] long (-1: none).
    Returns SiLU(conv) [T, C] in mixed's dtype (written into `out` if given)."""
    _check_fits(max_tokens)
    tokens, channels = mixed.shape
    kernel = weight.shape[-1]
    if mixed.stride(1) != 1 or windows.stride(2) != 1 or not weight.is_contiguous():
        raise ValueError("conv_step needs unit-stride channels and windows, "
                         "and a contiguous weight")
    if out is None:
        out = torch.empty(tokens, channels, dtype=mixed.dtype, device=mixed.device)
    (x, x_bf16), (win, win_bf16), (w, w_bf16) = map(_as_kernel, (mixed, windows, weight))
    block_c = block_c or conv_block_c()
    grid = (in_slots.shape[0], triton.cdiv(channels, block_c))
    _conv_step_kernel[grid](
        x, mixed.stride(0), win, windows.stride(0), windows.stride(1), w, _as_kernel(out)[0],
        offsets, positions, in_slots, write_slots, channels,
        KERNEL=kernel, MAX_T=_bucket(max_tokens),
        HIST=triton.next_power_of_2(kernel - 1 + _bucket(max_tokens)),
        BLOCK_C=block_c, X_BF16=x_bf16, WIN_BF16=win_bf16, W_BF16=w_bf16,
        **pdl_launch(mixed.device))
    return out


def conv_step_reference(mixed, windows, weight, offsets, positions, in_slots, write_slots,
                        max_tokens: int) -> torch.Tensor:
    """conv_step through engine/gdn.py's causal_conv1d, one sequence at a time."""
    _check_fits(max_tokens)
    out = torch.empty_like(mixed)
    offsets, positions = offsets.tolist(), positions.tolist()
    in_slots, write_slots = in_slots.tolist(), write_slots.tolist()
    reads = [windows[s].clone() for s in in_slots]  # every read before any write
    width = weight.shape[-1] - 1
    for i, slot in enumerate(in_slots):
        lo, hi = offsets[i], offsets[i + 1]
        if slot < 0:  # a padding copy: computed by none
            continue
        window = torch.zeros_like(reads[i]) if positions[lo] == 0 else reads[i]
        out[lo:hi], _ = causal_conv1d(mixed[lo:hi], window, weight)
        history = torch.cat((window.to(mixed.dtype), mixed[lo:hi].t()), dim=-1)
        for j in range(hi - lo):
            if write_slots[lo + j] >= 0:
                windows[write_slots[lo + j]] = history[:, j + 1:j + 1 + width]
    return out


# ------------------------------------------------------------- conv chunk


@triton.jit(do_not_specialize=("tokens",))
def _conv_chunk_kernel(mixed_ptr, mixed_stride, windows_ptr, w_stride_slot, w_stride_c,
                       weight_ptr, out_ptr, row_seq_ptr, offsets_ptr, slots_ptr, positions_ptr,
                       tokens, channels,
                       KERNEL: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                       X_BF16: tl.constexpr, WIN_BF16: tl.constexpr, W_BF16: tl.constexpr):
    """One (row block, channel block) of a prefill batch: every row is one
    token, tap j reads the input K-1-j rows before it, from its own
    sequence's rows or, before the sequence's first new token, from the
    sequence's conv window (zeros when fresh: its first new token at
    position 0, as in the conv step). Nothing is written to the
    windows here (rows of one sequence span programs, and all must read the
    old window): conv_chunk updates them afterwards."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    r_ok = rows < tokens
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < channels
    seq = tl.load(row_seq_ptr + rows, mask=r_ok, other=0)
    lo = tl.load(offsets_ptr + seq, mask=r_ok, other=0)
    slot = tl.load(slots_ptr + seq, mask=r_ok, other=0).to(tl.int64)
    warm = tl.load(positions_ptr + lo, mask=r_ok, other=0) > 0
    acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
    for j in tl.static_range(KERNEL):
        p = rows - lo - (KERNEL - 1) + j   # the tap's position among the sequence's new tokens
        from_x = (p >= 0) & r_ok
        from_window = (p < 0) & warm & r_ok
        x = _load_dense(mixed_ptr, (lo + p).to(tl.int64)[:, None] * mixed_stride + c[None, :],
                        from_x[:, None] & c_ok[None, :], X_BF16)
        w = _load_dense(windows_ptr, slot[:, None] * w_stride_slot + c[None, :] * w_stride_c
                        + (KERNEL - 1 + p)[:, None],
                        from_window[:, None] & c_ok[None, :], WIN_BF16)
        tap = _load_dense(weight_ptr, c * KERNEL + j, c_ok, W_BF16)
        acc += (x + w) * tap[None, :]
    y = acc / (1.0 + tl.exp(-acc))  # SiLU
    _store_dense(out_ptr, rows.to(tl.int64)[:, None] * channels + c[None, :], y,
                 r_ok[:, None] & c_ok[None, :], X_BF16)


def conv_chunk(mixed: torch.Tensor, windows: torch.Tensor, weight: torch.Tensor,
               row_seq: torch.Tensor, seq_offsets: torch.Tensor, positions: torch.Tensor,
               seq_slots: torch.Tensor, offsets: list[int], slots: list[int],
               fresh: list[bool], block_t: int = 8, block_c: int = 256) -> torch.Tensor:
    """The prefill's conv + SiLU: mixed [T, C], sequence i owning rows
    [offsets[i], offsets[i+1]) and reading the window of slots[i] (zeros
    where fresh[i]); windows [S, C, K-1] then hold each sequence's last K-1
    inputs. One launch for the batch, instead of a cat, a conv and a SiLU per
    sequence. The device indices are the batch's, built once for all layers:
    row_seq [T] int32 (each row's sequence), seq_offsets [B+1] int32,
    positions [T] long, seq_slots [B] long; the host lists say the same for
    the window update. Returns [T, C] in mixed's dtype.

    8 x 256 tiles: every tap's int64 addresses are live at once, and 64 x 128
    tiles spilled them (sm_90 build: 4,920 B of stack a thread; on the H200
    1,048 B, which raised the prefill worker's stack reservation to 270 MiB);
    8 x 256 needs 168-190 registers and no stack."""
    tokens, channels = mixed.shape
    kernel = weight.shape[-1]
    if mixed.stride(1) != 1 or windows.stride(2) != 1 or not weight.is_contiguous():
        raise ValueError("conv_chunk needs unit-stride channels and windows, "
                         "and a contiguous weight")
    out = torch.empty(tokens, channels, dtype=mixed.dtype, device=mixed.device)
    (x, x_bf16), (win, win_bf16), (w, w_bf16) = map(_as_kernel, (mixed, windows, weight))
    grid = (triton.cdiv(tokens, block_t), triton.cdiv(channels, block_c))
    _conv_chunk_kernel[grid](
        x, mixed.stride(0), win, windows.stride(0), windows.stride(1), w, _as_kernel(out)[0],
        row_seq, seq_offsets, seq_slots, positions, tokens, channels,
        KERNEL=kernel, BLOCK_T=block_t, BLOCK_C=block_c,
        X_BF16=x_bf16, WIN_BF16=win_bf16, W_BF16=w_bf16)
    _keep_last_inputs(mixed, windows, offsets, slots, fresh)
    return out


@triton.jit(do_not_specialize=("rows",))
def _l2_normalize_kernel(x_ptr, out_ptr, rows, token_stride, HEADS: tl.constexpr,
                         D: tl.constexpr, ROWS: tl.constexpr, X_BF16: tl.constexpr):
    """ROWS (token, head) rows of D channels each: x * rsqrt(sum(x^2) + 1e-6)
    in fp32, stored in x's dtype into a contiguous [tokens, HEADS, D]."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok = r < rows
    token, head = (r // HEADS).to(tl.int64), r % HEADS
    d = tl.arange(0, D)
    x = _load_dense(x_ptr, (token * token_stride + head * D)[:, None] + d[None, :],
                    ok[:, None], X_BF16)
    y = x * tl.rsqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None]
    _store_dense(out_ptr, r.to(tl.int64)[:, None] * D + d[None, :], y, ok[:, None], X_BF16)


def l2_normalize_heads(x: torch.Tensor, rows_per_program: int = 16) -> torch.Tensor:
    """GDN's q/k L2 norm for the prefill's chunked rule: x [T, H, D] (heads
    and channels contiguous, tokens at any stride: a column block of the conv
    output) -> a new contiguous tensor in x's dtype. fla-core's own norm
    (use_qk_l2norm_in_kernel) autotunes through configs that spill (808 B of
    stack a thread on the H200, 2026-12-03), and one launch of a spilling
    kernel keeps the prefill worker's local-memory reservation up by
    ~210 MiB for good (engine/cuda_context.py); the same arithmetic here
    needs no stack."""
    tokens, heads, dim = x.shape
    if x.stride(2) != 1 or x.stride(1) != dim or dim & (dim - 1):
        raise ValueError(f"l2_normalize_heads needs contiguous heads of a power-of-two "
                         f"width, got shape {tuple(x.shape)}, strides {x.stride()}")
    out = torch.empty(tokens, heads, dim, dtype=x.dtype, device=x.device)
    rows = tokens * heads
    if rows:
        (xk, x_bf16), (ok_, _) = _as_kernel(x), _as_kernel(out)
        _l2_normalize_kernel[(triton.cdiv(rows, rows_per_program),)](
            xk, ok_, rows, x.stride(0), HEADS=heads, D=dim, ROWS=rows_per_program,
            X_BF16=x_bf16)
    return out


def l2_normalize_heads_reference(x: torch.Tensor) -> torch.Tensor:
    return l2_normalize(x.float()).to(x.dtype)


def _keep_last_inputs(mixed, windows, offsets, slots, fresh) -> None:
    """Each sequence's window becomes its last K-1 inputs (the old window's
    tail first when the sequence ran fewer than K-1 new tokens)."""
    width = windows.shape[-1]
    for i, slot in enumerate(slots):
        lo, hi = offsets[i], offsets[i + 1]
        new = mixed[max(lo, hi - width):hi].t().to(windows.dtype)
        if hi - lo < width:
            old = torch.zeros_like(windows[slot]) if fresh[i] else windows[slot]
            new = torch.cat((old[:, hi - lo:], new), dim=-1)
        windows[slot] = new


def conv_chunk_reference(mixed, windows, weight, offsets, slots, fresh) -> torch.Tensor:
    """conv_chunk through engine/gdn.py's causal_conv1d, one sequence at a time."""
    out = torch.empty_like(mixed)
    for i, slot in enumerate(slots):
        lo, hi = offsets[i], offsets[i + 1]
        window = torch.zeros_like(windows[slot]) if fresh[i] else windows[slot]
        out[lo:hi], windows[slot] = causal_conv1d(mixed[lo:hi], window, weight)
    return out


# ---------------------------------------------------------- recurrence step


@triton.jit(do_not_specialize_on_alignment=(*_SCALAR_POINTERS, "a_ptr", "b_ptr"))
def _recurrence_step_kernel(q_ptr, k_ptr, v_ptr, row_stride, a_ptr, b_ptr, gate_stride,
                            a_log_ptr, dt_bias_ptr, states_ptr, out_ptr,
                            offsets_ptr, positions_ptr, in_slots_ptr, write_slots_ptr,
                            scale,
                            HV: tl.constexpr, GROUPS: tl.constexpr, DK: tl.constexpr,
                            DV: tl.constexpr, DK_PAD: tl.constexpr, BLOCK_V: tl.constexpr,
                            MAX_T: tl.constexpr, X_BF16: tl.constexpr, G_BF16: tl.constexpr,
                            A_LOG_BF16: tl.constexpr, DT_BF16: tl.constexpr,
                            STATE_EARLY: tl.constexpr, PDL: tl.constexpr):
    """One (sequence, value head, block of value columns): the state tile
    [DK, BLOCK_V] stays in registers across the sequence's tokens. It is read
    before the first write, so a write slot equal to the input slot is safe;
    no other program reads or writes this tile of these slots.

    STATE_EARLY: the tile is loaded before the dependent-launch wait, while
    the kernel before (in_proj's GEMV or the conv) still runs. No kernel of
    the step writes a state before this one: the slot indexes and positions
    are the batch's host copies, and the tile was last written by this
    layer's kernel a step ago (recurrence_state_early says why that is
    complete)."""
    if not STATE_EARLY:
        pdl_prologue(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    vb = tl.program_id(2)
    kh = head // GROUPS  # consecutive value heads share a q/k head
    lo = tl.load(offsets_ptr + seq)
    n = tl.load(offsets_ptr + seq + 1) - lo
    warm = tl.load(positions_ptr + lo) > 0  # not fresh: the input slot holds its state
    slot = tl.load(in_slots_ptr + seq).to(tl.int64)
    live = slot >= 0  # -1: a padding copy of another sequence, computed by none
    dk = tl.arange(0, DK_PAD)
    dv = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    dk_ok = dk < DK
    dv_ok = dv < DV
    tile = dk[:, None] * DV + dv[None, :]
    tile_ok = dk_ok[:, None] & dv_ok[None, :]
    state_size = HV * DK * DV
    head_base = head * DK * DV
    state = tl.load(states_ptr + slot * state_size + head_base + tile,
                    mask=tile_ok & warm & live, other=0.0)
    if STATE_EARLY:
        pdl_prologue(PDL)
    # g = -exp(A_log) * softplus(a + dt_bias) in fp32 (softplus linear past 20, as torch's)
    one = head < HV  # a true mask for the scalar loads
    neg_rate = -tl.exp(_load_dense(a_log_ptr, head, one, A_LOG_BF16))
    dt_bias = _load_dense(dt_bias_ptr, head, one, DT_BF16)
    for t in tl.static_range(MAX_T):
        if (t < n) & live:
            row = (lo + t).to(tl.int64)
            q = _load_dense(q_ptr, row * row_stride + kh * DK + dk, dk_ok, X_BF16)
            k = _load_dense(k_ptr, row * row_stride + kh * DK + dk, dk_ok, X_BF16)
            v = _load_dense(v_ptr, row * row_stride + head * DV + dv, dv_ok, X_BF16)
            q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
            k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
            a = _load_dense(a_ptr, row * gate_stride + head, one, G_BF16) + dt_bias
            softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(tl.minimum(a, 20.0))))
            b = _load_dense(b_ptr, row * gate_stride + head, one, G_BF16)
            beta = 1.0 / (1.0 + tl.exp(-b))
            state = state * tl.exp(neg_rate * softplus)
            predicted = tl.sum(state * k[:, None], axis=0)
            delta = (v - predicted) * beta
            state = state + k[:, None] * delta[None, :]
            o = tl.sum(state * q[:, None], axis=0)
            _store_dense(out_ptr, row * HV * DV + head * DV + dv, o, dv_ok, X_BF16)
            dst = tl.load(write_slots_ptr + row)
            if dst >= 0:
                tl.store(states_ptr + dst.to(tl.int64) * state_size + head_base + tile, state,
                         mask=tile_ok)


def recurrence_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                    b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
                    states: torch.Tensor, offsets: torch.Tensor, positions: torch.Tensor,
                    in_slots: torch.Tensor, write_slots: torch.Tensor, max_tokens: int,
                    block_v: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """q, k [T, Hk, Dk] and v [T, Hv, Dv] (views of one [T, C] conv output are
    fine: one row stride for all three); a, b [T, Hv] the raw projections;
    a_log, dt_bias [Hv]; states [S, Hv, Dk, Dv] fp32 contiguous, updated at
    the write slots; in_slots -1 skips a padding sequence (rows left as they
    are). Returns o [T, Hv, Dv] in v's dtype (into `out` if given)."""
    _check_fits(max_tokens)
    tokens, heads, dv = v.shape
    dk = k.shape[-1]
    row_stride = q.stride(0)
    # one token: views of a [1, C] row report made-up row strides (a size-1
    # dimension's stride is free), and no second row is ever read
    rows_agree = tokens == 1 or (k.stride(0) == row_stride and v.stride(0) == row_stride)
    if not rows_agree or q.stride(-1) != 1 \
            or k.stride(-1) != 1 or v.stride(-1) != 1 or q.stride(1) != dk \
            or k.stride(1) != dk or v.stride(1) != dv or not q.dtype == k.dtype == v.dtype:
        raise ValueError("recurrence_step: q, k, v need one dtype, one row stride and packed heads")
    if a.stride() != b.stride() or a.stride(-1) != 1 or a.dtype != b.dtype:
        raise ValueError("recurrence_step: a and b need the same layout, unit-stride heads")
    if states.dtype != torch.float32 or not states.is_contiguous():
        raise ValueError("recurrence_step: states must be contiguous fp32")
    if out is None:
        out = torch.empty(tokens, heads, dv, dtype=v.dtype, device=v.device)
    if block_v is None:
        block_v = recurrence_block_v(dv)
    (q_, x_bf16), (k_, _), (v_, _) = map(_as_kernel, (q, k, v))
    (a_, g_bf16), (b_, _) = map(_as_kernel, (a, b))
    (a_log_, a_log_bf16), (dt_bias_, dt_bf16) = map(_as_kernel, (a_log, dt_bias))
    grid = (in_slots.shape[0], heads, triton.cdiv(dv, block_v))
    _recurrence_step_kernel[grid](
        q_, k_, v_, row_stride, a_, b_, a.stride(0), a_log_, dt_bias_, states,
        _as_kernel(out)[0], offsets, positions, in_slots, write_slots, dk ** -0.5,
        HV=heads, GROUPS=heads // k.shape[1], DK=dk, DV=dv, DK_PAD=triton.next_power_of_2(dk),
        BLOCK_V=block_v, MAX_T=_bucket(max_tokens), X_BF16=x_bf16, G_BF16=g_bf16,
        A_LOG_BF16=a_log_bf16, DT_BF16=dt_bf16, STATE_EARLY=recurrence_state_early(),
        **pdl_launch(v.device))
    return out


def recurrence_step_reference(q, k, v, a, b, a_log, dt_bias, states, offsets, positions,
                              in_slots, write_slots, max_tokens: int) -> torch.Tensor:
    """recurrence_step through engine/gdn.py's recurrent_gated_delta_rule
    (output_all_states), one sequence at a time, with the model's g/beta math."""
    _check_fits(max_tokens)
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    beta = torch.sigmoid(b.float())
    out = torch.empty_like(v)
    offsets, positions = offsets.tolist(), positions.tolist()
    in_slots, write_slots = in_slots.tolist(), write_slots.tolist()
    reads = [states[s].clone() for s in in_slots]  # every read before any write
    for i in range(len(in_slots)):
        lo, hi = offsets[i], offsets[i + 1]
        if in_slots[i] < 0:  # a padding copy: computed by none
            continue
        initial = None if positions[lo] == 0 else reads[i][None]
        o, _, every = recurrent_gated_delta_rule(
            q[None, lo:hi], k[None, lo:hi], v[None, lo:hi], g[None, lo:hi], beta[None, lo:hi],
            initial, output_all_states=True)
        out[lo:hi] = o[0]
        for j in range(hi - lo):
            if write_slots[lo + j] >= 0:
                states[write_slots[lo + j]] = every[0, j]
    return out


def _check_fits(max_tokens: int) -> None:
    if not fits(max_tokens):
        raise ValueError(f"the fused GDN step takes 1..{MAX_TOKENS} new tokens per sequence, "
                         f"got {max_tokens}")
