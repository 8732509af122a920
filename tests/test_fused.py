"""Fused norm / activation / rotary kernels (engine/fused) against their
PyTorch references, and a tiny model's forward through them against the plain
path.

Runs on the CPU with the Triton interpreter; on a CUDA machine with
TRITON_INTERPRET=0 the same tests run the compiled kernels on the GPU. Outputs
are NaN-poisoned first, so an element a kernel skips fails."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from engine import fused  # noqa: E402
from engine.fused import kernels, reference  # noqa: E402

INTERPRET = os.environ["TRITON_INTERPRET"] not in ("", "0")
DEVICE = "cpu" if INTERPRET else "cuda"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("compiled Triton kernels need CUDA", allow_module_level=True)

DTYPES = [torch.float32, torch.bfloat16]
# bf16: the kernels round at the same steps as the reference, so compiled they
# differ by an ulp (2^-8 relative) where fp32 sums in another order tip a
# rounding; rotary's difference of two rounded products can carry that ulp of
# its larger term, hence an absolute slack of a few ulps of the largest value.
# The interpreter converts fp32 to bf16 by truncation, not to nearest, so each
# rounding step there may be an ulp off: twice the slack.
BF16_ULPS = 4 if INTERPRET else 2
# the residual sum is one rounding of the same fp32 sum: exact when compiled
SAME_ROUNDING = dict(rtol=2 ** -7, atol=0) if INTERPRET else dict(rtol=0, atol=0)


@pytest.fixture(autouse=True)
def nan_poisoned_outputs(monkeypatch):
    def poisoned(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    monkeypatch.setattr(kernels, "_empty", poisoned)


def _randn(*shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device=DEVICE, dtype=dtype)


def _check(got, expected):
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert not got.isnan().any()
    if got.dtype == torch.bfloat16:
        slack = BF16_ULPS * 2 ** -8
        torch.testing.assert_close(got, expected, rtol=slack,
                                   atol=slack * expected.abs().max().item())
    else:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("hidden", [576, 5120])
def test_rms_norm(dtype, zero_centered, hidden):
    x = _randn(3, hidden, dtype=dtype, seed=hidden, scale=3.0)
    w = _randn(hidden, dtype=dtype, seed=1, scale=0.3) + (0 if zero_centered else 1)
    _check(kernels.rms_norm(x, w, 1e-6, zero_centered), reference.rms_norm(x, w, 1e-6, zero_centered))


def test_rms_norm_of_strided_heads():
    """q/k norm shape: [T, heads, head_dim] taken out of a wider projection."""
    full = _randn(2, 4, 96, dtype=torch.bfloat16, seed=5)
    x = full[..., :48]
    w = _randn(48, dtype=torch.bfloat16, seed=6)
    _check(kernels.rms_norm(x, w, 1e-5, False), reference.rms_norm(x, w, 1e-5, False))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("hidden", [576, 5120])
def test_add_rms_norm(dtype, zero_centered, hidden):
    x = _randn(2, hidden, dtype=dtype, seed=hidden + 1, scale=4.0)
    h = _randn(2, hidden, dtype=dtype, seed=hidden + 2)
    w = _randn(hidden, dtype=dtype, seed=3, scale=0.3) + (0 if zero_centered else 1)
    total, normed = kernels.add_rms_norm(x, h, w, 1e-6, zero_centered)
    ref_total, ref_normed = reference.add_rms_norm(x, h, w, 1e-6, zero_centered)
    torch.testing.assert_close(total, ref_total, **SAME_ROUNDING)
    _check(normed, ref_normed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [128, 100])
def test_gated_rms_norm(dtype, head_dim):
    x = _randn(3, 5, head_dim, dtype=dtype, seed=head_dim)
    z = _randn(3, 5, head_dim, dtype=dtype, seed=head_dim + 1, scale=2.0)
    w = _randn(head_dim, dtype=dtype, seed=7, scale=0.3) + 1
    _check(kernels.gated_rms_norm(x, z, w, 1e-6), reference.gated_rms_norm(x, z, w, 1e-6))


def test_gated_rms_norm_of_a_strided_gate():
    """GDN's z: [T, heads, head_dim] heads out of the wider merged in_proj row."""
    x = _randn(3, 4, 32, dtype=torch.bfloat16, seed=31)
    row = _randn(3, 4 * 32 + 40, dtype=torch.bfloat16, seed=32, scale=2.0)
    z = row[:, 24:24 + 4 * 32].view(3, 4, 32)
    w = _randn(32, dtype=torch.bfloat16, seed=33, scale=0.3) + 1
    assert not z.is_contiguous()
    _check(kernels.gated_rms_norm(x, z, w, 1e-6), reference.gated_rms_norm(x, z, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    g = _randn(3, 1377, dtype=dtype, seed=8, scale=3.0)  # numel not a multiple of the block
    u = _randn(3, 1377, dtype=dtype, seed=9)
    _check(kernels.silu_mul(g, u), reference.silu_mul(g, u))


def test_silu_mul_of_the_gate_up_halves():
    """The MLP's merged gate_up_proj output, split into row-strided views."""
    gate_up = _randn(3, 2 * 1100, dtype=torch.bfloat16, seed=34, scale=3.0)
    g, u = gate_up.split(1100, dim=-1)
    assert not g.is_contiguous()
    _check(kernels.silu_mul(g, u), reference.silu_mul(g, u))


def _cos_sin(tokens, rotary_dim, dtype):
    pos = torch.tensor([0, 7, 1000, 31][:tokens], dtype=torch.float32)
    inv = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    emb = torch.cat([pos[:, None] * inv] * 2, dim=-1)
    return emb.cos().to(DEVICE, dtype), emb.sin().to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,rotary_dim,with_norm,zero_centered", [
    (256, 64, True, True),    # Qwen3.5: partial rotary, zero-centred q/k norm
    (128, 128, True, False),  # Qwen3: full rotary, Llama-style q/k norm
    (64, 64, False, False),   # Llama: rotary only
    (80, 32, True, False),    # a rest that is not a power of two
])
def test_norm_rope(dtype, head_dim, rotary_dim, with_norm, zero_centered):
    tokens, heads = 4, 3
    # the query half of a [query | gate] projection: a strided view
    projected = _randn(tokens, heads, 2 * head_dim, dtype=dtype, seed=head_dim, scale=2.0)
    x = projected[..., :head_dim]
    w = _randn(head_dim, dtype=dtype, seed=11, scale=0.3) + (0 if zero_centered else 1) \
        if with_norm else None
    cos, sin = _cos_sin(tokens, rotary_dim, dtype)
    rotated, normed = kernels.norm_rope(x, w, cos, sin, rotary_dim, 1e-6, zero_centered,
                                        keep_normed=True)
    ref_rotated, ref_normed = reference.norm_rope(x, w, cos, sin, rotary_dim, 1e-6, zero_centered)
    _check(rotated, ref_rotated)
    _check(normed, ref_normed.contiguous())
    alone, none = kernels.norm_rope(x, w, cos, sin, rotary_dim, 1e-6, zero_centered)
    assert none is None
    torch.testing.assert_close(alone, rotated, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,rotary_dim,with_norm,zero_centered", [
    (256, 64, True, True), (64, 64, False, False), (80, 32, True, False)])
@pytest.mark.parametrize("keep_k_normed", [False, True])
def test_norm_rope_pair_is_the_two_launches(dtype, head_dim, rotary_dim, with_norm,
                                            zero_centered, keep_k_normed):
    """q (a strided query half of [query | gate]) and k (a strided slice of
    the qkv row) with their own weights in one launch: bitwise each one's
    norm_rope, every element written (the outputs are NaN-poisoned)."""
    tokens, q_heads, k_heads = 3, 6, 2
    projected = _randn(tokens, q_heads, 2 * head_dim, dtype=dtype, seed=head_dim, scale=2.0)
    kv = _randn(tokens, 2 * k_heads * head_dim, dtype=dtype, seed=5, scale=2.0)
    q = projected[..., :head_dim]
    k = kv[:, :k_heads * head_dim].view(tokens, k_heads, head_dim)
    offset = 0 if zero_centered else 1
    qw = _randn(head_dim, dtype=dtype, seed=11, scale=0.3) + offset if with_norm else None
    kw = _randn(head_dim, dtype=dtype, seed=12, scale=0.3) + offset if with_norm else None
    cos, sin = _cos_sin(tokens, rotary_dim, dtype)
    q_out, k_out, k_normed = kernels.norm_rope_pair(q, k, qw, kw, cos, sin, rotary_dim, 1e-6,
                                                    zero_centered, keep_k_normed=keep_k_normed)
    q_apart, _ = kernels.norm_rope(q, qw, cos, sin, rotary_dim, 1e-6, zero_centered)
    k_apart, k_normed_apart = kernels.norm_rope(k, kw, cos, sin, rotary_dim, 1e-6,
                                                zero_centered, keep_normed=keep_k_normed)
    assert torch.equal(q_out, q_apart) and torch.equal(k_out, k_apart)
    assert (k_normed is None) == (not keep_k_normed)
    if keep_k_normed:
        assert torch.equal(k_normed, k_normed_apart)
    _check(q_out, reference.norm_rope(q, qw, cos, sin, rotary_dim, 1e-6, zero_centered)[0])


def test_norm_rope_pair_takes_two_launches_where_one_cannot_serve():
    """q and k of different head dims: each its own norm_rope (the reference's numbers)."""
    q = _randn(2, 3, 64, dtype=torch.float32, seed=1)
    k = _randn(2, 1, 32, dtype=torch.float32, seed=2)
    cos, sin = _cos_sin(2, 32, torch.float32)
    q_out, k_out, none = kernels.norm_rope_pair(q, k, None, None, cos, sin, 32, 1e-6, False)
    assert none is None
    _check(q_out, reference.norm_rope(q, None, cos, sin, 32, 1e-6, False)[0])
    _check(k_out, reference.norm_rope(k, None, cos, sin, 32, 1e-6, False)[0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_sigmoid_gate(dtype):
    tokens, heads, head_dim = 3, 4, 48
    projected = _randn(tokens, heads, 2 * head_dim, dtype=dtype, seed=12)
    gate = projected[..., head_dim:]
    out = _randn(tokens, heads * head_dim, dtype=dtype, seed=13)
    _check(kernels.sigmoid_gate(out, gate), reference.sigmoid_gate(out, gate.reshape(tokens, -1)))


def test_dispatch(monkeypatch):
    cpu = torch.zeros(1)
    with torch.inference_mode():
        assert not fused.use_fused(cpu)  # production: CPU tensors take the references
        monkeypatch.setattr(fused, "_FORCE_ON_CPU", True)
        assert fused.use_fused(cpu)
    assert not fused.use_fused(cpu)  # autograd on (MTP training): the kernels have no backward
    with torch.inference_mode():
        monkeypatch.setenv(fused.ENV_SWITCH, "0")
        assert not fused.use_fused(cpu)


# ------------------------------------------------------------- whole model

PAGE = 4


def _forward_logits(loaded, force_fused: bool, monkeypatch, dtype, device="cpu"):
    """A prefill of 9 tokens then 3 decode steps; every step's logits. On the
    CPU force_fused runs the kernels interpreted; on CUDA it is the env switch."""
    from engine.batch import ForwardBatch, SequenceInput
    from engine.cache import CacheShape, PagedKVCache
    from engine.kv import make_format

    monkeypatch.setattr(fused, "_FORCE_ON_CPU", force_fused)
    monkeypatch.setenv(fused.ENV_SWITCH, "1" if force_fused else "0")
    ids = [random.Random(3).randrange(512) for _ in range(12)]
    cache = PagedKVCache(loaded.config, CacheShape(8, PAGE, 1), device,
                         make_format("bf16", dtype=dtype))
    pages = (5, 2, 7)
    outs = [loaded.model(ForwardBatch.build([SequenceInput(tuple(ids[:9]), 0, pages, 0)], PAGE,
                                            device), cache, all_logits=True)]
    for i in range(9, 12):
        outs.append(loaded.model(ForwardBatch.build([SequenceInput((ids[i],), i, pages, 0)], PAGE,
                                                    device), cache))
    return torch.cat(outs).float().cpu()


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3", "llama"])
def test_model_forward_fused_matches_plain(family, tiny_hf_dir, monkeypatch):
    """Every fused op in place (zero-centred norms, GDN's gated norm, q/k norm
    with partial rotary, the output gate, residual adds fused into the norms)
    gives the plain path's logits."""
    if not INTERPRET:
        pytest.skip("the model test forces the fused path on CPU tensors")
    from engine.loader import load_model

    directory, _ = tiny_hf_dir(family)
    loaded = load_model(str(directory), progress=False)
    plain = _forward_logits(loaded, False, monkeypatch, torch.float32)
    calls = _count_kernel_calls(monkeypatch)
    got = _forward_logits(loaded, True, monkeypatch, torch.float32)
    torch.testing.assert_close(got, plain, rtol=1e-4, atol=1e-4)
    expected = {"add_rms_norm", "silu_mul", "norm_rope_pair"} | (
        {"gated_rms_norm", "sigmoid_gate"} if family == "qwen3_5" else set())
    assert expected <= {name for name, n in calls.items() if n}, calls


def _count_kernel_calls(monkeypatch) -> dict[str, int]:
    """Counts each wrapper's calls from now on (the fused path must really run)."""
    calls = {}
    for name in ("rms_norm", "add_rms_norm", "gated_rms_norm", "silu_mul", "norm_rope",
                 "norm_rope_pair", "sigmoid_gate"):
        calls[name] = 0

        def counted(*args, _name=name, _fn=getattr(kernels, name), **kw):
            calls[_name] += 1
            return _fn(*args, **kw)
        monkeypatch.setattr(kernels, name, counted)
    return calls


def test_model_forward_fused_bf16(tiny_hf_dir, monkeypatch):
    """bf16: interpreted on the CPU; compiled on CUDA (TANDEM_FUSED_NORMS=1 against =0)."""
    from engine.loader import load_model

    directory, _ = tiny_hf_dir("qwen3_5")
    loaded = load_model(str(directory), device=DEVICE, dtype=torch.bfloat16, progress=False)
    plain = _forward_logits(loaded, False, monkeypatch, torch.bfloat16, DEVICE)
    calls = _count_kernel_calls(monkeypatch)
    got = _forward_logits(loaded, True, monkeypatch, torch.bfloat16, DEVICE)
    assert calls["add_rms_norm"] and calls["norm_rope_pair"] and calls["gated_rms_norm"]
    assert (got - plain).abs().max() < 0.02 * plain.abs().max()
    assert (got.argmax(-1) == plain.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("op", ["rms_norm", "silu_mul", "gated_rms_norm", "sigmoid_gate",
                                "norm_rope", "all_small"])
def test_ablation_stand_ins_fit_the_forward_and_are_restored(op, tiny_hf_dir, monkeypatch):
    """bench.ablate_step's stand-ins take the wrappers' arguments and return
    their shapes (the forward runs through them; values are garbage by
    design), and leave the real wrappers in place afterwards."""
    if not INTERPRET:
        pytest.skip("forces the fused path on CPU tensors")
    from bench.ablate_step import ablated
    from engine.loader import load_model

    directory, _ = tiny_hf_dir("qwen3_5")
    loaded = load_model(str(directory), progress=False)
    before = {name: getattr(kernels, name) for name in dir(kernels)}
    with ablated(op):
        assert any(getattr(kernels, name) is not fn for name, fn in before.items())
        logits = _forward_logits(loaded, True, monkeypatch, torch.float32)
    assert logits.shape == (12, loaded.config.vocab_size)
    assert all(getattr(kernels, name) is fn for name, fn in before.items())
