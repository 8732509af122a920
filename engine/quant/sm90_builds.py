"""The CUDA GEMV's builds (q4_gemv.cu) compiled for sm_90 without a GPU.

NVRTC compiles without a device: this takes it from the `nvidia-cuda-nvrtc`
wheel (the test extra installs 13.0, the one the GPU host's torch compiles
with: another minor gives other registers), so CI and a CPU-only checkout check a
kernel edit before it costs device time: every build the 27B's decode step
runs compiles, spills nothing, and loads what no kernel writes through the
read-only path. What it must not know: anything of a launch (gemv_cuda.py
owns those); the cases are build options only.
"""
from __future__ import annotations

import ctypes
import functools
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.quant import gemv_cuda
from engine.quant.gemv_cuda import (CARD_PLANS, ConvEpilogue, GatedNormPrologue, NormPrologue,
                                    SiluMulEpilogue, SiluPrologue, build_options, card_plan,
                                    plan_for)

ARCH = "sm_90"
OUT_PROJ = (5120, 6144)        # gdn out and attn o: plan_for's, no card plan
GATE_UP, DOWN, GDN_IN, ATTN_QKV = (34816, 5120), (5120, 17408), (16480, 5120), (14336, 5120)
SUPERBLOCK = 256               # Q4_K's


@dataclass(frozen=True)
class Build:
    """One NVRTC compile: its result (0 is success), ptxas' log and the PTX."""
    name: str
    options: tuple[str, ...]
    result: int
    log: str
    ptx: str

    @property
    def registers(self) -> int | None:
        found = re.search(r"Used (\d+) registers", self.log)
        return int(found.group(1)) if found else None

    @property
    def spill_bytes(self) -> int:
        """Bytes of spill stores plus loads, and the stack frame, as ptxas
        reports them: a build with any is never launched (gemv_cuda's
        SpillingPlan)."""
        return sum(int(n) for n in re.findall(
            r"(\d+) bytes (?:stack frame|spill stores|spill loads)", self.log))

    def coherent_global_loads(self) -> list[str]:
        """The PTX's global loads that do not take the read-only (.nc) path."""
        return [line.strip() for line in self.ptx.splitlines()
                if re.match(r"\s*ld\.global\.(?!nc)", line)]


def _nvrtc_dir() -> Path | None:
    """The wheel's library folder (nvidia/cu13/lib), if the wheel is installed."""
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations if spec else None) or []:
        lib = Path(root) / "cu13" / "lib"
        if (lib / "libnvrtc.so.13").exists():
            return lib
    return None


@functools.lru_cache(maxsize=1)
def load_nvrtc() -> ctypes.CDLL | None:
    """NVRTC 13 from the wheel, else from the loader's path; None without it.
    The builtins library is loaded first, by path: NVRTC finds it by name
    only, and the wheel's folder is on no loader path."""
    lib = _nvrtc_dir()
    try:
        if lib is None:
            return ctypes.CDLL("libnvrtc.so.13")
        builtins = sorted(lib.glob("libnvrtc-builtins.so.13*"))
        if builtins:
            ctypes.CDLL(str(builtins[0]), mode=ctypes.RTLD_GLOBAL)
        return ctypes.CDLL(str(lib / "libnvrtc.so.13"))
    except OSError:
        return None


def compile_sm90(name: str, options: tuple[str, ...], nvrtc: ctypes.CDLL) -> Build:
    """q4_gemv.cu under `options` for sm_90, with ptxas -v's log and the PTX."""
    prog = ctypes.c_void_p()
    source = gemv_cuda.SOURCE.read_text().encode()
    if nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source, b"q4_gemv.cu", 0, None, None):
        raise RuntimeError("nvrtcCreateProgram failed")
    try:
        args = [f"--gpu-architecture={ARCH}".encode(), b"--ptxas-options=-v",
                *(o.encode() for o in options)]
        result = nvrtc.nvrtcCompileProgram(prog, len(args), (ctypes.c_char_p * len(args))(*args))
        log = _text(nvrtc.nvrtcGetProgramLogSize, nvrtc.nvrtcGetProgramLog, prog)
        ptx = _text(nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX, prog) if result == 0 else ""
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
    return Build(name, options, result, log, ptx)


def _text(size_of, get, prog) -> str:
    size = ctypes.c_size_t()
    size_of(prog, ctypes.byref(size))
    buffer = ctypes.create_string_buffer(size.value)
    get(prog, buffer)
    return buffer.value.decode(errors="replace")


def _conv_epilogue() -> ConvEpilogue:
    """GDN's conv as the 27B's in_proj carries it (width 4, a bf16 weight,
    fp32 windows): only its flags matter to a build."""
    index = torch.zeros(1, dtype=torch.long)
    return ConvEpilogue(torch.zeros(16, 4, dtype=torch.bfloat16),
                        torch.zeros(2, 16, 3, dtype=torch.float32), index, index, index)


def step_cases(card: str = "NVIDIA H200") -> list[tuple[str, tuple[str, ...]]]:
    """(name, options) of the builds the 27B's int4 decode step launches on
    `card` (its CARD_PLANS, plan_for's for the out projections; the
    epilogues on by default, one early tile, the read-ahead), each also
    without the early tiles, the three prologues behind their switches
    (the norm's on every projection after a layer norm)."""
    def options(n, k, early=1, prologue=None, epilogue=None, plan=None):
        # the table's plan, not picked_plan's: no switch of the environment moves the cases
        plan = plan or card_plan(card, n, k) or plan_for(k)
        return build_options(plan, SUPERBLOCK, True, False, True,
                             prologue=prologue, l2_prefetch=True, epilogue=epilogue,
                             early_l2_tiles=early)

    epilogues = {GATE_UP: SiluMulEpilogue(), GDN_IN: _conv_epilogue()}
    cases = []
    for n, k in [*CARD_PLANS[card], OUT_PROJ]:
        for early in (0, 1):
            name = f"{card}: {n} x {k}, early L2 tiles {early}"
            cases.append((name, options(n, k, early, epilogue=epilogues.get((n, k)))))
    weight = torch.zeros(5120, dtype=torch.bfloat16)
    residual = torch.zeros(1, 5120, dtype=torch.bfloat16)
    norm = NormPrologue(weight, 1e-6, True, residual, residual.clone())
    # TANDEM_NORM_PROLOGUE=1's builds: every projection after a layer norm
    cases += [(f"{card}: {name} with the norm prologue{tail}",
               options(*shape, prologue=norm, epilogue=epilogues.get(shape)))
              for name, shape, tail in (("gate_up", GATE_UP, " and the SiLU epilogue"),
                                        ("gdn in_proj", GDN_IN, " and the conv epilogue"),
                                        ("attn qkv", ATTN_QKV, ""))]
    cases += [
        (f"{card}: down with the SiLU prologue", options(*DOWN, prologue=SiluPrologue())),
        (f"{card}: gdn out with the gated norm prologue",
         options(*OUT_PROJ, prologue=GatedNormPrologue(torch.zeros(1, 6144, dtype=torch.bfloat16),
                                                       torch.zeros(128, dtype=torch.bfloat16),
                                                       1e-6))),
        (f"{card}: gdn out with its own early tile count 3",
         options(*OUT_PROJ, early=3, plan=plan_for(OUT_PROJ[1], early_tiles=3))),
    ]
    return cases


def reads_only_unwritten_arrays(options: tuple[str, ...]) -> bool:
    """Whether the build reads nothing a kernel writes meanwhile, so every
    global load may take the read-only path: all but the conv epilogue,
    which reads the windows it rewrites."""
    return "-DCONV=1" not in options
