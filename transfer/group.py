"""The torch.distributed process group over every transfer endpoint of one
`tandem serve --topology disaggregated`.

Ranks: prefill worker i is rank i, decode worker j is rank N + j (N prefill
workers); world size N + M. Rank 0 hosts the rendezvous (a TCPStore) on
`addr` (127.0.0.1:PORT on one host). The backend is gloo for CPU stores and
NCCL for CUDA stores (`TANDEM_TRANSFER_BACKEND` overrides). The group is
joined in a background thread, because the supervisor starts workers one by
one and every rank must join before any can continue; `ready` is set once
joined, `error` holds why it failed.

Only point-to-point send/recv is used. gloo matches messages per (pair, tag)
in order; NCCL keeps one communicator per pair, also in order: each pair's
messages are sent by one thread and received by one thread, so sizes always
line up."""
from __future__ import annotations

import asyncio
import os
import threading
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

BACKEND_ENV = "TANDEM_TRANSFER_BACKEND"
TAG = 7  # gloo tag of every transfer message (NCCL ignores tags)


@dataclass(frozen=True)
class GroupConfig:
    """Where this endpoint sits in the group; validated on creation."""

    rank: int
    world_size: int
    addr: str  # host:port of rank 0's rendezvous
    num_prefill: int  # ranks 0..num_prefill-1 are prefill workers
    timeout_s: float = 24 * 3600.0  # idle receives wait this long; a dead peer fails at once

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"transfer rank {self.rank} outside [0, {self.world_size})")
        if not 1 <= self.num_prefill < self.world_size:
            raise ValueError("a transfer group needs at least one prefill and one decode rank")
        host, sep, port = self.addr.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"transfer address {self.addr!r} must be HOST:PORT")

    @property
    def is_prefill(self) -> bool:
        return self.rank < self.num_prefill

    def decode_rank(self, index: int) -> int:
        if not 0 <= index < self.world_size - self.num_prefill:
            raise ValueError(f"no decode worker {index}")
        return self.num_prefill + index

    def rank_of_prefill(self, index: int) -> int:
        if not 0 <= index < self.num_prefill:
            raise ValueError(f"no prefill worker {index}")
        return index


def backend_for(device: torch.device) -> str:
    chosen = os.environ.get(BACKEND_ENV, "").strip()
    if chosen:
        return chosen
    return "nccl" if device.type == "cuda" else "gloo"


class TransferGroup:
    def __init__(self, config: GroupConfig, device: torch.device) -> None:
        self.config = config
        self.device = torch.device(device)
        self.backend = backend_for(self.device)
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._join, daemon=True, name="transfer-group")

    def start(self) -> None:
        self._thread.start()

    def _join(self) -> None:
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            dist.init_process_group(
                self.backend, init_method=f"tcp://{self.config.addr}", rank=self.config.rank,
                world_size=self.config.world_size, timeout=timedelta(seconds=self.config.timeout_s))
        except BaseException as e:  # reported through `error` and the health status
            self.error = e
        finally:
            self.ready.set()

    @classmethod
    def joining(cls, config: "GroupConfig", device: torch.device) -> "TransferGroup":
        """A group whose join has started in the background."""
        group = cls(config, device)
        group.start()
        return group

    def describe(self) -> str:
        return (f"transfer rank {self.config.rank} of {self.config.world_size} "
                f"({self.backend}) via {self.config.addr}")

    async def joined_async(self, timeout: float = 900.0) -> None:
        """Waits for the join without blocking the worker's event loop."""
        await asyncio.to_thread(self.wait_ready, timeout)

    def wait_ready(self, timeout: float) -> None:
        if not self.ready.wait(timeout):
            raise TimeoutError(f"transfer group not joined after {timeout:.0f} s")
        if self.error is not None:
            raise RuntimeError(f"transfer group failed to form: {self.error}")

    @property
    def joined(self) -> bool:
        return self.ready.is_set() and self.error is None

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        if self.backend == "gloo":
            dist.send(tensor, dst, tag=TAG)
        else:
            dist.send(tensor, dst)

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        if self.backend == "gloo":
            dist.recv(tensor, src, tag=TAG)
        else:
            dist.recv(tensor, src)

    def close(self) -> None:
        if self.joined and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a peer already gone: nothing left to tidy
                pass
