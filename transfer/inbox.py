"""The decode side of transfers over the process group: one receiver thread
per prefill rank reads headers and payloads in the order they were sent and
writes them into the pages and slots the router registered for the transfer.

A registration is made (and acknowledged) before the prefill starts, so a
header never names a transfer that is not known yet; one that is not known
any more was cancelled, and its payloads are received and dropped, keeping
the pair's stream in step. Cancelling takes the lock the writes take: once
`cancel` returns, nothing of that transfer is written any more, and the
router may give its pages to another request. A receive that fails (the
prefill process died) fails every open transfer from that rank.

A receiver only posts a receive while a transfer from its rank is open, so an
idle NCCL pair does not hold a receive kernel on the GPU."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from transfer.group import TransferGroup
from transfer.pages import StoreBuffers
from transfer.protocol import (ABORT, END, HEADER_LEN, LIVE, PAGES, SLOT, TransferError,
                               parse_header)


@dataclass
class Incoming:
    """One registered transfer, as the decode worker's RPC waits on it."""

    request_id: str
    transfer_id: int
    source: int  # prefill rank
    dest_pages: tuple[int, ...]
    dest_state_slot: int = -1
    dest_snapshot_slot: int = -1
    cancelled: bool = False
    pages: int = 0
    bytes: int = 0
    started: float = field(default_factory=time.perf_counter)
    first_byte: float | None = None
    finished: float | None = None
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)


class Inbox:
    def __init__(self, group: TransferGroup, local: StoreBuffers, sources: range) -> None:
        self.group, self.local = group, local
        self._lock = threading.Condition()
        self._by_id: dict[int, Incoming] = {}
        self._broken: dict[int, str] = {}
        self._threads = [threading.Thread(target=self._receive_loop, args=(src,), daemon=True,
                                          name=f"transfer-from-{src}") for src in sources]
        self._stopping = False

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def register(self, request_id: str, transfer_id: int, source: int, dest_pages,
                 dest_state_slot: int = -1, dest_snapshot_slot: int = -1) -> Incoming:
        incoming = Incoming(request_id, transfer_id, source, tuple(dest_pages), dest_state_slot,
                            dest_snapshot_slot)
        with self._lock:
            if source in self._broken:
                raise TransferError(f"the link from prefill rank {source} is broken: "
                                    f"{self._broken[source]}")
            if transfer_id in self._by_id:
                raise TransferError(f"transfer {transfer_id} is already registered")
            self._by_id[transfer_id] = incoming
            self._lock.notify_all()
        return incoming

    def cancel(self, request_id: str) -> bool:
        """Stop writing for the request's transfer; returns once no write of it
        runs (the caller may then reuse its pages). The entry stays until the
        prefill side's END or ABORT, so its remaining messages are drained."""
        found = False
        with self._lock:
            for incoming in self._by_id.values():
                if incoming.request_id == request_id and not incoming.cancelled:
                    incoming.cancelled = True
                    incoming.error = incoming.error or "cancelled"
                    incoming.done.set()
                    found = True
        return found

    def open_transfers(self) -> int:
        with self._lock:
            return sum(1 for i in self._by_id.values() if not i.cancelled)

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify_all()

    # ------------------------------------------------------------ receiving

    def _receive_loop(self, src: int) -> None:
        try:
            while self._wait_for_open(src):
                self._receive_one(src)
        except BaseException as e:  # the prefill rank is gone: fail what waits on it
            with self._lock:
                self._broken[src] = repr(e)
                for tid, incoming in list(self._by_id.items()):
                    if incoming.source == src:
                        incoming.error = f"receiving from prefill rank {src} failed: {e!r}"
                        incoming.done.set()
                        del self._by_id[tid]

    def _wait_for_open(self, src: int) -> bool:
        with self._lock:
            while not self._stopping and not any(i.source == src for i in self._by_id.values()):
                self._lock.wait(1.0)
            return not self._stopping

    def _receive_one(self, src: int) -> None:
        head = torch.empty(HEADER_LEN, dtype=torch.int64, device=self._wire_device)
        self.group.recv(head, src)
        tid, kind, first, count, role = parse_header(head.cpu())
        if kind == PAGES:
            if not 0 <= role < len(self.local.kv):
                raise TransferError(f"rank {src} sent pages of KV pool {role}; this store has "
                                    f"{len(self.local.kv)}")
            layer = self.local.kv[role]
            payload = self._recv_layers(src, [layer], count)
            self._write(tid, payload,
                        lambda inc: self._write_pages(inc, layer, first, count, payload[0]))
        elif kind == SLOT:
            payload = self._recv_layers(src, self.local.state, 1)
            self._write(tid, payload, lambda inc: self._write_slot(inc, role, payload))
        elif kind in (END, ABORT):
            with self._lock:
                incoming = self._by_id.pop(tid, None)
                if incoming is not None and not incoming.cancelled:
                    if kind == ABORT:
                        incoming.error = "the prefill worker stopped before the transfer finished"
                    incoming.finished = time.perf_counter()
                    incoming.done.set()
        else:
            raise TransferError(f"unknown message kind {kind} from rank {src}")

    @property
    def _wire_device(self) -> torch.device:
        return self.local.device if self.group.backend == "nccl" else torch.device("cpu")

    def _recv_layers(self, src: int, layers, rows: int) -> list[torch.Tensor]:
        out = []
        for layer in layers:
            t = torch.empty(rows * layer.row_bytes, dtype=torch.uint8, device=self._wire_device)
            self.group.recv(t, src)
            out.append(t)
        return out

    def _write(self, tid: int, payload, write) -> None:
        with self._lock:  # a cancel waits for a write in progress, and none starts after it
            incoming = self._by_id.get(tid)
            if incoming is None or incoming.cancelled:
                return
            if incoming.first_byte is None:
                incoming.first_byte = time.perf_counter()
            try:
                write(incoming)
                if self.local.device.type == "cuda":
                    torch.cuda.current_stream().synchronize()
            except Exception as e:  # this transfer is bad, the link is fine: drop the rest
                incoming.error = f"writing transfer {tid} failed: {e}"
                incoming.cancelled = True
                incoming.done.set()
                return
            incoming.bytes += sum(p.numel() for p in payload)

    def _write_pages(self, incoming: Incoming, layer, first: int, count: int, data) -> None:
        if first + count > len(incoming.dest_pages):
            raise TransferError(f"transfer {incoming.transfer_id}: pages {first}..{first + count} "
                                f"beyond the {len(incoming.dest_pages)} registered")
        rows = self.local.rows(incoming.dest_pages[first:first + count])
        layer.scatter(rows, data.to(self.local.device))
        if layer is self.local.kv[0]:  # count pages once, not once per layer
            incoming.pages += count

    def _write_slot(self, incoming: Incoming, role: int, payload) -> None:
        slot = incoming.dest_state_slot if role == LIVE else incoming.dest_snapshot_slot
        if slot < 0:
            raise TransferError(f"transfer {incoming.transfer_id}: no destination for state "
                                f"role {role}")
        rows = self.local.rows([slot])
        for layer, data in zip(self.local.state, payload):
            layer.scatter(rows, data.to(self.local.device))
