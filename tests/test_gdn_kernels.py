"""The fused GDN step kernels (engine/gdn_kernels.py) against their PyTorch
references, which run engine/gdn.py's causal_conv1d and
recurrent_gated_delta_rule(output_all_states=True). On the CPU the kernels run
under TRITON_INTERPRET=1; scripts/device_gdn.sh runs the same file compiled.

The last test runs the tiny Qwen3.5 through decode and verify steps with the
fused path wired into the model against the model's other path.

Each case packs three sequences with different token counts: a verify-style
one whose first position slot is its own input slot, a fresh one whose input
slot holds NaN (it must start from zeros), and a third; unused slots and the
outputs start NaN, so a missed write or a stray read shows."""
import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

from engine import gdn_batched, gdn_kernels  # noqa: E402
from engine.batch import ForwardBatch, SequenceInput  # noqa: E402
from engine.cache import CacheShape, PagedKVCache  # noqa: E402
from engine.kv import make_format  # noqa: E402
from engine.loader import load_model  # noqa: E402
from tests.sm90 import run_sm90_script  # noqa: E402

INTERPRET = os.environ["TRITON_INTERPRET"] not in ("", "0")
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
SLOTS = 16


def _layout(counts, starts, in_slots, verify):
    """offsets, positions, in_slots, write slots for sequences with `counts`
    new tokens at `starts`; verify writes every token's state to its own slot
    (the first to the input slot), decode only the last, to the input slot."""
    offsets, positions, writes = [0], [], []
    in_slots = in_slots[:len(counts)]
    spare = iter(range(6, SLOTS))
    for n, start, slot in zip(counts, starts, in_slots):
        offsets.append(offsets[-1] + n)
        positions += range(start, start + n)
        if slot < 0:  # a padding copy: nothing written
            writes += [-1] * n
        elif verify:
            writes += [slot] + [next(spare) for _ in range(n - 1)]
        else:
            writes += [-1] * (n - 1) + [slot]
    longs = dict(dtype=torch.long, device=DEVICE)
    return (torch.tensor(offsets, dtype=torch.int32, device=DEVICE),
            torch.tensor(positions, **longs), torch.tensor(in_slots, **longs),
            torch.tensor(writes, **longs))


def _poisoned_slots(shape, dtype, fresh_slot, gen):
    slots = torch.full((SLOTS, *shape), float("nan"), dtype=dtype)
    for s in (0, 2, 3):  # live inputs of the non-fresh sequences (and one spare)
        slots[s] = torch.randn(shape, generator=gen).to(dtype)
    slots[fresh_slot] = float("nan")
    return slots.to(DEVICE)


CASES = [  # (tokens per sequence, verify), the largest count is max_tokens
    ((1, 1, 1, 1), False),
    ((4, 1, 3), False),
    ((4, 4, 4, 4), True),
    ((2, 1, 4), True),
]
STARTS = (5, 0, 9, 9)  # the second sequence is fresh
IN_SLOTS = (0, 1, 2, -1)  # a fourth sequence is a padding copy of the third (CUDA graphs)


def _live_rows(counts):
    """Rows of the sequences that are not padding; padding rows stay NaN."""
    live = sum(counts[:3])
    return slice(0, live), slice(live, sum(counts))


@pytest.mark.parametrize("counts,verify", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_step_matches_reference(counts, verify, dtype):
    gen = torch.Generator().manual_seed(sum(counts) + verify)
    channels, kernel = 72, 4  # two channel blocks of 64, the second partial
    tokens = sum(counts)
    # a strided view, as GDN's merged in_proj output gives it
    rows = torch.randn(tokens, channels + 24, generator=gen).to(dtype).to(DEVICE)
    mixed = rows[:, 8:8 + channels]
    weight = (torch.randn(channels, kernel, generator=gen) * 0.5).to(dtype).to(DEVICE)
    windows = _poisoned_slots((channels, kernel - 1), dtype, IN_SLOTS[1], gen)
    offsets, positions, in_slots, writes = _layout(counts, STARTS, IN_SLOTS, verify)
    live, pad = _live_rows(counts)
    ref_windows = windows.clone().cpu()
    ref = gdn_kernels.conv_step_reference(mixed.cpu(), ref_windows, weight.cpu(), offsets,
                                          positions, in_slots, writes, max(counts))
    out = torch.full_like(mixed, float("nan"))
    got = gdn_kernels.conv_step(mixed, windows, weight, offsets, positions, in_slots, writes,
                                max(counts), block_c=64, out=out)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[live].float().cpu(), ref[live].float().cpu(), **tol)
    assert got[pad].isnan().all()
    # windows are copies of inputs: exact, and untouched slots keep their NaN
    torch.testing.assert_close(windows.cpu(), ref_windows.cpu(), rtol=0, atol=0, equal_nan=True)
    written = set(writes.tolist()) - {-1}
    assert all(windows[s].isnan().all() for s in range(SLOTS) if s not in written | {0, 2, 3})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_chunk_matches_reference(dtype):
    """The prefill conv: a long sequence spanning row blocks, sequences shorter
    than the window (whose new window keeps the old one's tail), fresh ones
    (zeros, whatever their slot holds) and resumed ones."""
    gen = torch.Generator().manual_seed(3)
    channels, kernel = 72, 4
    counts, slots, fresh = (1, 2, 70, 5), [0, 1, 2, 3], [False, True, False, False]
    offsets = [0]
    for n in counts:
        offsets.append(offsets[-1] + n)
    # the qkv columns of GDN's merged in_proj output: rows strided by its whole width
    rows = torch.randn(offsets[-1], channels + 40, generator=gen).to(dtype).to(DEVICE)
    mixed = rows[:, :channels]
    assert not mixed.is_contiguous()
    weight = (torch.randn(channels, kernel, generator=gen) * 0.5).to(dtype).to(DEVICE)
    windows = _poisoned_slots((channels, kernel - 1), dtype, 1, gen)  # slot 1: NaN, fresh
    ref_windows = windows.clone().cpu()
    ref = gdn_kernels.conv_chunk_reference(mixed.cpu(), ref_windows, weight.cpu(), offsets,
                                           slots, fresh)
    # the batch's device indices, as ForwardBatch builds them (starts: 5, 0, 9, 2)
    starts = [5, 0, 9, 2]
    row_seq = torch.repeat_interleave(torch.arange(4, dtype=torch.int32), torch.tensor(counts))
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, counts)])
    got = gdn_kernels.conv_chunk(
        mixed, windows, weight, row_seq.to(DEVICE),
        torch.tensor(offsets, dtype=torch.int32, device=DEVICE), positions.to(DEVICE),
        torch.tensor(slots, device=DEVICE), offsets, slots, fresh, block_t=16, block_c=64)
    assert not got.isnan().any()
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.float().cpu(), ref.float().cpu(), **tol)
    # windows are copies of inputs: exact; slots no sequence names keep their NaN
    torch.testing.assert_close(windows.cpu(), ref_windows.cpu(), rtol=0, atol=0, equal_nan=True)
    assert all(windows[s].isnan().all() for s in range(SLOTS) if s not in slots + [0, 2, 3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_l2_normalize_heads_matches_reference(dtype):
    """q's column block of a conv output (tokens strided by the whole row), a
    row count that leaves the last program part-empty, an all-zero head (eps
    keeps it zero, not NaN), NaN-poisoned output."""
    gen = torch.Generator().manual_seed(5)
    tokens, heads, dim = 37, 3, 32
    rows = torch.randn(tokens, heads * dim + 24, generator=gen).to(dtype).to(DEVICE)
    rows[4, :dim] = 0.0
    q = rows[:, :heads * dim].view(tokens, heads, dim)
    got = gdn_kernels.l2_normalize_heads(q, rows_per_program=16)
    assert got.is_contiguous() and got.dtype == dtype and not got.isnan().any()
    assert not got[4, 0].any()
    ref = gdn_kernels.l2_normalize_heads_reference(q.cpu())
    tol = dict(rtol=1e-2, atol=4e-3) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got.float().cpu(), ref.float(), **tol)
    with pytest.raises(ValueError, match="contiguous heads"):
        gdn_kernels.l2_normalize_heads(rows[:, :90].view(tokens, 3, 30))


@pytest.mark.parametrize("counts,verify", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recurrence_step_matches_reference(counts, verify, dtype):
    gen = torch.Generator().manual_seed(10 + sum(counts) + verify)
    k_heads, v_heads, dk, dv = 2, 4, 16, 24  # GQA groups of 2; dv spans a partial block
    tokens = sum(counts)
    # q, k, v as views of one conv output row, as the model hands them over
    row = torch.randn(tokens, 2 * k_heads * dk + v_heads * dv, generator=gen).to(dtype).to(DEVICE)
    q, k, v = row.split((k_heads * dk, k_heads * dk, v_heads * dv), dim=-1)
    q, k = q.view(tokens, k_heads, dk), k.view(tokens, k_heads, dk)
    v = v.view(tokens, v_heads, dv)
    ab = torch.randn(tokens, 2 * v_heads, generator=gen).to(dtype).to(DEVICE)
    a, b = ab[:, :v_heads], ab[:, v_heads:]
    a_log = torch.randn(v_heads, generator=gen).to(DEVICE)
    dt_bias = torch.randn(v_heads, generator=gen).to(dtype).to(DEVICE)  # A_log stays fp32
    states = _poisoned_slots((v_heads, dk, dv), torch.float32, IN_SLOTS[1], gen)
    offsets, positions, in_slots, writes = _layout(counts, STARTS, IN_SLOTS, verify)
    live, pad = _live_rows(counts)
    ref_states = states.clone().cpu()
    ref = gdn_kernels.recurrence_step_reference(
        q.cpu(), k.cpu(), v.cpu(), a.cpu(), b.cpu(), a_log.cpu(), dt_bias.cpu(), ref_states,
        offsets, positions, in_slots, writes, max(counts))
    out = torch.full_like(v, float("nan"))
    got = gdn_kernels.recurrence_step(q, k, v, a, b, a_log, dt_bias, states, offsets, positions,
                                      in_slots, writes, max(counts), block_v=16, out=out)
    # fp32 state either way; bf16 only rounds the output (the GPU's exp/log differ a little)
    fp32 = dict(rtol=1e-4, atol=1e-4 if DEVICE == "cuda" else 1e-5)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else fp32
    torch.testing.assert_close(got[live].float().cpu(), ref[live].float().cpu(), **tol)
    assert got[pad].isnan().all()
    torch.testing.assert_close(states.cpu(), ref_states, equal_nan=True, **fp32)
    written = set(writes.tolist()) - {-1}
    assert all(states[s].isnan().all() for s in range(SLOTS) if s not in written | {0, 2, 3})
    assert not states[sorted(written)].isnan().any()


def test_tile_width_overrides_change_no_value(monkeypatch):
    """TANDEM_GDN_CONV_BLOCK / TANDEM_GDN_BLOCK_V only regroup programs and
    TANDEM_GDN_STATE_EARLY only moves the state's load: outputs and written
    slots are bitwise those of the defaults, and
    a width they do not offer is an error naming the variable."""
    counts, verify = (4, 1, 3), True
    gen = torch.Generator().manual_seed(3)
    channels, k_heads, v_heads, dk, dv = 2 * 2 * 16 + 4 * 32, 2, 4, 16, 32
    mixed = torch.randn(sum(counts), channels, generator=gen).to(DEVICE)
    weight = (torch.randn(channels, 4, generator=gen) * 0.5).to(DEVICE)
    ab = torch.randn(sum(counts), 2 * v_heads, generator=gen).to(DEVICE)
    a_log, dt_bias = torch.randn(v_heads, generator=gen).to(DEVICE), torch.zeros(v_heads,
                                                                                device=DEVICE)
    windows0 = _poisoned_slots((channels, 3), torch.float32, IN_SLOTS[1], gen)
    states0 = _poisoned_slots((v_heads, dk, dv), torch.float32, IN_SLOTS[1], gen)
    layout = _layout(counts, STARTS, IN_SLOTS, verify)

    def step():
        windows, states = windows0.clone(), states0.clone()
        conv = gdn_kernels.conv_step(mixed, windows, weight, *layout, max(counts),
                                     out=torch.full_like(mixed, float("nan")))
        q, k, v = conv.split((k_heads * dk, k_heads * dk, v_heads * dv), dim=-1)
        v = v.view(-1, v_heads, dv)
        out = gdn_kernels.recurrence_step(
            q.view(-1, k_heads, dk), k.view(-1, k_heads, dk), v, ab[:, :v_heads],
            ab[:, v_heads:], a_log, dt_bias, states, *layout, max(counts),
            out=torch.full_like(v, float("nan")))
        return conv, windows, out, states

    default = step()
    for conv_block, block_v, early in (("32", "8", "0"), ("256", "64", "1")):
        monkeypatch.setenv(gdn_kernels.CONV_BLOCK_ENV, conv_block)
        monkeypatch.setenv(gdn_kernels.BLOCK_V_ENV, block_v)
        monkeypatch.setenv(gdn_kernels.STATE_EARLY_ENV, early)
        for got, want in zip(step(), default):
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    monkeypatch.setenv(gdn_kernels.BLOCK_V_ENV, "48")
    with pytest.raises(ValueError, match="TANDEM_GDN_BLOCK_V='48'"):
        gdn_kernels.recurrence_block_v(128)
    monkeypatch.setenv(gdn_kernels.STATE_EARLY_ENV, "yes")
    with pytest.raises(ValueError, match="TANDEM_GDN_STATE_EARLY='yes'"):
        gdn_kernels.recurrence_state_early()
    monkeypatch.delenv(gdn_kernels.STATE_EARLY_ENV)
    assert gdn_kernels.recurrence_state_early()  # on by default


def test_out_of_range_token_counts_are_refused():
    offsets, positions, in_slots, writes = _layout((1,), (0,), (0,), False)
    x = torch.zeros(1, 8, device=DEVICE)
    with pytest.raises(ValueError, match="1..8 new tokens"):
        gdn_kernels.conv_step(x, torch.zeros(2, 8, 3, device=DEVICE),
                              torch.zeros(8, 4, device=DEVICE), offsets, positions, in_slots,
                              writes, max_tokens=9)
    assert gdn_kernels.fits(8) and not gdn_kernels.fits(0) and not gdn_kernels.fits(9)


def _model_steps(loaded, fused: bool, monkeypatch):
    """Prefill, a decode step with a fresh sequence, a verify batch that mixes
    position-slot rows (k+1 = 4 and 3 tokens) with a plain decode row, then a
    batch-1 decode step."""
    if DEVICE == "cpu":  # the interpreter stands in for the GPU
        monkeypatch.setattr(gdn_batched, "use_fused_path",
                            lambda x, batch: fused and batch.attention.max_new_tokens <= 8)
    else:
        monkeypatch.setenv("TANDEM_FUSED_GDN", "1" if fused else "0")
    cache = PagedKVCache(loaded.config, CacheShape(12, 8, 10), DEVICE,
                         make_format("bf16", dtype=loaded.dtype))
    for t in cache.recurrent:
        t[2].fill_(float("nan"))  # a fresh sequence's slot: must be ignored
    tables = [tuple(range(0, 4)), tuple(range(4, 8)), tuple(range(8, 12))]
    ids = [[(7 * i + 3) % 512 for i in range(20)], [(5 * i + 1) % 512 for i in range(12)]]
    steps = [
        [SequenceInput(tuple(ids[0][:12]), 0, tables[0], 0),
         SequenceInput(tuple(ids[1][:9]), 0, tables[1], 1)],
        [SequenceInput((ids[0][12],), 12, tables[0], 0),
         SequenceInput((ids[1][9],), 9, tables[1], 1),
         SequenceInput((11,), 0, tables[2], 2)],
        [SequenceInput(tuple(ids[0][13:17]), 13, tables[0], 0, (0, 3, 4, 5)),
         SequenceInput((ids[1][10],), 10, tables[1], 1),
         SequenceInput((12, 13, 14), 1, tables[2], 2, (6, 7, 2))],
        # one sequence, one token: its q/k/v views have made-up row strides
        [SequenceInput((ids[0][17],), 17, tables[0], 0)],
    ]
    logits = [loaded.model(ForwardBatch.build(step, 8, DEVICE), cache, all_logits=True)
              for step in steps]
    return torch.cat(logits).float(), [s.clone() for s in cache.recurrent + cache.conv]


def test_fused_path_in_the_model_matches_the_other_path(monkeypatch):
    loaded = load_model("tiny-qwen3.5", device=DEVICE, dtype=torch.float32, seed=6)
    ref_logits, ref_states = _model_steps(loaded, False, monkeypatch)
    logits, states = _model_steps(loaded, True, monkeypatch)
    tol = dict(rtol=1e-2, atol=1e-2) if DEVICE == "cuda" else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits, ref_logits, **tol)
    for s, r in zip(states, ref_states):  # every slot, the position slots included
        torch.testing.assert_close(s[:8], r[:8], **tol)


# Compiles both kernels for sm_90 at the 27B shape (decode and k=3 verify)
# without a GPU: Triton's own ptxas, so a kernel that only the interpreter
# accepts fails here in CI rather than on the device machine.
_COMPILE_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from engine import gdn_kernels as G

INDEX = dict(offsets_ptr="*i32", positions_ptr="*i64", in_slots_ptr="*i64", write_slots_ptr="*i64")
CONV = dict(mixed_ptr="*i16", mixed_stride="i32", windows_ptr="*fp32", w_stride_slot="i32",
            w_stride_c="i32", weight_ptr="*i16", out_ptr="*i16", **INDEX, channels="i32")
REC = dict(q_ptr="*i16", k_ptr="*i16", v_ptr="*i16", row_stride="i32", a_ptr="*i16",
           b_ptr="*i16", gate_stride="i32", a_log_ptr="*i16", dt_bias_ptr="*i16",
           states_ptr="*fp32", out_ptr="*i16", **INDEX, scale="fp32")
def loads_before_wait(ptx):
    return "ld.global" in ptx[:ptx.index("griddepcontrol.wait")]


for t in (1, 4):
    for early in (False, True):
        for kernel, sig, consts in (
                (G._conv_step_kernel, CONV,
                 dict(KERNEL=4, MAX_T=t, HIST=triton.next_power_of_2(3 + t), BLOCK_C=128,
                      X_BF16=True, WIN_BF16=False, W_BF16=True, PDL=True)),
                (G._recurrence_step_kernel, REC,
                 dict(HV=48, GROUPS=3, DK=128, DV=128, DK_PAD=128, BLOCK_V=32, MAX_T=t,
                      X_BF16=True, G_BF16=True, A_LOG_BF16=False, DT_BF16=True,
                      STATE_EARLY=early, PDL=True))):
            signature = dict(sig, **{k: "constexpr" for k in consts})
            compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=consts),
                                      target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
            assert compiled.asm["cubin"], kernel
            # the state tile's loads are issued ahead of the wait only when asked
            if kernel is G._recurrence_step_kernel:
                assert loads_before_wait(compiled.asm["ptx"]) == early, (t, early)
            else:
                assert not loads_before_wait(compiled.asm["ptx"])
CHUNK = dict(mixed_ptr="*i16", mixed_stride="i32", windows_ptr="*fp32", w_stride_slot="i32",
             w_stride_c="i32", weight_ptr="*i16", out_ptr="*i16", row_seq_ptr="*i32",
             offsets_ptr="*i32", slots_ptr="*i64", positions_ptr="*i64", tokens="i32",
             channels="i32")
consts = dict(KERNEL=4, BLOCK_T=8, BLOCK_C=256, X_BF16=True, WIN_BF16=False, W_BF16=True)
compiled = triton.compile(ASTSource(fn=G._conv_chunk_kernel,
                                    signature=dict(CHUNK, **{k: "constexpr" for k in consts}),
                                    constexprs=consts),
                          target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
assert compiled.asm["cubin"]
consts = dict(HEADS=16, D=128, ROWS=16, X_BF16=True)
compiled = triton.compile(ASTSource(fn=G._l2_normalize_kernel,
                                    signature=dict(x_ptr="*i16", out_ptr="*i16", rows="i32",
                                                   token_stride="i32",
                                                   **{k: "constexpr" for k in consts}),
                                    constexprs=consts),
                          target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
assert compiled.asm["cubin"]
print("compiled")
"""


def test_kernels_compile_for_sm90():
    assert "compiled" in run_sm90_script(_COMPILE_SM90, timeout=240)
