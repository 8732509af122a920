"""QuantTensor: the packed low-bit layout of one [N, K] weight matrix.

    w[n, k] = d[n, k // S] * sc[n, k // G] * q[n, k]  -  dmin[n, k // S] * m[n, k // G]

computed in fp32 in exactly that order (this is how llama.cpp and the gguf
package dequantize K-quants, so every GGUF type maps here bit for bit):

  * q: 4-bit codes 0..15 packed two per byte along K (`qweight` uint8
    [N, K/2]; byte j holds k = 2j in its low nibble and k = 2j+1 in its high
    nibble), or 8-bit signed codes (`qweight` int8 [N, K]);
  * G (group): K-elements sharing one `sc` (and `m`), int8 [N, K/G];
  * S (superblock, a multiple of G): K-elements sharing one `d` (and `dmin`),
    float16 or float32 [N, K/S];
  * dmin/m absent: symmetric (no minimum).

Mapping of the sources (engine/weights/ decodes them):
  Q4_K  4-bit G=32  S=256 with min      Q5_K  8-bit G=32 S=256 with min
  Q6_K  8-bit G=16  S=256 (q-32)        Q8_0  8-bit G=S=32
  Q4_0  4-bit G=S=32 dmin=d, m=8        Q4_1  4-bit G=S=32 dmin=-min, m=1
  GPTQ/AWQ int4: 4-bit G=S=group_size, d=dmin=scale, sc=1, m=zero

The layout is self-describing from tensor shapes and dtypes, so a state dict
of QuantTensors (names `{prefix}.qweight`, `.qd`, `.qsc`, `.qdmin`, `.qm`)
travels through the shared-memory weights arena with no side metadata.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

SUFFIXES = ("qweight", "qd", "qsc", "qdmin", "qm")
SCALE_DTYPES = (torch.float16, torch.float32)


@dataclass
class QuantTensor:
    qweight: torch.Tensor
    d: torch.Tensor
    sc: torch.Tensor
    dmin: torch.Tensor | None = None
    m: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self._check()

    # ------------------------------------------------------------ derived

    @property
    def bits(self) -> int:
        return 4 if self.qweight.dtype == torch.uint8 else 8

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1] * (2 if self.bits == 4 else 1)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def group(self) -> int:
        return self.in_features // self.sc.shape[1]

    @property
    def superblock(self) -> int:
        return self.in_features // self.d.shape[1]

    @property
    def asymmetric(self) -> bool:
        return self.dmin is not None

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def tensors(self) -> dict[str, torch.Tensor]:
        """The stored tensors by suffix (state-dict names are `{prefix}.{suffix}`)."""
        out = {"qweight": self.qweight, "qd": self.d, "qsc": self.sc}
        if self.asymmetric:
            out.update(qdmin=self.dmin, qm=self.m)
        return out

    def describe(self) -> str:
        kind = "asym" if self.asymmetric else "sym"
        return f"int{self.bits} G{self.group}/S{self.superblock} {kind}"

    # ------------------------------------------------------- construction

    @classmethod
    def from_codes(cls, codes: torch.Tensor, bits: int, d: torch.Tensor, sc: torch.Tensor,
                   dmin: torch.Tensor | None = None, m: torch.Tensor | None = None) -> "QuantTensor":
        """Pack integer codes [N, K] (0..15 for 4 bits, -128..127 for 8)."""
        if bits == 4:
            c = codes.to(torch.uint8)
            qweight = c[:, 0::2] | (c[:, 1::2] << 4)
        elif bits == 8:
            qweight = codes.to(torch.int8)
        else:
            raise ValueError(f"QuantTensor holds 4- or 8-bit codes, not {bits}")
        return cls(qweight.contiguous(), d.contiguous(), sc.to(torch.int8).contiguous(),
                   None if dmin is None else dmin.contiguous(),
                   None if m is None else m.to(torch.int8).contiguous())

    @classmethod
    def from_state(cls, tensors: dict[str, torch.Tensor], prefix: str) -> "QuantTensor":
        def get(suffix):
            return tensors.get(f"{prefix}.{suffix}")
        return cls(get("qweight"), get("qd"), get("qsc"), get("qdmin"), get("qm"))

    def state(self, prefix: str) -> dict[str, torch.Tensor]:
        return {f"{prefix}.{k}": v for k, v in self.tensors().items()}

    def to(self, device: torch.device | str) -> "QuantTensor":
        return QuantTensor(**{f: (None if t is None else t.to(device))
                              for f, t in self._fields().items()})

    def _fields(self) -> dict[str, torch.Tensor | None]:
        return {"qweight": self.qweight, "d": self.d, "sc": self.sc, "dmin": self.dmin,
                "m": self.m}

    # ---------------------------------------------------------- reference

    def codes(self, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        """The integer codes [N, K]."""
        if self.bits == 8:
            return self.qweight.to(dtype)
        q = self.qweight.to(torch.int32)  # torch's uint8 & is an order slower on the CPU
        out = torch.empty(self.out_features, q.shape[1], 2, dtype=dtype, device=q.device)
        out[..., 0] = q & 0xF
        out[..., 1] = q >> 4
        return out.view(self.out_features, -1)

    def group_scales(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """fp32 per-group scale d*sc and minimum dmin*m, [N, K/G] each."""
        per = self.superblock // self.group

        def widen(x):
            x = x.float()
            return x if per == 1 else x.repeat_interleave(per, dim=1)
        scale = widen(self.d) * self.sc.float()
        if not self.asymmetric:
            return scale, None
        return scale, widen(self.dmin) * self.m.float()

    def dequantize(self, dtype: torch.dtype = torch.float32, rows: torch.Tensor | None = None
                   ) -> torch.Tensor:
        """The dense weight (fp32 math, then `dtype`); `rows` picks rows first
        (an embedding lookup dequantizes only what it reads)."""
        t = self if rows is None else self.select_rows(rows)
        scale, minimum = t.group_scales()
        n, g = t.out_features, t.group
        w = t.codes(torch.float32).view(n, -1, g)
        w.mul_(scale[..., None])
        if minimum is not None:
            w.sub_(minimum[..., None])
        return w.view(n, -1).to(dtype)

    def dequantize_halves(self, dtype: torch.dtype = torch.float32
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """4-bit only: the dense weight's even and odd columns [N, K/2] each
        (no interleaving: the CPU matmul uses them against x's even and odd
        columns). Same values as dequantize()."""
        scale, minimum = self.group_scales()
        n, half = self.out_features, self.group // 2
        q = self.qweight.to(torch.int32)
        out = []
        for codes in (q & 0xF, q >> 4):
            w = codes.to(torch.float32).view(n, -1, half).mul_(scale[..., None])
            if minimum is not None:
                w.sub_(minimum[..., None])
            out.append(w.view(n, -1).to(dtype))
        return out[0], out[1]

    # -------------------------------------------------------- permutations

    def select_rows(self, rows: torch.Tensor) -> "QuantTensor":
        return QuantTensor(**{f: (None if t is None else t.index_select(0, rows))
                              for f, t in self._fields().items()})

    def permute_columns(self, perm: torch.Tensor) -> "QuantTensor":
        """Columns reordered (`out[:, j] = w[:, perm[j]]`) where perm moves
        aligned blocks of whole groups. A superblock the permutation splits is
        narrowed first (its d/dmin repeated), which changes no value."""
        if torch.equal(perm.cpu(), torch.arange(self.in_features)):
            return self
        block = _block_of(perm, self.in_features)
        if block % self.group:
            raise ValueError(f"a column permutation in blocks of {block} splits groups of "
                             f"{self.group}: it cannot be applied to packed codes")
        t = self if block % self.superblock == 0 else self._narrow_superblock(
            _gcd(block, self.superblock))
        source = perm.view(-1, block)[:, 0] // block  # source block of each destination block

        def move(x: torch.Tensor | None, width: int) -> torch.Tensor | None:
            if x is None:
                return None
            per = block // width  # columns of x per block
            cols = (source[:, None] * per + torch.arange(per)[None, :]).reshape(-1)
            return x.index_select(1, cols.to(x.device))

        code_width = 2 if t.bits == 4 else 1  # K-elements per qweight column
        return QuantTensor(move(t.qweight, code_width), move(t.d, t.superblock),
                           move(t.sc, t.group), move(t.dmin, t.superblock), move(t.m, t.group))

    def _narrow_superblock(self, superblock: int) -> "QuantTensor":
        rep = self.superblock // superblock
        return QuantTensor(self.qweight, self.d.repeat_interleave(rep, dim=1), self.sc,
                           None if self.dmin is None else self.dmin.repeat_interleave(rep, dim=1),
                           self.m)

    # -------------------------------------------------------------- checks

    def _check(self) -> None:
        q = self.qweight
        if q is None or self.d is None or self.sc is None:
            raise ValueError("a QuantTensor needs qweight, d and sc")
        if q.dim() != 2 or q.dtype not in (torch.uint8, torch.int8):
            raise ValueError(f"qweight must be uint8 (4-bit) or int8 (8-bit) [N, *], "
                             f"got {q.dtype} {tuple(q.shape)}")
        n, k = self.out_features, self.in_features
        if self.sc.dtype != torch.int8 or self.sc.dim() != 2 or self.sc.shape[0] != n \
                or self.sc.shape[1] == 0 or k % self.sc.shape[1]:
            raise ValueError(f"sc must be int8 [{n}, K/G], got {self.sc.dtype} "
                             f"{tuple(self.sc.shape)} for K={k}")
        if self.d.dtype not in SCALE_DTYPES or self.d.dim() != 2 or self.d.shape[0] != n \
                or self.d.shape[1] == 0 or k % self.d.shape[1] \
                or self.superblock % self.group:
            raise ValueError(f"d must be fp16/fp32 [{n}, K/S] with S a multiple of G, got "
                             f"{self.d.dtype} {tuple(self.d.shape)} for K={k}, G={self.group}")
        if (self.dmin is None) != (self.m is None):
            raise ValueError("dmin and m come together (asymmetric) or not at all")
        if self.dmin is not None:
            if self.dmin.shape != self.d.shape or self.dmin.dtype not in SCALE_DTYPES:
                raise ValueError("dmin must have d's shape")
            if self.m.shape != self.sc.shape or self.m.dtype != torch.int8:
                raise ValueError("m must be int8 with sc's shape")


def is_quant_prefix(tensors: dict, prefix: str) -> bool:
    return f"{prefix}.qweight" in tensors


def quant_prefixes(names) -> list[str]:
    return sorted(n.removesuffix(".qweight") for n in names if n.endswith(".qweight"))


def _block_of(perm: torch.Tensor, width: int) -> int:
    """The largest power-of-two block size b such that perm moves aligned
    blocks of b contiguous columns as wholes."""
    perm = perm.to(torch.int64).cpu()
    if sorted(perm.tolist()) != list(range(width)):
        raise ValueError("not a permutation of the columns")
    block = width & -width  # largest power of two dividing width
    while block > 1:
        view = perm.view(-1, block)
        if bool((view[:, 0] % block == 0).all()) and \
                bool((view - view[:, :1] == torch.arange(block)).all()):
            return block
        block //= 2
    return 1


def _gcd(a: int, b: int) -> int:
    import math
    return math.gcd(a, b)
