"""Modules that hold a QuantTensor in place of a dense weight, and the swap
that puts them into a loaded model.

QuantLinear replaces nn.Linear and QuantEmbedding replaces nn.Embedding
after the model is built (engine/loader.py), so the model code needs no
change: they are called like the modules they replace. Code that reads
`module.weight` and calls F.linear on it (the model's output head does, for
tied and untied heads alike) gets a QuantWeight, a tensor subclass whose
F.linear runs the quantized matmul; any other use of it dequantizes.

Their state-dict entries are the QuantTensor's (`{prefix}.qweight`, `.qd`,
`.qsc`, `.qdmin`, `.qm`) plus a Linear's bias: the shared weights arena lays
them out like any other tensors.

SplitLinear stands in for a merged projection (engine/model.py
`merged_parts`) whose checkpoint parts have different packed formats (a
Q4_K_M file gives v_proj more bits than q_proj and k_proj in some layers):
it holds runs of equal format as `parts.0`, `parts.1`, ... and is called
like the merged nn.Linear.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine.quant.tensor import QuantTensor


def quant_matmul(x: torch.Tensor, qt: QuantTensor, bias: torch.Tensor | None = None,
                 l2_prefetch=None) -> torch.Tensor:
    """x [..., K] @ w.T (+ bias): Triton kernels on CUDA, the PyTorch reference elsewhere.
    l2_prefetch (gemv_cuda.L2Prefetch): the weight a one-row CUDA GEMV reads ahead."""
    if x.device.type == "cuda":
        from engine.quant.kernels import triton_matmul
        return triton_matmul(x, qt, bias, l2_prefetch)
    from engine.quant.kernels import reference_matmul
    return reference_matmul(x, qt, bias)


class _QuantHolder(nn.Module):
    """Registers a QuantTensor's parts as buffers (so they are in the state dict)."""

    def __init__(self, qt: QuantTensor, compute_dtype: torch.dtype) -> None:
        super().__init__()
        for suffix, t in qt.tensors().items():
            self.register_buffer(suffix, t)
        if not qt.asymmetric:
            self.qdmin = self.qm = None
        self.compute_dtype = compute_dtype
        self._weight_view = None

    @property
    def quant(self) -> QuantTensor:
        # built per call from the current buffers: .to() and state-dict
        # assignment replace them; the dataclass check is cheap next to a matmul
        return QuantTensor(self.qweight, self.qd, self.qsc, self.qdmin, self.qm)

    @property
    def weight(self) -> "QuantWeight":
        view = self._weight_view
        if view is None or view.source is not self or view.device != self.qweight.device:
            view = QuantWeight(self)
            self._weight_view = view
        return view

    def extra_repr(self) -> str:
        qt = self.quant
        return f"{qt.in_features} -> {qt.out_features}, {qt.describe()}"


class QuantLinear(_QuantHolder):
    def __init__(self, qt: QuantTensor, bias: torch.Tensor | None,
                 compute_dtype: torch.dtype) -> None:
        super().__init__(qt, compute_dtype)
        self.in_features, self.out_features = qt.in_features, qt.out_features
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        # (the projection that runs next, bytes of it to read ahead) or None:
        # a tuple, so that nn.Module does not adopt the other module as a child
        self._read_ahead: tuple[QuantLinear, int] | None = None

    def read_ahead(self, following: "QuantLinear | None", budget_bytes: int) -> None:
        """After this projection's one-row CUDA GEMV, ask L2 for the first
        `budget_bytes` of `following`'s weight (the projection the model runs
        next): DRAM streams it while the small kernels between the two run
        (gemv_cuda.L2Prefetch). None or 0 bytes: nothing."""
        self._read_ahead = (following, budget_bytes) \
            if following is not None and budget_bytes > 0 else None

    def _l2_prefetch(self):
        """The L2Prefetch of the projection that runs next, from its current
        buffers (an arena may have moved them since read_ahead), or None."""
        if self._read_ahead is None:
            return None
        following, budget = self._read_ahead
        qt = following.quant
        if qt.qweight.device != self.qweight.device:
            return None
        from engine.quant.gemv_cuda import L2Prefetch
        return L2Prefetch.of(qt, budget)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        one_row = x.is_cuda and x.numel() == x.shape[-1]   # what the CUDA GEMV takes
        return quant_matmul(x, self.quant, self.bias, self._l2_prefetch() if one_row else None)

    def forward_normed(self, x: torch.Tensor, pending: torch.Tensor | None,
                       weight: torch.Tensor, eps: float, zero_centered: bool,
                       epilogue=None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(x + pending, self(rms_norm(x + pending))) with the norm done in the
        CUDA GEMV's prologue (gemv_cuda.NormPrologue), or None where that does
        not apply (prologue_wanted, operands the kernel does not take). With
        `epilogue` (one epilogue_applies accepted) the op after the
        projection too, in the same launch's epilogue."""
        if not self._prologue_may_run(x, NORM_PROLOGUE_ENV):
            return None
        from engine.quant import gemv_cuda

        if not gemv_cuda.runs(x, self.quant):
            return None
        residual = torch.empty_like(x) if pending is not None else None
        try:  # the prologue's own checks: weight dtype, pending's dtype, size, alignment
            prologue = gemv_cuda.NormPrologue(weight, eps, zero_centered, pending, residual)
            prologue.operands(x, self.quant.in_features)
        except ValueError:  # e.g. a Llama norm's fp32 weight: the norm's launch
            return None
        return (x if residual is None else residual,
                gemv_cuda.gemv_cuda(x, self.quant, prologue=prologue, epilogue=epilogue,
                                    l2_prefetch=self._l2_prefetch()))

    def forward_activated(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """self(silu_mul(gate, up)) with the activation done in the CUDA
        GEMV's prologue, from the MLP's gate_up row [1, 2K]; or None where
        that does not apply (prologue_wanted, operands the kernel does not
        take)."""
        if not self._prologue_may_run(gate_up, SILU_PROLOGUE_ENV):
            return None
        from engine.quant import gemv_cuda

        if gate_up.shape[-1] != 2 * self.quant.in_features or not gemv_cuda.runs(gate_up,
                                                                                 self.quant):
            return None
        return gemv_cuda.gemv_cuda(gate_up, self.quant, prologue=gemv_cuda.SiluPrologue(),
                                   l2_prefetch=self._l2_prefetch())

    def forward_gated_normed(self, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                             eps: float) -> torch.Tensor | None:
        """self(gated_rms_norm(x, gate)) for GDN's output, x and gate
        [1, heads, head_dim], with the norm done in the CUDA GEMV's prologue;
        or None where that does not apply (prologue_wanted, operands the
        kernel does not take)."""
        if not self._prologue_may_run(x, GATED_PROLOGUE_ENV):
            return None
        from engine.quant import gemv_cuda

        row = x.reshape(1, -1)
        if x.shape != gate.shape or x.shape[0] != 1 or not gate.is_contiguous() \
                or not gemv_cuda.runs(row, self.quant):
            return None
        try:  # the prologue's own checks: head width, dtypes, sizes, alignment
            prologue = gemv_cuda.GatedNormPrologue(gate.reshape(1, -1), weight, eps)
            prologue.operands(row, self.quant.in_features)
        except ValueError:  # e.g. heads narrower than a group: the norm's launch
            return None
        return gemv_cuda.gemv_cuda(row, self.quant, prologue=prologue,
                                   l2_prefetch=self._l2_prefetch())

    def epilogue_applies(self, x: torch.Tensor, epilogue) -> bool:
        """Whether this projection's CUDA GEMV of row x can end with
        `epilogue`: gemv_cuda.ConvEpilogue (GDN's decode conv over the first
        rows, TANDEM_CONV_EPILOGUE) or SiluMulEpilogue (the MLP's activation
        of a gate_up projection, TANDEM_SILU_EPILOGUE); else the caller
        launches that op itself."""
        from engine.quant import gemv_cuda

        conv = isinstance(epilogue, gemv_cuda.ConvEpilogue)
        switch = CONV_EPILOGUE_ENV if conv else SILU_EPILOGUE_ENV
        if self.bias is not None or not x.is_cuda or not epilogue_wanted(switch) \
                or not gemv_cuda.runs(x, self.quant):
            return False
        n, k = self.quant.shape
        if conv:
            return epilogue.channels <= n
        return gemv_cuda.SiluMulEpilogue.fits(gemv_cuda.plan_for(k), n)

    def forward_in_epilogue(self, x: torch.Tensor, epilogue) -> torch.Tensor:
        """self(x) with the op after it in the CUDA GEMV's epilogue (one
        epilogue_applies accepted): the conv's rows come out convolved, a
        gate_up projection's output as the [1, N / 2] activation."""
        from engine.quant import gemv_cuda

        return gemv_cuda.gemv_cuda(x, self.quant, epilogue=epilogue,
                                   l2_prefetch=self._l2_prefetch())

    def _prologue_may_run(self, x: torch.Tensor, switch: str) -> bool:
        return self.bias is None and x.is_cuda and prologue_wanted(switch)


NORM_PROLOGUE_ENV = "TANDEM_NORM_PROLOGUE"
SILU_PROLOGUE_ENV = "TANDEM_SILU_PROLOGUE"
GATED_PROLOGUE_ENV = "TANDEM_GATED_PROLOGUE"
_PROLOGUES = {NORM_PROLOGUE_ENV: ("norms in the GEMV prologue", "a norm launch"),
              SILU_PROLOGUE_ENV: ("the MLP activation in down's GEMV prologue",
                                  "an activation launch"),
              GATED_PROLOGUE_ENV: ("GDN's gated norm in out_proj's GEMV prologue",
                                   "a gated norm launch")}


def prologue_wanted(switch: str) -> bool:
    """Whether the op before a projection runs in its CUDA GEMV's prologue:
    TANDEM_NORM_PROLOGUE=1 (layer norms: QuantLinear.forward_normed),
    TANDEM_SILU_PROLOGUE=1 (the MLP's activation: forward_activated),
    TANDEM_GATED_PROLOGUE=1 (GDN's gated norm: forward_gated_normed). Each
    is off until the H200 has timed it (the norm's first build lost ~3 us a
    GEMV). Read per call; in a CUDA graph, at capture. The prologues compute
    int8 activations, so TANDEM_GEMV_INT8_X=0 keeps them off too
    (gemv_cuda.runs)."""
    from engine.switches import on_off

    on, off = _PROLOGUES[switch]
    return on_off(switch, False, on=on, off=off)


CONV_EPILOGUE_ENV = "TANDEM_CONV_EPILOGUE"
SILU_EPILOGUE_ENV = "TANDEM_SILU_EPILOGUE"
_EPILOGUES = {CONV_EPILOGUE_ENV: ("GDN's conv in in_proj's GEMV epilogue", "a conv launch"),
              SILU_EPILOGUE_ENV: ("the MLP activation in gate_up's GEMV epilogue",
                                  "an activation launch")}


def epilogue_wanted(switch: str) -> bool:
    """Whether the op after a projection runs in its CUDA GEMV's epilogue:
    TANDEM_CONV_EPILOGUE (GDN's decode conv) and TANDEM_SILU_EPILOGUE (the
    MLP's activation), asked by QuantLinear.epilogue_applies. Both on
    by default: on an H100 (12-05/06) the int4 step 7.21-7.22 ms against
    7.30-7.32 with the conv's, 7.23-7.25 against 7.27-7.29 adding the
    activation's; 0 gives the op its own launch. Read per call; in a CUDA
    graph, at capture."""
    from engine.switches import on_off

    on, off = _EPILOGUES[switch]
    return on_off(switch, True, on=on, off=off)


L2_PREFETCH_ENV = "TANDEM_GEMV_L2_PREFETCH_MB"
L2_PREFETCH_CHOICES = (0, 4, 8, 16, 24, 32, 48)


def read_ahead_chain(projections: Sequence[nn.Module], budget_bytes: int) -> int:
    """Each QuantLinear of `projections` (in the order they run) reads ahead
    `budget_bytes` of the next one when that is a QuantLinear too; returns
    how many do. 0 bytes unlinks them all."""
    linked = 0
    for current, following in zip(projections, [*projections[1:], None]):
        if isinstance(current, QuantLinear):
            quant_next = following if isinstance(following, QuantLinear) else None
            current.read_ahead(quant_next, budget_bytes)
            linked += quant_next is not None and budget_bytes > 0
    return linked


def adopt_read_ahead(model: nn.Module) -> int:
    """read_ahead_chain over a GPU model's decode projections with
    TANDEM_GEMV_L2_PREFETCH_MB megabytes (read at load; 0 unlinks them all).
    4 by default: on an H100 (12-07) the int4 step 6.37-6.40 ms against
    6.43-6.44 without, in nine pairs; 8 and 16 MB lose (6.46-6.47, 6.67).
    On the H200 level (5.10-5.11 against 5.08-5.10 ms, four pairs;
    BENCHMARKS.md 2026-12-07)."""
    from engine.switches import one_of

    megabytes = one_of(L2_PREFETCH_ENV, 4, L2_PREFETCH_CHOICES)
    if not hasattr(model, "decode_projections"):
        return 0
    return read_ahead_chain(model.decode_projections(), megabytes << 20)


class QuantEmbedding(_QuantHolder):
    """Looks rows up by dequantizing only the rows asked for."""

    def __init__(self, qt: QuantTensor, compute_dtype: torch.dtype) -> None:
        super().__init__(qt, compute_dtype)
        self.num_embeddings, self.embedding_dim = qt.out_features, qt.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        rows = self.quant.dequantize(self.compute_dtype, rows=flat)
        return rows.view(*ids.shape, self.embedding_dim)


class QuantWeight(torch.Tensor):
    """A stand-in for a quantized module's `.weight`: shape [N, K] and the
    compute dtype, no storage. F.linear with it runs the quantized matmul;
    anything else sees the dequantized weight (slow, and never on the hot path)."""

    source: _QuantHolder

    @staticmethod
    def __new__(cls, source: _QuantHolder):
        qt = source.quant
        t = torch.Tensor._make_wrapper_subclass(cls, qt.shape, dtype=source.compute_dtype,
                                                device=qt.device, requires_grad=False)
        t.source = source
        return t

    def __repr__(self) -> str:
        return f"QuantWeight({self.source.extra_repr()})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and isinstance(args[1], QuantWeight) and \
                not any(isinstance(a, QuantWeight) for a in args[:1]):
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            return quant_matmul(args[0], args[1].source.quant, bias)
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)

        def dense(a):
            return a.source.quant.dequantize(a.source.compute_dtype) \
                if isinstance(a, QuantWeight) else a
        args = tuple(dense(a) for a in args)
        kwargs = {k: dense(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise TypeError(f"QuantWeight has no storage; {func} must go through F.linear")


_METADATA = {torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,
             torch.Tensor.size, torch.Tensor.dim, torch.Tensor.ndim.__get__,
             torch.Tensor.numel, torch.Tensor.is_floating_point,
             torch.Tensor.__repr__}


class SplitLinear(nn.Module):
    """A merged projection kept as parts (`parts.{j}`: nn.Linear or
    QuantLinear, in output order) because their formats differ; the output
    is the parts' outputs side by side, as the merged matrix would give."""

    def __init__(self, in_features: int, rows: Sequence[int], bias: bool,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None
                 ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, sum(rows)
        self.parts = nn.ModuleList(nn.Linear(in_features, r, bias=bias, device=device,
                                             dtype=dtype) for r in rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features} in {len(self.parts)} parts"


# ------------------------------------------------------------------- the swap


def split_in(model: nn.Module, name: str, rows: Sequence[int]) -> SplitLinear:
    """Replace the nn.Linear `name` by a SplitLinear of nn.Linear parts with
    `rows` outputs each, on the old module's device and dtype (meta while
    loading: nothing is allocated)."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = getattr(parent, child, None)
    if not isinstance(old, nn.Linear):
        raise ValueError(f"{name} is a {type(old).__name__}, not a Linear: it cannot be split")
    if sum(rows) != old.out_features:
        raise ValueError(f"{name}: parts of {list(rows)} rows do not make its "
                         f"{old.out_features} outputs")
    new = SplitLinear(old.in_features, rows, old.bias is not None, old.weight.device,
                      old.weight.dtype)
    setattr(parent, child, new)
    return new



def swap_in(model: nn.Module, quantized: dict[str, QuantTensor], compute_dtype: torch.dtype,
            biases: dict[str, torch.Tensor] | None = None) -> list[str]:
    """Replace each module named in `quantized` (nn.Linear or nn.Embedding, shape
    checked) by its quantized counterpart; returns the names that were swapped.
    A name that is not such a module raises ValueError."""
    biases = biases or {}
    done = []
    for name, qt in quantized.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, child, None)
        if isinstance(old, nn.Linear):
            expected = (old.out_features, old.in_features)
            new = QuantLinear(qt, biases.get(name, old.bias), compute_dtype)
        elif isinstance(old, nn.Embedding):
            expected = (old.num_embeddings, old.embedding_dim)
            new = QuantEmbedding(qt, compute_dtype)
        else:
            raise ValueError(f"{name} is a {type(old).__name__}, not a Linear or Embedding: "
                             "it cannot hold quantized weights")
        if tuple(qt.shape) != expected:
            raise ValueError(f"{name}: quantized weight has shape {tuple(qt.shape)}, the model "
                             f"expects {expected}")
        setattr(parent, child, new)
        done.append(name)
    return done


def quantizable_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every nn.Linear and nn.Embedding of `model`, by name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))}
