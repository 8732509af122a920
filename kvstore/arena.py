"""Arenas: one contiguous byte buffer holding many named tensors, made once by
the KV store process and mapped by its workers.

Owns byte layouts (name, dtype, shape and a 256-byte aligned offset per
tensor), creating the memory (a file under /dev/shm on the CPU, one CUDA
allocation on a GPU), exporting it as a handle and mapping a handle in another
process. Must not know what the tensors mean (weights, KV pages, GDN state)
nor how a handle travels between processes (the RPC carries it).

Mapping never falls back to a copy: a handle that cannot be mapped, or memory
that does not hold the arena's canary, raises ArenaMapError naming the cause.
"""
from __future__ import annotations

import os
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.errors import TandemError

ALIGNMENT = 256  # bytes; enough for any dtype and for coalesced GPU loads
CANARY_BYTES = 16
# The first ALIGNMENT bytes of every arena hold a random canary written by the
# creator: a worker that maps the handle checks it, so a mapping that silently
# points at other memory (or at a fresh, zeroed file) is caught at attach time.
HEADER_BYTES = ALIGNMENT
SHM_DIR = Path("/dev/shm")
# Store ids are "tandem-<creator pid>-<random hex>": the pid lets a later store
# recognise files whose creator died without unlinking them (SIGKILL, OOM kill).
STORE_ID_PREFIX = "tandem-"


class ArenaMapError(TandemError):
    """An arena handle could not be mapped in this process (never copied instead)."""


def _align(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in an arena layout")
    return dtype


# ------------------------------------------------------------------ layouts


@dataclass(frozen=True)
class TensorSpec:
    """Where one named tensor lives in an arena."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # bytes from the arena's start; a multiple of ALIGNMENT

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n

    def to_dict(self) -> dict:
        return {"name": self.name, "dtype": dtype_name(self.dtype), "shape": list(self.shape),
                "offset": self.offset}

    @classmethod
    def from_dict(cls, d: dict) -> "TensorSpec":
        return cls(d["name"], dtype_from_name(d["dtype"]), tuple(int(s) for s in d["shape"]),
                   int(d["offset"]))


@dataclass(frozen=True)
class Layout:
    """The named tensors of one arena, in order, and the arena's total size."""

    tensors: tuple[TensorSpec, ...]
    total_bytes: int

    def __post_init__(self) -> None:
        self._check()

    @classmethod
    def pack(cls, entries: Iterable[tuple[str, torch.dtype, tuple[int, ...]]]) -> "Layout":
        """Lay (name, dtype, shape) entries out one after another, each aligned."""
        specs, offset = [], HEADER_BYTES
        for name, dtype, shape in entries:
            spec = TensorSpec(name, dtype, tuple(int(s) for s in shape), offset)
            specs.append(spec)
            offset = _align(offset + spec.nbytes)
        return cls(tuple(specs), offset)

    def __getitem__(self, name: str) -> TensorSpec:
        for spec in self.tensors:
            if spec.name == name:
                return spec
        raise KeyError(f"no tensor {name!r} in this arena layout")

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.tensors]

    def to_dict(self) -> dict:
        return {"tensors": [s.to_dict() for s in self.tensors], "total_bytes": self.total_bytes}

    @classmethod
    def from_dict(cls, d: dict) -> "Layout":
        return cls(tuple(TensorSpec.from_dict(t) for t in d["tensors"]), int(d["total_bytes"]))

    def _check(self) -> None:
        """A layout from another process is checked before any byte is mapped."""
        names, end = set(), HEADER_BYTES
        for spec in self.tensors:
            if spec.name in names:
                raise ValueError(f"arena layout lists {spec.name!r} twice")
            names.add(spec.name)
            if spec.offset % ALIGNMENT or spec.offset < end or any(d < 0 for d in spec.shape):
                raise ValueError(f"arena layout: {spec.name!r} at offset {spec.offset} overlaps "
                                 "or is misaligned")
            end = spec.offset + spec.nbytes
        if self.total_bytes < end:
            raise ValueError(f"arena layout needs {end} bytes but declares {self.total_bytes}")


# ------------------------------------------------------------------ handles


@dataclass(frozen=True)
class CudaIpcHandle:
    """torch's CUDA IPC description of one storage (UntypedStorage._share_cuda_())."""

    device: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


@dataclass(frozen=True)
class ArenaHandle:
    """All another process needs to map an arena: exactly one of shm_path/cuda."""

    layout: Layout
    canary: bytes
    shm_path: str | None = None
    cuda: CudaIpcHandle | None = None

    def __post_init__(self) -> None:
        if (self.shm_path is None) == (self.cuda is None):
            raise ValueError("an arena handle names exactly one of a shm file or a CUDA IPC handle")


# ------------------------------------------------------------------- arenas


class Arena:
    """One byte buffer and the named tensor views into it."""

    def __init__(self, name: str, handle: ArenaHandle, buffer: torch.Tensor, owner: bool):
        self.name = name
        self.handle = handle
        self.layout = handle.layout
        self.buffer = buffer  # uint8 [total_bytes]
        self._owner = owner

    @classmethod
    def create(cls, name: str, layout: Layout, device: torch.device | str,
               store_id: str) -> "Arena":
        """Allocate a zeroed arena for `layout` on `device` and export it."""
        device = torch.device(device)
        canary = secrets.token_bytes(CANARY_BYTES)
        if device.type == "cuda":
            buffer = torch.zeros(layout.total_bytes, dtype=torch.uint8, device=device)
        elif device.type == "cpu":
            path = SHM_DIR / f"{store_id}-{name}"
            buffer = _create_shm(layout, path)
        else:
            raise ValueError(f"arenas live on cpu or cuda, not {device}")
        buffer[:CANARY_BYTES] = torch.frombuffer(bytearray(canary), dtype=torch.uint8).to(device)
        if device.type == "cuda":
            handle = ArenaHandle(layout, canary, cuda=_export_cuda(buffer))
        else:
            handle = ArenaHandle(layout, canary, shm_path=str(path))
        return cls(name, handle, buffer, owner=True)

    @classmethod
    def open(cls, name: str, handle: ArenaHandle, owner_pid: int | None = None) -> "Arena":
        """Map an arena another process created; raises ArenaMapError if it cannot."""
        if handle.cuda is not None:
            buffer = _open_cuda(handle, owner_pid)
        else:
            buffer = _open_shm(handle)
        _check_canary(name, handle, buffer, owner_pid)
        return cls(name, handle, buffer, owner=False)

    def tensor(self, name: str) -> torch.Tensor:
        """A view (never a copy) of one named tensor."""
        spec = self.layout[name]
        raw = self.buffer[spec.offset:spec.offset + spec.nbytes]
        return raw.view(spec.dtype).view(spec.shape)

    def tensors(self, prefix: str = "") -> dict[str, torch.Tensor]:
        return {n: self.tensor(n) for n in self.layout.names if n.startswith(prefix)}

    def contains(self, t: torch.Tensor) -> bool:
        """Whether `t`'s memory lies inside this arena (zero-copy checks)."""
        base = self.buffer.data_ptr()
        return t.device == self.buffer.device and base <= t.data_ptr() < base + self.layout.total_bytes

    def close(self) -> None:
        """The creator unlinks its shm file (idempotent); mappings stay valid until dropped."""
        if self._owner and self.handle.shm_path:
            try:
                os.unlink(self.handle.shm_path)
            except FileNotFoundError:
                pass
        self._owner = False


# --------------------------------------------------------------------- shm


def new_store_id(pid: int | None = None) -> str:
    """A store id that names its creator's pid (see sweep_orphaned_shm)."""
    return f"{STORE_ID_PREFIX}{os.getpid() if pid is None else pid}-{secrets.token_hex(4)}"


def sweep_orphaned_shm(shm_dir: Path = SHM_DIR) -> list[Path]:
    """Unlink arena files whose creating store process no longer exists.

    A store unlinks its files on a clean exit; one killed by SIGKILL or the OOM
    killer cannot, and its tmpfs pages would stay committed until reboot. Only
    files of this user are touched, and only when their pid is not alive in this
    pid namespace (a store in another namespace sharing /dev/shm would look dead:
    run one store per shared /dev/shm, as compose.yaml does).
    """
    removed = []
    for path in shm_dir.glob(f"{STORE_ID_PREFIX}*"):
        pid = _creator_pid(path.name)
        if pid is None or _pid_alive(pid):
            continue
        try:
            if path.stat().st_uid != os.getuid():
                continue
            path.unlink()
        except (FileNotFoundError, PermissionError):
            continue
        removed.append(path)
    return removed


def _creator_pid(file_name: str) -> int | None:
    parts = file_name[len(STORE_ID_PREFIX):].split("-", 2)
    if len(parts) < 3 or not parts[0].isdigit():
        return None
    return int(parts[0])


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _create_shm(layout: Layout, path: Path) -> torch.Tensor:
    # O_EXCL: two stores never share a file by accident. posix_fallocate makes
    # tmpfs commit the pages now, so a full /dev/shm fails here at start-up
    # instead of as a SIGBUS in a worker halfway through a forward.
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, layout.total_bytes)
    except OSError as e:
        os.close(fd)
        os.unlink(path)
        raise ArenaMapError(f"cannot reserve {layout.total_bytes} bytes in {path.parent} "
                            f"({e}); free space there or lower the capacity plan") from e
    os.close(fd)
    return torch.from_file(str(path), shared=True, size=layout.total_bytes, dtype=torch.uint8)


def _open_shm(handle: ArenaHandle) -> torch.Tensor:
    path = handle.shm_path
    # torch.from_file(shared=True) would create a missing file: check first, so
    # a worker never runs on fresh zeroed memory instead of the store's.
    try:
        size = os.stat(path).st_size
    except FileNotFoundError as e:
        raise ArenaMapError(f"shared memory file {path} does not exist: the store has exited, or "
                            "this process does not share its /dev/shm (IPC namespace)") from e
    if size != handle.layout.total_bytes:
        raise ArenaMapError(f"shared memory file {path} has {size} bytes, the layout says "
                            f"{handle.layout.total_bytes}: it belongs to another store")
    return torch.from_file(path, shared=True, size=size, dtype=torch.uint8)


# -------------------------------------------------------------------- cuda


def _export_cuda(buffer: torch.Tensor) -> CudaIpcHandle:
    # The same tuple torch.multiprocessing sends (reductions.reduce_tensor).
    (dev, handle, size, offset, ref_handle, ref_offset, event_handle,
     event_sync) = buffer.untyped_storage()._share_cuda_()
    return CudaIpcHandle(int(dev), bytes(handle), int(size), int(offset), bytes(ref_handle),
                         int(ref_offset), bytes(event_handle or b""), bool(event_sync))


def _open_cuda(handle: ArenaHandle, owner_pid: int | None) -> torch.Tensor:
    h = handle.cuda
    try:
        torch.cuda._lazy_init()
        storage = torch.UntypedStorage._new_shared_cuda(
            h.device, h.handle, h.storage_size_bytes, h.storage_offset_bytes,
            h.ref_counter_handle, h.ref_counter_offset, h.event_handle,
            h.event_sync_required)
    except Exception as e:  # torch raises RuntimeError from cudaIpcOpenMemHandle
        raise ArenaMapError(
            f"cannot map the KV store's CUDA memory (store pid {owner_pid}, device {h.device}): "
            f"{e}. CUDA IPC needs the store and this worker on the same host, in the same PID "
            "and IPC namespaces (compose: `pid:` and `ipc:` shared), with the same GPU "
            "visible; tandem never falls back to copying") from e
    if storage.nbytes() < handle.layout.total_bytes:
        raise ArenaMapError(f"the store's CUDA allocation has {storage.nbytes()} bytes, the "
                            f"layout needs {handle.layout.total_bytes}")
    buffer = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return buffer.set_(storage, 0, (handle.layout.total_bytes,), (1,))


def _check_canary(name: str, handle: ArenaHandle, buffer: torch.Tensor,
                  owner_pid: int | None) -> None:
    found = bytes(buffer[:CANARY_BYTES].cpu().tolist())
    if found != handle.canary:
        where = handle.shm_path or f"CUDA device {handle.cuda.device}"
        raise ArenaMapError(
            f"the {name} arena mapped from {where} does not hold the store's canary (store pid "
            f"{owner_pid}): this process sees different memory than the store; check that both "
            "share PID and IPC namespaces and the same device")
