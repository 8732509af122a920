"""The rk4/rk4p rotation without its matrix: rotation.hadamard_rotate (the
PyTorch FWHT reference) against the fp32 matmul by R, the Triton kernel
(engine/kv/hadamard_kernels.py) against the reference bit for bit, and the
formats' wiring behind TANDEM_HADAMARD_KERNEL.

Runs on the CPU with the Triton interpreter; on a CUDA machine with
TRITON_INTERPRET=0 the same tests run the compiled kernel on the GPU (the
bitwise checks hold there too: add/sub butterflies and exact scalings)."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import importlib.util  # noqa: E402
import json  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from engine.kv import formats as F  # noqa: E402
from engine.kv import rotation  # noqa: E402
from engine.kv.attention import paged_attention_reference, paged_attention_triton  # noqa: E402
from engine.kv.formats import make_format  # noqa: E402

INTERPRET = os.environ["TRITON_INTERPRET"] not in ("", "0")
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton not installed")
POWER_OF_TWO_DIMS = [16, 32, 64, 128, 256, 512]


def rows_with_outliers(n, head_dim, seed, dtype=torch.float32):
    """Gaussian rows [n, D] with a few x10 channels (real K's outliers)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, head_dim, generator=g)
    x[:, torch.randperm(head_dim, generator=g)[:3]] *= 10.0
    return x.to(DEVICE, dtype)


def signs_of(head_dim, seed=rotation.DEFAULT_ROTATION_SEED):
    return rotation.hadamard_signs(head_dim, seed).to(DEVICE, torch.float32)


def matmul_rotation(x, head_dim, inverse):
    r = rotation.rotation_matrix(head_dim, device=x.device)
    return rotation.unrotate(x, r) if inverse else rotation.rotate(x, r)


# ------------------------------------------------------------ the reference


@pytest.mark.parametrize("head_dim", POWER_OF_TWO_DIMS)
@pytest.mark.parametrize("seed", [rotation.DEFAULT_ROTATION_SEED, 1])
def test_signs_rebuild_the_randomised_hadamard_bitwise(head_dim, seed):
    """The kernel's whole view of R is its sign vector: H * s / sqrt(D) from
    hadamard_signs must be the cached R itself, not a near copy."""
    s = rotation.hadamard_signs(head_dim, seed)
    assert set(s.tolist()) <= {-1.0, 1.0}
    rebuilt = (rotation.hadamard_matrix(head_dim) * s[None, :]) / head_dim ** 0.5
    assert torch.equal(rebuilt, rotation._randomised_hadamard(head_dim, seed))
    assert torch.equal(rebuilt, rotation._rotation_fp64(head_dim, seed))


def test_fwht_is_the_sylvester_matrix():
    x = torch.randn(5, 64, dtype=torch.float64)
    torch.testing.assert_close(rotation.fwht(x), x @ rotation.hadamard_matrix(64),
                               rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="power-of-two"):
        rotation.fwht(torch.zeros(2, 48))


@pytest.mark.parametrize("head_dim", POWER_OF_TWO_DIMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("inverse", [False, True], ids=["forward", "inverse"])
def test_reference_matches_the_matmul_to_fp32_rounding(head_dim, dtype, inverse):
    x = rows_with_outliers(33, head_dim, seed=head_dim, dtype=dtype)
    got = rotation.hadamard_rotate(x, signs_of(head_dim), inverse)
    assert got.dtype == torch.float32 and got.shape == x.shape
    matmul = matmul_rotation(x, head_dim, inverse)
    r64 = rotation.rotation_matrix(head_dim, device=x.device, dtype=torch.float64)
    exact = x.double() @ (r64.T if inverse else r64)
    bound = 1e-5 * x.float().abs().max().item()
    # Measured: ~4e-7 * max|x| from either; the butterflies round no worse.
    assert (got - matmul).abs().max().item() <= bound
    assert (got.double() - exact).abs().max().item() <= bound


@pytest.mark.parametrize("head_dim", [16, 256])
def test_inverse_undoes_forward(head_dim):
    x = rows_with_outliers(9, head_dim, seed=2)
    s = signs_of(head_dim)
    back = rotation.hadamard_rotate(rotation.hadamard_rotate(x, s, False), s, True)
    torch.testing.assert_close(back, x, rtol=1e-5, atol=1e-5 * x.abs().max().item())


# --------------------------------------------------------------- the kernel


def kernel():
    from engine.kv import hadamard_kernels
    return hadamard_kernels


@needs_triton
@pytest.mark.parametrize("head_dim", [16, 64, 256])
@pytest.mark.parametrize("n_rows", [1, 37])  # 37: no multiple of any tile's rows
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16], ids=["in32", "in16"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["out32", "out16"])
@pytest.mark.parametrize("inverse", [False, True], ids=["forward", "inverse"])
def test_kernel_is_the_reference_bitwise(head_dim, n_rows, in_dtype, out_dtype, inverse):
    x = rows_with_outliers(n_rows, head_dim, seed=n_rows + head_dim, dtype=in_dtype)
    s = signs_of(head_dim)
    got = kernel().hadamard_rotate_rows(x, s, inverse, out_dtype)
    expected = rotation.hadamard_rotate(x, s, inverse).to(out_dtype)
    assert got.dtype == out_dtype and got.shape == x.shape
    assert not got.isnan().any()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@needs_triton
def test_kernel_takes_strided_rows_and_leading_dims():
    """A query sliced out of a wider projection ([T, H, D] with a row stride
    past D) is read in place; the result has x's shape, contiguous."""
    wide = rows_with_outliers(5 * 3, 2 * 64, seed=4).reshape(5, 3, 128)
    q = wide[..., 64:]
    s = signs_of(64)
    got = kernel().hadamard_rotate_rows(q, s, False, torch.float32)
    assert got.shape == q.shape and got.is_contiguous()
    torch.testing.assert_close(got, rotation.hadamard_rotate(q, s, False), rtol=0, atol=0)


@needs_triton
def test_rows_per_program_changes_no_bit():
    """bench.hadamard's sweep: any tiling of the rows gives the same numbers."""
    x = rows_with_outliers(11, 64, seed=12, dtype=torch.bfloat16)
    s = signs_of(64)
    expected = rotation.hadamard_rotate(x, s, True)
    for per_program in (1, 4, 128):
        got = kernel().hadamard_rotate_rows(x, s, True, torch.float32, per_program)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match="rows_per_program"):
        kernel().hadamard_rotate_rows(x, s, True, torch.float32, 3)


@needs_triton
def test_kernel_refuses_what_it_cannot_rotate():
    x = torch.zeros(2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="power-of-two"):
        kernel().hadamard_rotate_rows(torch.zeros(2, 96, device=DEVICE), signs_of(64), False)
    with pytest.raises(ValueError, match="power-of-two"):
        kernel().hadamard_rotate_rows(torch.zeros(2, 8, device=DEVICE), signs_of(8), False)
    with pytest.raises(ValueError, match="fp32 or bf16"):
        kernel().hadamard_rotate_rows(x, signs_of(64), False, torch.float16)
    with pytest.raises(ValueError, match="signs"):
        kernel().hadamard_rotate_rows(x, signs_of(32), False)
    assert kernel().hadamard_rotate_rows(x[:0], signs_of(64), True).shape == (0, 64)


# ------------------------------------------------------ the formats' wiring


def test_switch_is_on_by_default_and_rejects_other_values(monkeypatch):
    monkeypatch.delenv(F.HADAMARD_KERNEL_ENV, raising=False)
    assert F.hadamard_kernel_wanted()
    monkeypatch.setenv(F.HADAMARD_KERNEL_ENV, "0")
    assert not F.hadamard_kernel_wanted()
    monkeypatch.setenv(F.HADAMARD_KERNEL_ENV, "yes")
    with pytest.raises(ValueError, match="TANDEM_HADAMARD_KERNEL='yes'"):
        F.hadamard_kernel_wanted()


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the formats' calls into the kernel (and still runs it)."""
    module = kernel()
    real, calls = module.hadamard_rotate_rows, []

    def counted(*args, **kwargs):
        calls.append(args[2])  # inverse
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "hadamard_rotate_rows", counted)
    return calls


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_rk4_methods_take_the_kernel_when_switched_on(dtype, monkeypatch, kernel_calls):
    """On the format's Triton path (forced here, so the interpreter covers the
    wiring on the CPU) the four rotations are the kernel's, bit for bit."""
    monkeypatch.setenv(F.HADAMARD_KERNEL_ENV, "1")
    fmt = make_format("rk4", use_triton=True)
    x = rows_with_outliers(4 * 3, 64, seed=5, dtype=dtype).reshape(4, 3, 64)
    s = signs_of(64)
    forward, inverse = (rotation.hadamard_rotate(x, s, inv) for inv in (False, True))
    assert torch.equal(fmt.to_stored_space(x), forward)
    assert torch.equal(fmt.rotate_query(x), forward.to(dtype))
    assert torch.equal(fmt.unrotate_output(x), inverse.to(dtype))
    # attention's fp32 output, back and cast to the query's dtype in one store
    assert torch.equal(fmt.unrotate_output(x, dtype=torch.bfloat16), inverse.to(torch.bfloat16))
    assert kernel_calls == [False, False, True, True]

    rk4p = make_format("rk4p", use_triton=True)
    assert torch.equal(rk4p.rotate_v(x), forward)
    assert torch.equal(rk4p.unrotate_output(x), inverse.to(dtype))
    assert torch.equal(rk4p.rotate_query(x), x)  # K is not rotated
    assert kernel_calls[4:] == [False, True]


@needs_triton
def test_matmul_stays_where_the_kernel_does_not_apply(monkeypatch, kernel_calls):
    """Switched off, on the reference path (use_triton False, or None with CPU
    tensors), or for a head_dim R is no Hadamard of: today's matmul, exactly."""
    x = rows_with_outliers(6, 64, seed=6).reshape(2, 3, 64)
    matmul = matmul_rotation(x, 64, inverse=False)
    monkeypatch.setenv(F.HADAMARD_KERNEL_ENV, "0")
    assert torch.equal(make_format("rk4", use_triton=True).to_stored_space(x), matmul)
    monkeypatch.setenv(F.HADAMARD_KERNEL_ENV, "1")
    assert torch.equal(make_format("rk4", use_triton=False).to_stored_space(x), matmul)
    assert torch.equal(make_format("rk4p", use_triton=True).rotate_v(x, use_triton=False),
                       matmul)
    if DEVICE == "cpu":
        assert torch.equal(make_format("rk4").rotate_query(x), matmul)
    qr = rows_with_outliers(2, 96, seed=7)
    assert torch.equal(make_format("rk4", use_triton=True).to_stored_space(qr),
                       matmul_rotation(qr, 96, inverse=False))
    assert kernel_calls == []
    # An unrotated rk4 (the ablation) rotates nothing either way.
    assert torch.equal(make_format("rk4", rotate=False, use_triton=True).rotate_query(x), x)
    assert kernel_calls == []


@needs_triton
@pytest.mark.parametrize("name", ["rk4", "rk4p"])
def test_writes_rotate_through_the_kernel(name, monkeypatch, kernel_calls):
    """A Triton-path write rotates with the kernel (rk4: K and V; rk4p: V) and
    what it stores reads back as the matmul path's write does, to 4-bit
    error (a code may round the other way where the rotations differ). The
    row kernel's own launches: with the rotation folded into rk4's write
    (test_rotating_write_stores_the_two_step_writes_bits) there are none."""
    monkeypatch.setenv(F.HADAMARD_KERNEL_ENV, "1")
    monkeypatch.setenv(F.FUSED_ROTATION_ENV, "0")
    fmt = make_format(name, use_triton=True)
    page, heads, dim = 32, 2, 64
    k = rows_with_outliers(page * heads, dim, seed=8).reshape(page, heads, dim)
    v = rows_with_outliers(page * heads, dim, seed=9).reshape(page, heads, dim)
    slots = torch.arange(page, device=DEVICE)
    written = {}
    for switch in ("1", "0"):
        monkeypatch.setenv(F.HADAMARD_KERNEL_ENV, switch)
        buffers = fmt.allocate(1, page, heads, dim, DEVICE)
        if fmt.uses_staging:
            buffers.update(fmt.allocate_staging(1, page, heads, dim, DEVICE))
        fmt.write(buffers, slots, k, v)
        written[switch] = fmt.read(buffers, torch.zeros(1, dtype=torch.long, device=DEVICE),
                                   page, torch.float32, use_triton=False)
    assert kernel_calls == ([False, False] if name == "rk4" else [False])
    for with_kernel, with_matmul, exact in zip(written["1"], written["0"], (k, v)):
        assert not with_kernel.isnan().any()
        err = (with_kernel - with_matmul).norm() / exact.norm()
        assert err < 1e-2, err


@needs_triton
@pytest.mark.parametrize("options", [{}, {"scale_format": "e8m0", "block": 16}],
                         ids=["fp16-32", "e8m0-16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("tokens", [1, 5])
def test_rotating_write_stores_the_two_step_writes_bits(options, dtype, tokens, monkeypatch,
                                                        kernel_calls):
    """rk4's write with K and V rotated inside the write kernel stores every
    code and scale bit of the row kernel then the write kernel, and touches
    no other slot (buffers start poisoned). V comes as a strided view of a
    fused projection, as the model hands it over."""
    monkeypatch.setenv(F.HADAMARD_KERNEL_ENV, "1")
    fmt = make_format("rk4", use_triton=True, **options)
    heads, dim, page = 4, 256, 8
    k = rows_with_outliers(tokens * heads, dim, seed=11, dtype=dtype).reshape(tokens, heads, dim)
    fused_projection = rows_with_outliers(tokens, 3 * heads * dim, seed=12, dtype=dtype)
    v = fused_projection[:, heads * dim:2 * heads * dim].view(tokens, heads, dim)
    slots = torch.tensor([3, 17, 9, 22, 0][:tokens], device=DEVICE)
    stored = {}
    for switch in ("1", "0"):
        monkeypatch.setenv(F.FUSED_ROTATION_ENV, switch)
        buffers = fmt.allocate(3, page, heads, dim, DEVICE)
        for t in buffers.values():
            t.view(torch.uint8).fill_(0xA5)
        fmt.write(buffers, slots, k, v)
        stored[switch] = buffers
    assert kernel_calls == [False, False]  # the two-step write's; the fused one has none
    for name, fused in stored["1"].items():
        assert torch.equal(fused.view(torch.uint8), stored["0"][name].view(torch.uint8)), name
    written = stored["1"]["k_codes"].view(-1, heads, dim // 2)[slots]
    assert (written != 0xA5).any()


@needs_triton
@pytest.mark.parametrize("name", ["rk4", "rk4p"])
def test_attention_with_the_kernel_matches_reference(name, monkeypatch, kernel_calls):
    """paged_attention_triton maps the query in and the output back through
    the kernel (rk4: both; rk4p: the output) and still matches SDPA over
    the reference reads."""
    monkeypatch.setenv(F.HADAMARD_KERNEL_ENV, "1")
    if name == "rk4":
        from tests.test_attention import build_case
        fmt = make_format("rk4")
        buffers, q, meta = build_case(fmt, [(40, 1), (9, 1)], q_heads=4, kv_heads=2,
                                      head_dim=64, page_size=16, q_dtype=torch.float32,
                                      seed=10)
        rotary = None
    else:
        from tests.test_attention_rk4p import build_case, rotary_of
        fmt, buffers, q, meta = build_case([(70, 1), (33, 1)], q_heads=4, kv_heads=2,
                                           head_dim=64, staged_pages=1, seed=10, sink=True)
        rotary = rotary_of(64, 64)
    fmt.use_triton = True  # the interpreter's CPU tensors take the Triton path too
    scale = 64 ** -0.5
    expected = paged_attention_reference(fmt, buffers, q, meta, scale, rotary=rotary)
    monkeypatch.setenv(F.FUSED_ROTATION_ENV, "0")
    actual = paged_attention_triton(fmt, buffers, q, meta, scale, num_splits=2, rotary=rotary)
    assert kernel_calls == ([False, True] if name == "rk4" else [True])
    assert not actual.isnan().any()
    tol = dict(rtol=1e-4, atol=1e-4) if DEVICE == "cpu" else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(actual, expected, **tol)
    # rk4's q rotated as the kernel loads it, the output rotated back by the
    # split combine: the same bits as the row kernel's launches, without them
    for sites in ("query", "combine", "all"):
        for q_dtype in (torch.float32, torch.bfloat16):
            for splits in (2, 1):  # one split: no combine, the row kernel rotates back
                qd = q.to(q_dtype)
                del kernel_calls[:]
                monkeypatch.setenv(F.FUSED_ROTATION_ENV, sites)
                fused = paged_attention_triton(fmt, buffers, qd, meta, scale,
                                               num_splits=splits, rotary=rotary)
                query_apart = name == "rk4" and sites == "combine"
                back_apart = splits == 1 or sites == "query"
                assert kernel_calls == [False] * query_apart + [True] * back_apart
                monkeypatch.setenv(F.FUSED_ROTATION_ENV, "none")
                apart = paged_attention_triton(fmt, buffers, qd, meta, scale,
                                               num_splits=splits, rotary=rotary)
                assert fused.dtype == q_dtype and torch.equal(fused, apart)


@needs_triton
def test_a_prefill_chunk_keeps_the_row_kernel_for_q(monkeypatch, kernel_calls):
    """Past ROTATE_Q_MAX_NEW_TOKENS new tokens q is rotated once by the row
    kernel (each key split would rotate it again); the output still goes
    back through the combine. The bits are the same either way."""
    from engine.kv.attention import ROTATE_Q_MAX_NEW_TOKENS
    from tests.test_attention import build_case

    monkeypatch.setenv(F.HADAMARD_KERNEL_ENV, "1")
    fmt = make_format("rk4", use_triton=True)
    new = ROTATE_Q_MAX_NEW_TOKENS + 1
    buffers, q, meta = build_case(fmt, [(40, new)], q_heads=4, kv_heads=2, head_dim=64,
                                  page_size=16, q_dtype=torch.bfloat16, seed=11)
    outs = []
    for sites in ("all", "none"):
        monkeypatch.setenv(F.FUSED_ROTATION_ENV, sites)
        outs.append(paged_attention_triton(fmt, buffers, q, meta, 64 ** -0.5, num_splits=2))
    assert kernel_calls == [False] + [False, True]
    assert torch.equal(outs[0], outs[1])


def test_fused_rotation_sites_switch(monkeypatch):
    """TANDEM_RK4_FUSED_ROTATION: all / none (1 / 0) or a list of sites;
    anything else is an error that lists them."""
    monkeypatch.delenv(F.FUSED_ROTATION_ENV, raising=False)
    assert F.fused_rotation_sites() == F.DEFAULT_FUSED_ROTATION
    for value, sites in (("1", set(F.FUSED_ROTATION_SITES)), ("all", set(F.FUSED_ROTATION_SITES)),
                         ("0", set()), ("none", set()), ("write, combine", {"write", "combine"})):
        monkeypatch.setenv(F.FUSED_ROTATION_ENV, value)
        assert F.fused_rotation_sites() == sites
    monkeypatch.setenv(F.FUSED_ROTATION_ENV, "write,q")
    with pytest.raises(ValueError, match="all, none or a comma-separated list of write, query"):
        F.fused_rotation_sites()


_COMPILE_SM90 = r"""
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from bench.gemv_sass import _cuobjdump
from engine.kv.hadamard_kernels import _hadamard_rows_kernel as kernel, _rows_per_program
from engine.kv.rotation import hadamard_scale

for d, inverse, bf16 in ((256, False, True), (256, True, False), (512, True, True)):
    consts = dict(D=d, LOG2_D=d.bit_length() - 1, ROWS=_rows_per_program(d),
                  SCALE=hadamard_scale(d), INVERSE=inverse, X_BF16_BITS=bf16,
                  OUT_BF16_BITS=bf16, PDL=True)
    dense = "*i16" if bf16 else "*fp32"
    signature = dict(x_ptr=dense, signs_ptr="*fp32", out_ptr=dense, n_rows="i32",
                     x_row_stride="i64", **{k: "constexpr" for k in consts})
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=consts),
                              target=GPUTarget("cuda", 90, 32))
    ptx = compiled.asm["ptx"]
    stack = int(re.search(r"STACK:(\d+)", _cuobjdump(compiled.asm["cubin"], "-res-usage")).group(1))
    print(json.dumps(dict(stack=stack, fma="fma." in ptx, ftz=".ftz" in ptx,
                          waits="griddepcontrol.wait" in ptx)))
"""


@needs_triton
def test_the_kernel_compiles_for_sm90_without_stack_or_contraction():
    """Compiled for the H200 (Triton's own ptxas, no GPU needed): no thread
    stack (it runs in the decode worker: tests/test_kernel_stacks.py says
    why that matters), no fused multiply-add and no flush-to-zero that could
    round differently from the reference, and the PDL wait."""
    from engine.cuda_context import STACK_BYTES
    from tests.sm90 import run_sm90_script

    for line in run_sm90_script(_COMPILE_SM90).splitlines():
        facts = json.loads(line)
        assert facts["stack"] <= STACK_BYTES and facts["waits"], facts
        assert not facts["fma"] and not facts["ftz"], facts
