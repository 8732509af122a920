"""The one-row 4-bit DP4A GEMV as CUDA C++ (q4_gemv.cu), compiled by NVRTC
at run time and launched through the driver API, with programmatic
dependent launch like the Triton kernels beside it.

Why NVRTC and not a built extension: the CUDA wheels of PyTorch ship
libnvrtc, so a GPU host needs no nvcc, ninja or build step, and the CPU path
(CI) never touches it. PyTorch's own NVRTC wrapper (torch.cuda._utils) does
the compile and the module load; the launch is ours, since PyTorch's takes
no launch attributes and PDL is one.

What it owns: the launch plan (rows per block tile, groups per thread,
threads, a persistent grid), the compile cache, the launch. What it must not
know: which layer calls it (engine/quant/gemv.py decides when it runs:
TANDEM_GEMV_CUDA), the model.

The plan is plain arithmetic, tested on the CPU; the kernel runs only on a
GPU (tests/test_gemv_cuda.py, against gemv.py's gemv_x8_reference).
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import torch

from engine.quant.tensor import QuantTensor

SOURCE = Path(__file__).with_name("q4_gemv.cu")
KERNEL = "tandem_q4_gemv"
GROUP = 32
MAX_THREADS = 1024
# 4 rows a tile won every one-row Q4_K shape of the 27B on the H200 against
# 1, 2 and 8 (bench.gemv_cuda, 2026-12-04 16:40, BENCHMARKS.md)
DEFAULT_ROWS = 4
# CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES,
# CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES (cuda.h)
_PROGRAMMATIC_STREAM_SERIALIZATION = 6
_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES = 3
_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
# shared memory a block may take without opting in (cuFuncSetAttribute above it),
# and what sm_90 lets one block hold, static arrays and the ring together
_DEFAULT_SHARED_BYTES = 48 * 1024
_MAX_SHARED_BYTES = 227 * 1024
_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES = 1   # a build's static shared memory (cuda.h)
MAX_STAGES = 8
EARLY_L2_TILES_CHOICES = (0, 1, 2, 3, 4)   # tiles past its first a block asks L2 for early


@dataclass(frozen=True)
class CudaGemvPlan:
    """rows: output rows a block computes per tile; slots: groups of 32
    K-elements each thread owns (g = thread + j * threads); threads per
    block; blocks_per_sm: how many blocks of the persistent grid each SM
    gets (0: as many as fit); flush:
    tiles whose cross-warp sums a block reduces together, at one barrier
    pair (1: every tile; q4_gemv.cu, FLUSH); stages: 0, each thread loads
    its next tile into registers, or the tiles come through a ring of that
    many shared-memory stages filled by bulk copies (q4_gemv.cu, STAGES;
    only where bulk_copyable holds); early_tiles: how many tiles past its
    first each block asks L2 for before the dependent-launch wait (None:
    TANDEM_GEMV_EARLY_L2_TILES's count; a block that walks only 2-3 tiles,
    as the out projections' do, may want all of them asked early)."""
    rows: int
    slots: int
    threads: int
    groups: int
    blocks_per_sm: int = 0
    flush: int = 1
    stages: int = 0
    early_tiles: int | None = None

    def __post_init__(self) -> None:
        if self.rows < 1 or self.slots < 1 or self.groups < 1:
            raise ValueError(f"rows, slots and groups must be >= 1: {self}")
        if self.threads % 32 or not 32 <= self.threads <= MAX_THREADS:
            raise ValueError(f"threads must be a multiple of 32 in 32..{MAX_THREADS}: {self}")
        if self.slots * self.threads < self.groups:
            raise ValueError(f"{self.slots} slots x {self.threads} threads cover fewer than "
                             f"the {self.groups} groups: {self}")
        if self.blocks_per_sm < 0:
            raise ValueError(f"blocks_per_sm must be >= 0: {self}")
        if self.flush < 1 or self.flush * self.rows > self.threads:
            raise ValueError(f"flush must be >= 1 with flush x rows <= threads "
                             f"(a thread sums each held row): {self}")
        if not 0 <= self.stages <= MAX_STAGES:
            raise ValueError(f"stages must be 0 (registers) or 1..{MAX_STAGES}: {self}")
        if self.early_tiles is not None and self.early_tiles not in EARLY_L2_TILES_CHOICES:
            raise ValueError(f"early_tiles must be None (the switch's) or one of "
                             f"{EARLY_L2_TILES_CHOICES}: {self}")

    def spec(self) -> dict:
        """The choices a plans file records (plan_for rebuilds the plan from
        them and K: groups and threads follow)."""
        spec = {"rows": self.rows, "slots": self.slots, "blocks_per_sm": self.blocks_per_sm,
                "flush": self.flush, "stages": self.stages}
        return spec if self.early_tiles is None else {**spec, "early_tiles": self.early_tiles}

    def stage_bytes(self, superblock: int, asymmetric: bool, d_fp32: bool) -> int:
        """One ring stage (q4_gemv.cu STAGE_BYTES): a tile's words, sc and d,
        and m and dmin when asymmetric."""
        sc = self.rows * self.groups
        d = self.rows * (self.groups // (superblock // GROUP)) * (4 if d_fp32 else 2)
        return self.rows * self.groups * 16 + (sc + d) * (2 if asymmetric else 1)

    def ring_bytes(self, superblock: int, asymmetric: bool, d_fp32: bool) -> int:
        return self.stages * self.stage_bytes(superblock, asymmetric, d_fp32)

    def tiles(self, n: int) -> int:
        return -(-n // self.rows)

    def grid(self, n: int, sms: int, resident_per_sm: int) -> int:
        """Persistent: at most one wave of blocks, never more than tiles."""
        per_sm = min(resident_per_sm, self.blocks_per_sm or resident_per_sm)
        return max(1, min(self.tiles(n), sms * max(per_sm, 1)))


def plan_for(k: int, rows: int = DEFAULT_ROWS, slots: int | None = None, blocks_per_sm: int = 0,
             flush: int = 1, stages: int = 0, early_tiles: int | None = None) -> CudaGemvPlan:
    """The fewest slots whose thread count is a whole number of warps that
    covers K's groups with the least idle threads (K = 5120: 160 threads x 1
    slot; 17408: 544 x 1; 6144: 192 x 1), or `slots` given."""
    if k % GROUP:
        raise ValueError(f"the CUDA GEMV takes K in whole groups of {GROUP}, got {k}")
    groups = k // GROUP
    choices = [slots] if slots else range(1, 65)
    best = None
    for s in choices:
        threads = -(-(-(-groups // s)) // 32) * 32
        if threads > MAX_THREADS:
            continue
        idle = s * threads - groups
        if best is None or idle < best[0]:
            best = (idle, s, threads)
        if idle == 0:
            break
    if best is None:
        raise ValueError(f"no thread count up to {MAX_THREADS} covers K = {k} "
                         f"with {slots} slots")
    return CudaGemvPlan(rows=rows, slots=best[1], threads=best[2], groups=groups,
                        blocks_per_sm=blocks_per_sm, flush=flush, stages=stages,
                        early_tiles=early_tiles)


def bulk_copyable(plan: CudaGemvPlan, qt: QuantTensor) -> bool:
    """Whether `plan`'s ring (stages > 0) can take qt: every tile whole (N a
    multiple of rows: a bulk copy has no row clamp), each of a stage's
    arrays whole 16-byte units from 16-byte aligned addresses (what
    cp.async.bulk moves), and the ring within the 227 KB a block may hold
    (with the build's static arrays: checked once built). The 27B's Q4_K
    shapes all pass at 4 rows."""
    n, _ = qt.shape
    superblock_groups = qt.superblock // GROUP
    d_bytes = plan.rows * (plan.groups // superblock_groups) * qt.d.element_size()
    arrays = [qt.qweight, qt.sc, qt.d] + ([qt.m, qt.dmin] if qt.asymmetric else [])
    return (n % plan.rows == 0 and (plan.rows * plan.groups) % 16 == 0 and d_bytes % 16 == 0
            and all(t.data_ptr() % 16 == 0 for t in arrays)
            and plan.ring_bytes(qt.superblock, qt.asymmetric, qt.d.dtype == torch.float32)
            <= _MAX_SHARED_BYTES)


def runs(x: torch.Tensor, qt: QuantTensor, bias: torch.Tensor | None = None,
         out: torch.Tensor | None = None) -> bool:
    """Whether a one-row GEMV goes to this kernel: switched on (wanted), int8
    activations not turned off (TANDEM_GEMV_INT8_X=0 keeps float x, which
    this kernel does not compute), and operands it takes."""
    from engine.quant.gemv import int8_x_override

    return (wanted() and int8_x_override() is not False and takes(x, qt, bias)
            and (out is None or _fits_out(out, x, qt.out_features)))


def _fits_out(out: torch.Tensor, x: torch.Tensor, n: int) -> bool:
    return out.shape == (1, n) and out.dtype == x.dtype and out.is_contiguous()


def takes(x: torch.Tensor, qt: QuantTensor, bias: torch.Tensor | None) -> bool:
    """One bf16 row on a GPU against 4-bit codes in groups of 32, no bias,
    16-byte aligned operands: the kernel's reach."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[0] == 1
            and x.is_contiguous() and x.data_ptr() % 16 == 0 and bias is None
            and qt.bits == 4 and qt.group == GROUP and qt.superblock % GROUP == 0
            and qt.qweight.is_contiguous() and qt.qweight.data_ptr() % 16 == 0
            and all(t.is_contiguous() for t in (qt.d, qt.sc))
            and (not qt.asymmetric or (qt.dmin.is_contiguous() and qt.m.is_contiguous()))
            and qt.d.dtype in (torch.float16, torch.float32))


# The kernel's prologue flags and their values when no prologue asks for them
_PROLOGUE_FLAGS = {"NORM": 0, "HAS_PENDING": 0, "ZC": 0, "W_F32": 0, "SILU": 0, "GATED": 0,
                   "HEAD_GROUPS": 1, "ROUND": 0}


def _check_operand(name: str, t: torch.Tensor, k: int, x: torch.Tensor) -> None:
    if t.numel() != k or not t.is_contiguous() or t.device != x.device or t.data_ptr() % 16:
        raise ValueError(f"the prologue's {name} must be a contiguous, 16-byte aligned "
                         f"tensor of {k} elements on {x.device}")


@dataclass(frozen=True)
class NormPrologue:
    """The add_rms_norm before the GEMV, done in its prologue
    (engine/fused/reference.py's add_rms_norm, or rms_norm without pending):
    x is the residual stream; with pending, round(x + pending) is stored into
    residual_out (which must not alias x or pending) and normed. The row's
    rstd is deferred to the flush (gemv.normed_gemv_x8_reference): x's int8
    codes are taken before it, so they may differ from the norm launch's by
    one here and there, at the same accuracy."""
    weight: torch.Tensor
    eps: float
    zero_centered: bool
    pending: torch.Tensor | None = None
    residual_out: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if (self.pending is None) != (self.residual_out is None):
            raise ValueError("a norm prologue takes pending and residual_out together")
        if self.weight.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"the norm weight must be bf16 or fp32, got {self.weight.dtype}")
        if self.weight.dtype == torch.float32 and not self.zero_centered:
            # engine/fused's Llama norm stores fp32 then, which this GEMV does not take
            raise ValueError("a Llama-style norm prologue needs a bf16 weight")

    def flags(self) -> dict[str, int]:
        return {"NORM": 1, "HAS_PENDING": int(self.pending is not None),
                "ZC": int(self.zero_centered), "W_F32": int(self.weight.dtype == torch.float32)}

    def operands(self, x: torch.Tensor, k: int) -> list:
        """(pending, norm_w, eps, residual_out) as the kernel takes them."""
        if x.shape[-1] != k:
            raise ValueError(f"the norm prologue takes a [1, {k}] row, got {tuple(x.shape)}")
        for name, t in (("weight", self.weight), ("pending", self.pending),
                        ("residual_out", self.residual_out)):
            if t is not None:
                _check_operand(name, t, k, x)
        if self.pending is not None and (self.pending.dtype != torch.bfloat16
                                         or self.residual_out.dtype != torch.bfloat16):
            raise ValueError("pending and residual_out must be bf16")
        if self.residual_out is not None and self.residual_out.data_ptr() in (
                x.data_ptr(), self.pending.data_ptr()):
            raise ValueError("residual_out must not alias x or pending: other blocks read them")
        return [self.pending if self.pending is not None else x, self.weight, float(self.eps),
                self.residual_out if self.residual_out is not None else x]


@dataclass(frozen=True)
class SiluPrologue:
    """The MLP's SiLU(gate) * up before its down projection, done in the
    prologue: x is the [1, 2K] gate_up row (gate then up), and the GEMV
    multiplies the activation as engine/fused's silu_mul rounds it."""

    def flags(self) -> dict[str, int]:
        return {"SILU": 1}

    def operands(self, x: torch.Tensor, k: int) -> list:
        if x.shape[-1] != 2 * k:
            raise ValueError(f"the SiLU prologue takes the [1, {2 * k}] gate_up row, "
                             f"got {tuple(x.shape)}")
        return [x, x, 0.0, x]


@dataclass(frozen=True)
class GatedNormPrologue:
    """GDN's output norm before its out projection, done in the prologue
    (engine/fused/reference.py's gated_rms_norm): x is the recurrence's
    output row [1, heads x head_dim], `gate` z (as many bf16 values, one
    contiguous row), `weight` the [head_dim] norm weight. Each head's groups
    of 32 sit on consecutive lanes of a warp, so head_dim / 32 must be a
    power of two up to 32."""
    gate: torch.Tensor
    weight: torch.Tensor
    eps: float

    def __post_init__(self) -> None:
        head_dim = self.weight.numel()
        groups = head_dim // GROUP
        if head_dim % GROUP or groups < 1 or groups > 32 or groups & (groups - 1):
            raise ValueError(f"the gated norm prologue needs a head_dim of 32 x a power of two "
                             f"up to 1024, got {head_dim}")
        if self.weight.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"the norm weight must be bf16 or fp32, got {self.weight.dtype}")
        if self.gate.dtype != torch.bfloat16:
            raise ValueError(f"the gate must be bf16, got {self.gate.dtype}")

    def flags(self) -> dict[str, int]:
        return {"GATED": 1, "HEAD_GROUPS": self.weight.numel() // GROUP,
                "W_F32": int(self.weight.dtype == torch.float32),
                # gated_rms_norm rounds w * x^ to bf16 when the weight is bf16
                "ROUND": int(self.weight.dtype == torch.bfloat16)}

    def operands(self, x: torch.Tensor, k: int) -> list:
        if x.shape[-1] != k or k % self.weight.numel():
            raise ValueError(f"the gated norm prologue takes a [1, {k}] row of whole "
                             f"{self.weight.numel()}-wide heads, got {tuple(x.shape)}")
        _check_operand("gate", self.gate, k, x)
        _check_operand("weight", self.weight, self.weight.numel(), x)
        return [self.gate, self.weight, float(self.eps), x]


Prologue = NormPrologue | SiluPrologue | GatedNormPrologue

# The kernel's epilogue flags and their values when no epilogue asks for them
_EPILOGUE_FLAGS = {"CONV": 0, "CONV_K": 0, "CONV_W_F32": 0, "CONV_WIN_F32": 0,
                   "SILU_MUL": 0}


class _ConvStep(ctypes.Structure):
    """q4_gemv.cu's ConvStep, the kernel's last parameter (by value)."""
    _fields_ = [("weight", ctypes.c_void_p), ("windows", ctypes.c_void_p),
                ("position", ctypes.c_void_p), ("in_slot", ctypes.c_void_p),
                ("write_slot", ctypes.c_void_p), ("slot_stride", ctypes.c_longlong),
                ("channels", ctypes.c_int)]


@dataclass(frozen=True)
class ConvEpilogue:
    """GDN's causal conv + SiLU after its in_proj, done in the GEMV's
    epilogue for one decode token (q4_gemv.cu, CONV; engine/gdn_kernels.py's
    conv_step is the op it replaces and its reference). Output rows [0, C)
    are the conv's channels and come out as SiLU(conv); the rows after them
    (GDN's z, b, a) as the plain GEMV's. weight [C, K]; windows [S, C, K-1],
    each slot's [C, K-1] contiguous, read at in_slot[0] (zeros when
    position[0] is 0) and rewritten at write_slot[0] (-1: nowhere); an
    in_slot of -1 marks a padding copy, whose rows stay unconvolved. The
    three index tensors are int64 on the GPU, as conv_step takes them for a
    batch of one token (a CUDA graph replays them with new values)."""
    weight: torch.Tensor
    windows: torch.Tensor
    position: torch.Tensor
    in_slot: torch.Tensor
    write_slot: torch.Tensor

    def __post_init__(self) -> None:
        if self.weight.dim() != 2 or self.weight.dtype not in (torch.bfloat16, torch.float32) \
                or not self.weight.is_contiguous():
            raise ValueError(f"the conv weight must be a contiguous [channels, width] bf16 or "
                             f"fp32 tensor, got {tuple(self.weight.shape)} {self.weight.dtype}")
        channels, width = self.weight.shape
        w = self.windows
        if w.dim() != 3 or tuple(w.shape[1:]) != (channels, width - 1) \
                or w.dtype not in (torch.bfloat16, torch.float32) \
                or w.stride(2) != 1 or w.stride(1) != width - 1:
            raise ValueError(f"the conv windows must be [slots, {channels}, {width - 1}] bf16 or "
                             f"fp32 with each slot's windows contiguous, got {tuple(w.shape)} "
                             f"{w.dtype} strides {w.stride()}")
        for name in ("position", "in_slot", "write_slot"):
            t = getattr(self, name)
            if t.dtype != torch.int64 or t.numel() < 1 or t.device != w.device \
                    or t.device != self.weight.device:
                raise ValueError(f"the conv's {name} must be an int64 tensor of at least one "
                                 f"element on {w.device}, got {t.dtype} {tuple(t.shape)} on "
                                 f"{t.device}")

    @property
    def channels(self) -> int:
        return self.weight.shape[0]

    def flags(self) -> dict[str, int]:
        return {"CONV": 1, "CONV_K": self.weight.shape[1],
                "CONV_W_F32": int(self.weight.dtype == torch.float32),
                "CONV_WIN_F32": int(self.windows.dtype == torch.float32)}

    def operands(self, x: torch.Tensor, n: int) -> _ConvStep:
        if self.channels > n:
            raise ValueError(f"the conv's {self.channels} channels are more than the "
                             f"GEMV's {n} output rows")
        if self.windows.device != x.device:
            raise ValueError(f"the conv's tensors must be on {x.device}, "
                             f"got {self.windows.device}")
        return _ConvStep(self.weight.data_ptr(), self.windows.data_ptr(),
                         self.position.data_ptr(), self.in_slot.data_ptr(),
                         self.write_slot.data_ptr(), self.windows.stride(0), self.channels)


@dataclass(frozen=True)
class SiluMulEpilogue:
    """The MLP's SiLU(gate) * up after its gate_up projection, done in the
    GEMV's epilogue (q4_gemv.cu, SILU_MUL): the weight holds N / 2 gate rows
    then N / 2 up rows, each tile pairs them, and the output is the [1, N / 2]
    activation as engine/fused's silu_mul rounds it. It takes plans of an
    even row count dividing N without a ring (a ring stage copies
    contiguous rows)."""

    def flags(self) -> dict[str, int]:
        return {"SILU_MUL": 1}

    @staticmethod
    def fits(plan: CudaGemvPlan, n: int) -> bool:
        return plan.rows % 2 == 0 and n % plan.rows == 0 and plan.stages == 0


Epilogue = ConvEpilogue | SiluMulEpilogue

L2_REGIONS = 5  # q4_gemv.cu's L2Regions: a QuantTensor's qweight, d, sc, dmin, m


class _Regions(ctypes.Structure):
    """q4_gemv.cu's L2Regions, the kernel's last parameter (by value)."""
    _fields_ = [("base", ctypes.c_void_p * L2_REGIONS), ("bytes", ctypes.c_uint * L2_REGIONS)]


@dataclass(frozen=True)
class L2Prefetch:
    """The first `rows` rows of a weight that a GEMV asks L2 for after its
    last tile (q4_gemv.cu, L2_PREFETCH): the projection that runs next, whose
    bytes then stream from DRAM while the small kernels between the two run.
    ranges: (tensor, bytes from its start) for each of the weight's tensors
    whose rows prefix is a whole number of 16-byte units from an aligned
    base; the others are left to the GEMV's own loads."""
    rows: int
    ranges: tuple[tuple[torch.Tensor, int], ...]

    @classmethod
    def of(cls, qt: QuantTensor, budget_bytes: int) -> "L2Prefetch":
        """As many leading rows of `qt` as `budget_bytes` holds (codes and
        scales together), at least one."""
        n = qt.out_features
        parts = [t for t in (qt.qweight, qt.d, qt.sc, qt.dmin, qt.m) if t is not None]
        per_row = sum(t.nbytes for t in parts) // n
        rows = max(1, min(n, budget_bytes // max(per_row, 1)))
        ranges = []
        for t in parts:
            size = t.nbytes * rows // n // 16 * 16
            if size and t.is_contiguous() and t.data_ptr() % 16 == 0:
                ranges.append((t, size))
        return cls(rows, tuple(ranges))

    @property
    def nbytes(self) -> int:
        return sum(size for _, size in self.ranges)

    def regions(self) -> _Regions:
        regions = _Regions()
        for i, (t, size) in enumerate(self.ranges):
            regions.base[i] = t.data_ptr()
            regions.bytes[i] = size
        return regions


def build_options(plan: CudaGemvPlan, superblock: int, asymmetric: bool, d_fp32: bool,
                  pdl: bool, prologue: Prologue | None = None,
                  l2_prefetch: bool = False,
                  epilogue: Epilogue | None = None,
                  early_l2_tiles: int = 0) -> tuple[str, ...]:
    """The kernel's compile-time constants as NVRTC -D options. A ring
    (stages > 0) fills its stages before the wait and takes no early tiles,
    so its options say 0 whatever was asked: one binary, one key."""
    flags = {**_PROLOGUE_FLAGS, **(prologue.flags() if prologue is not None else {}),
             **_EPILOGUE_FLAGS, **(epilogue.flags() if epilogue is not None else {})}
    early_l2_tiles = 0 if plan.stages else early_l2_tiles
    return (f"-DROWS={plan.rows}", f"-DSLOTS={plan.slots}", f"-DTHREADS={plan.threads}",
            f"-DGROUPS={plan.groups}", f"-DGPS={superblock // GROUP}",
            f"-DASYM={int(asymmetric)}", f"-DD_F32={int(d_fp32)}", f"-DPDL={int(pdl)}",
            f"-DFLUSH={plan.flush}", f"-DSTAGES={plan.stages}",
            f"-DL2_PREFETCH={int(l2_prefetch)}", f"-DEARLY_L2_TILES={early_l2_tiles}",
            *(f"-D{name}={value}" for name, value in flags.items()), "--std=c++17")


@dataclass
class _Compiled:
    function: ctypes.c_void_p
    module: object        # keeps the loaded module alive
    resident_per_sm: int
    local_bytes: int      # a thread's local memory: a spill or a stack frame
    shared_bytes: int = 0  # dynamic shared memory a launch asks for (the ring)
    fits_shared: bool = True  # the ring and the static arrays within one block's limit


@functools.lru_cache(maxsize=None)
def _compiled(options: tuple[str, ...], device: int, threads: int,
              shared_bytes: int = 0) -> _Compiled:
    """Compiled and loaded once per (constants, device): a module belongs to
    its device's context. shared_bytes: the dynamic shared memory each
    launch asks for (the ring), opted into past 48 KB."""
    from torch.cuda._utils import _cuda_load_module, _get_gpu_runtime_library, _nvrtc_compile

    major, minor = torch.cuda.get_device_capability(device)
    with torch.cuda.device(device):
        binary, name = _nvrtc_compile(SOURCE.read_text(), KERNEL,
                                      compute_capability=f"{major}{minor}",
                                      nvcc_options=list(options))
        kernel = _cuda_load_module(binary, [name])[name]
    driver = _get_gpu_runtime_library()
    static = ctypes.c_int(0)
    _check(driver.cuFuncGetAttribute(ctypes.byref(static), _FUNC_ATTRIBUTE_SHARED_SIZE_BYTES,
                                     kernel.func), "cuFuncGetAttribute")
    local = ctypes.c_int(0)
    _check(driver.cuFuncGetAttribute(
        ctypes.byref(local), _FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, kernel.func), "cuFuncGetAttribute")
    if static.value + shared_bytes > _MAX_SHARED_BYTES:   # never launched (gemv_cuda)
        return _Compiled(kernel.func, kernel, 0, local.value, shared_bytes, fits_shared=False)
    if static.value + shared_bytes > _DEFAULT_SHARED_BYTES:
        # past 48 KB a block, static and dynamic together, the launch must opt in
        # (a 48 KB ring beside 96 bytes of static arrays failed without it, 12-07)
        _check(driver.cuFuncSetAttribute(kernel.func, _FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                         ctypes.c_int(shared_bytes)), "cuFuncSetAttribute")
    resident = ctypes.c_int(0)
    _check(driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(
        ctypes.byref(resident), kernel.func, threads, ctypes.c_size_t(shared_bytes)),
        "cuOccupancyMaxActiveBlocksPerMultiprocessor")
    return _Compiled(kernel.func, kernel, resident.value, local.value, shared_bytes)


class SpillingPlan(ValueError):
    """A plan whose build spills registers to local memory: never launched,
    since a launch of a spilling kernel raises its context's local-memory
    reservation for good (tests/test_kernel_stacks.py; the 24 GiB run lost a
    gigabyte to it on 12-03). 8 rows a tile at 544 threads (down's K) spill
    100 bytes a thread, with flush 2-16 244."""


# A build's local memory a thread that is still launched. ptxas gives some
# builds a small stack frame without spilling (2 rows at 64 threads, K =
# 1056, symmetric: an 8-byte frame, 0 spill stores, nvcc 13 for sm_90; it
# passed its GPU tests before the guard, whose first GPU run on 12-05 refused
# it): 16 bytes reserve at most
# 16 x 2,048 threads x 132 SMs = 4.1 MiB, where 100 bytes (a real spill)
# reserve 26 MiB and slow the loop.
LOCAL_BYTES_ALLOWED = 16


def launchable(local_bytes: int) -> bool:
    """Whether a build with this much local memory a thread may launch."""
    return local_bytes <= LOCAL_BYTES_ALLOWED


def _check(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"{what} failed with CUDA driver error {result}")


class _AttributeValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("value", ctypes.c_int), ("align", ctypes.c_void_p)]


class _Attribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _AttributeValue)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_Attribute)), ("num_attrs", ctypes.c_uint)]


def _launch(compiled: _Compiled, grid: int, threads: int, args: list, pdl: bool) -> None:
    from torch.cuda._utils import _get_gpu_runtime_library

    values = [ctypes.c_void_p(a.data_ptr()) if isinstance(a, torch.Tensor)
              else a if isinstance(a, ctypes.Structure)
              else ctypes.c_float(a) if isinstance(a, float) else ctypes.c_int(a) for a in args]
    pointers = (ctypes.c_void_p * len(values))(
        *[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in values])
    attribute = _Attribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
    attribute.value.value = 1
    config = _LaunchConfig(grid, 1, 1, threads, 1, 1, compiled.shared_bytes,
                           ctypes.c_void_p(torch.cuda.current_stream().cuda_stream),
                           ctypes.pointer(attribute) if pdl else None, 1 if pdl else 0)
    _check(_get_gpu_runtime_library().cuLaunchKernelEx(ctypes.byref(config), compiled.function,
                                                        pointers, None), "cuLaunchKernelEx")


def gemv_cuda(x: torch.Tensor, qt: QuantTensor, out: torch.Tensor | None = None,
              plan: CudaGemvPlan | None = None, pdl: bool | None = None,
              prologue: Prologue | None = None, l2_prefetch: L2Prefetch | None = None,
              epilogue: Epilogue | None = None) -> torch.Tensor:
    """x [1, K] bf16 @ w.T -> [1, N] bf16 (takes() must hold); with a
    prologue, the op before the GEMV done first inside it: NormPrologue
    (RMSNorm(x (+ pending))), SiluPrologue (x the [1, 2K] gate_up row),
    GatedNormPrologue (GDN's gated norm); with an epilogue, the op after
    it done on its output rows: ConvEpilogue (GDN's conv step),
    SiluMulEpilogue (the MLP's activation: the output is [1, N / 2]); with
    l2_prefetch, the next weight's leading rows asked of L2 at the end
    (sm_90 on; elsewhere ignored). Unset, the plan is picked_plan's and PDL is on where
    engine/pdl.py turns it on."""
    if not takes(x, qt, None):
        raise ValueError(f"the CUDA GEMV takes one contiguous bf16 row on a GPU against "
                         f"4-bit groups of 32 with no bias; got x {tuple(x.shape)} "
                         f"{x.dtype} on {x.device} and {qt.describe()}")
    n, k = qt.shape
    given = plan is not None
    device = x.device.index if x.device.index is not None else torch.cuda.current_device()
    plan = plan or picked_plan(n, k, card_name(device))
    if pdl is None:
        from engine.pdl import pdl_capable, pdl_wanted

        pdl = pdl_capable(x.device) and pdl_wanted()
    if plan.groups != k // GROUP:
        raise ValueError(f"the plan covers {plan.groups} groups, the weight has {k // GROUP}")
    if isinstance(epilogue, SiluMulEpilogue) and not epilogue.fits(plan, n):
        if given or not epilogue.fits(plan_for(k), n):
            raise ValueError(f"the SiLU epilogue pairs gate and up rows in tiles of an even "
                             f"row count dividing N = {n}, without a ring: plan {plan.spec()} "
                             f"cannot")
        plan = plan_for(k)
    width = n // 2 if isinstance(epilogue, SiluMulEpilogue) else n
    if out is None:
        out = torch.empty(1, width, dtype=x.dtype, device=x.device)
    elif not _fits_out(out, x, width):
        raise ValueError(f"out must be a contiguous [1, {width}] {x.dtype} tensor, "
                         f"got {tuple(out.shape)} {out.dtype}")
    if prologue is not None:
        prologue_args = prologue.operands(x, k)
    elif x.shape[-1] != k:
        raise ValueError(f"x must be a [1, {k}] row, got {tuple(x.shape)}")
    else:
        prologue_args = [x, x, 0.0, x]
    conv_step = epilogue.operands(x, n) if isinstance(epilogue, ConvEpilogue) else _ConvStep()
    bulk_prefetch = torch.cuda.get_device_capability(device)[0] >= 9   # sm_90's
    if l2_prefetch is not None and (not l2_prefetch.ranges or not bulk_prefetch):
        l2_prefetch = None
    if plan.stages and not bulk_copyable(plan, qt):
        plan = _without_ring(plan, given, f"bulk copies need N a multiple of its rows and "
                                          f"whole 16-byte arrays a stage, which "
                                          f"{qt.describe()} lacks: use stages=0")
    d_fp32 = qt.d.dtype == torch.float32

    early = plan_early_tiles(plan) if bulk_prefetch else 0

    def build(plan: CudaGemvPlan) -> _Compiled:
        return _compiled(build_options(plan, qt.superblock, qt.asymmetric, d_fp32, pdl,
                                       prologue, l2_prefetch is not None, epilogue, early),
                         device, plan.threads,
                         plan.ring_bytes(qt.superblock, qt.asymmetric, d_fp32))

    compiled = build(plan)
    if not compiled.fits_shared:
        plan = _without_ring(plan, given, f"its ring of {compiled.shared_bytes} bytes and the "
                                          f"build's static arrays pass the {_MAX_SHARED_BYTES} "
                                          f"bytes of shared memory a block may hold: use "
                                          f"fewer stages")
        compiled = build(plan)
    if not launchable(compiled.local_bytes) and not given and plan != plan_for(k):
        plan = plan_for(k)   # a plans file's choice that spills with these flags
        compiled = build(plan)
    if not launchable(compiled.local_bytes):
        raise SpillingPlan(f"the CUDA GEMV's build for plan {plan.spec()} (K = {k}) spills "
                           f"{compiled.local_bytes} bytes a thread to local memory, which "
                           f"would raise the process's local-memory reservation for good: "
                           f"use fewer rows a tile or fewer slots")
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    dmin = qt.dmin if qt.asymmetric else qt.d
    m = qt.m if qt.asymmetric else qt.sc
    _launch(compiled, plan.grid(n, sms, compiled.resident_per_sm), plan.threads,
            [x, qt.qweight, qt.d, qt.sc, dmin, m, out, n, *prologue_args,
             l2_prefetch.regions() if l2_prefetch is not None else _Regions(), conv_step], pdl)
    return out


def _without_ring(plan: CudaGemvPlan, given: bool, why: str) -> CudaGemvPlan:
    """A ring plan the weight or the build cannot take: refused when the
    caller gave it, else (a plans file's, the default's) the register
    pipeline."""
    if given:
        raise ValueError(f"plan {plan.spec()} cannot run its tiles through the ring: {why}")
    return replace(plan, stages=0)


CUDA_ENV = "TANDEM_GEMV_CUDA"
PLANS_ENV = "TANDEM_GEMV_CUDA_PLANS"
EARLY_L2_TILES_ENV = "TANDEM_GEMV_EARLY_L2_TILES"


def plan_early_tiles(plan: CudaGemvPlan) -> int:
    """The tiles past its first each block of `plan` asks L2 for before the
    wait: the plan's own count, else the switch's (early_l2_tiles)."""
    return early_l2_tiles() if plan.early_tiles is None else plan.early_tiles


def early_l2_tiles() -> int:
    """How many tiles past its first each block asks L2 for before the
    dependent-launch wait (q4_gemv.cu, EARLY_L2_TILES; sm_90's bulk
    prefetch): TANDEM_GEMV_EARLY_L2_TILES, 1 by default (the int4 27B
    step: H100 6.40-6.41 -> 6.33-6.34 ms in four alternating rounds, 2: no
    better, 2026-12-06; H200 5.27-5.28 -> 5.10 ms, 2: 5.15, 2026-12-07), 0
    for none. Read per call, in a CUDA graph at capture."""
    from engine.switches import one_of

    return one_of(EARLY_L2_TILES_ENV, 1, EARLY_L2_TILES_CHOICES)


def wanted() -> bool:
    """Whether one-row GEMVs the CUDA kernel takes run it instead of the
    Triton DP4A kernel: on by default (the H200's int4 27B step, two
    alternating pairs, 2026-12-04: 6.34 / 6.32 ms against Triton's 7.39 /
    6.79); TANDEM_GEMV_CUDA=0 goes back to Triton. Read per call, in a CUDA
    graph at capture. A host without NVRTC runs Triton (nvrtc_available)."""
    from engine.switches import on_off

    return on_off(CUDA_ENV, True, on="the CUDA DP4A GEMV", off="the Triton kernels") \
        and nvrtc_available()


@functools.lru_cache(maxsize=1)
def nvrtc_available() -> bool:
    """PyTorch's CUDA wheels bring libnvrtc; a build without it (or a torch
    whose private NVRTC wrapper moved) keeps the Triton kernel."""
    try:
        from torch.cuda._utils import _cuda_load_module, _get_gpu_rtc_library  # noqa: F401

        _get_gpu_rtc_library()
        return True
    except (ImportError, OSError, RuntimeError, AttributeError):
        return False


@functools.lru_cache(maxsize=8)
def _plans_file(path: str) -> dict[tuple[int, int], CudaGemvPlan]:
    import json

    plans = {}
    for key, spec in json.loads(Path(path).read_text()).items():
        n, k = (int(v) for v in key.split(","))
        plans[(n, k)] = plan_for(k, rows=int(spec["rows"]), slots=spec.get("slots"),
                                 blocks_per_sm=int(spec.get("blocks_per_sm", 0)),
                                 flush=int(spec.get("flush", 1)),  # older files lack them
                                 stages=int(spec.get("stages", 0)),
                                 early_tiles=spec.get("early_tiles"))
    return plans


STAGES_ENV = "TANDEM_GEMV_CUDA_STAGES"


def default_stages() -> int:
    """Ring stages of the default plan (TANDEM_GEMV_CUDA_STAGES; 0: the
    register pipeline). A shape the ring cannot take runs 0 whatever this
    says (bulk_copyable)."""
    from engine.switches import one_of

    return one_of(STAGES_ENV, 0, tuple(range(MAX_STAGES + 1)))


class CardPlan(NamedTuple):
    """One CARD_PLANS entry: what a sweep chose beside plan_for's slots."""
    flush: int
    stages: int = 0
    rows: int = DEFAULT_ROWS


# The sweeps' plans for the 27B's shapes, by card (torch.cuda.get_device_name)
# and (N, K), at plan_for's slots, from `bench.gemv_cuda --rows 4 --stages 2 3
# 4 6 --plans-out` (12-05). The int4 step with them against plan_for's
# defaults, alternating runs of one warm machine (BENCHMARKS.md, 12-05
# 21:57-22:04): H200 6.79-6.89 ms against 6.93-7.38 (four pairs, every one
# won); H100 7.08 / 7.31 against 7.17-7.43. Shapes and cards not named get
# plan_for's. Down runs 5 rows a tile (one more register than 4, ~25% more
# bytes in flight, still one 544-thread block an SM): the int4 step 5.10
# against 5.11-5.12 ms in four H200 pairs, 6.36 against 6.37-6.38 in two H100
# pairs (BENCHMARKS.md 2026-12-07 16:06, 17:52). Six rows at K = 5120 (3
# blocks an SM) win in isolation but not in the step (17:58).
CARD_PLANS: dict[str, dict[tuple[int, int], CardPlan]] = {
    "NVIDIA H200": {
        (34816, 5120): CardPlan(16),             # gate_up
        (5120, 17408): CardPlan(16, rows=5),     # down
        (16480, 5120): CardPlan(8),              # gdn in_proj
        (14336, 5120): CardPlan(16),             # attn qkv
        (248320, 5120): CardPlan(1, stages=3),   # lm_head, through a 3-stage ring
    },
    "NVIDIA H100 80GB HBM3": {
        (5120, 17408): CardPlan(16, rows=5),
        (16480, 5120): CardPlan(8),
        (14336, 5120): CardPlan(16),
        (248320, 5120): CardPlan(16),
    },
}


def card_plan(card: str | None, n: int, k: int) -> CudaGemvPlan | None:
    """CARD_PLANS' plan for (N, K) on `card` (a CUDA device name), as
    plan_for builds it; None where the table has none."""
    found = CARD_PLANS.get(card or "", {}).get((n, k))
    if found is None:
        return None
    return plan_for(k, rows=found.rows, flush=found.flush, stages=found.stages)


@functools.lru_cache(maxsize=16)
def card_name(device: int) -> str:
    return torch.cuda.get_device_name(device)


def picked_plan(n: int, k: int, card: str | None = None) -> CudaGemvPlan:
    """The plan a sweep wrote for (N, K) into the JSON file TANDEM_GEMV_CUDA_PLANS
    names ({"N,K": CudaGemvPlan.spec()}, as bench.gemv_cuda --plans-out writes it);
    else with TANDEM_GEMV_CUDA_STAGES set plan_for(k) at those stages; else
    CARD_PLANS' for this card (`card`, a CUDA device name); else plan_for(k)
    at DEFAULT_ROWS. TANDEM_GEMV_CUDA_STAGES=0 thus runs plan_for's defaults."""
    import os

    path = os.environ.get(PLANS_ENV, "")
    if path:
        found = _plans_file(path).get((n, k))
        if found is not None:
            return found
    if os.environ.get(STAGES_ENV, "") == "":
        found = card_plan(card, n, k)
        if found is not None:
            return found
    return plan_for(k, rows=DEFAULT_ROWS, stages=default_stages())
