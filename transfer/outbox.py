"""The prefill side: push a request's pages to its decode store as the
prefill produces them, layer by layer (the cache calls `layer_written` after
each KV pool write; the pages that write made final go at once, while the
following layers compute), then the rest, the live GDN state, the
prompt-end snapshot, END.

Two links carry the bytes:
  DistLink  torch.distributed send (gloo / NCCL): the prefill thread gathers
            a layer's pages into one staging tensor and queues it; one sender
            thread per decode rank sends in order, so the next chunk computes
            while the last one travels.
  PeerLink  the decode store's arenas mapped into this process (shm on the
            CPU, CUDA IPC on a GPU): pages are copied straight into the
            destination pages (a peer copy between two GPUs of one host, a
            device copy on one GPU). Nothing is queued; END means "copied".
"""
from __future__ import annotations

import queue
import threading
from abc import ABC, abstractmethod

import torch

from transfer.group import TransferGroup
from transfer.pages import StoreBuffers
from transfer.protocol import (ABORT, END, LIVE, PAGES, SLOT, SNAPSHOT, TransferError,
                               TransferSpec, header)


class Link(ABC):
    """Carries bytes from this (prefill) store to decode stores."""

    def __init__(self, local: StoreBuffers) -> None:
        self.local = local
        self.bytes_sent = 0

    @abstractmethod
    def pages(self, spec: TransferSpec, layer: int, first: int, src_pages: list[int]) -> None:
        """KV pool `layer`'s pages src_pages go to spec.dest_pages[first : first + len]."""

    @abstractmethod
    def slot(self, spec: TransferSpec, role: int, src_slot: int, dst_slot: int) -> None: ...

    @abstractmethod
    def end(self, spec: TransferSpec, aborted: bool) -> None: ...

    def close(self) -> None:
        pass


class OutgoingTransfer:
    """One request's transfer, driven by the prefill thread: `chunk_starts`
    before each chunk's forward, `layer_written` after each KV pool write
    (engine.cache.PagedKVCache.kv_written), `finish` after the last write."""

    def __init__(self, spec: TransferSpec, link: Link, page_table: tuple[int, ...],
                 page_size: int, num_tokens: int, target_layers: int | None = None) -> None:
        last = -(-num_tokens // page_size)
        if spec.first_page > last or len(spec.dest_pages) != last - spec.first_page:
            raise TransferError(f"transfer {spec.transfer_id}: {len(spec.dest_pages)} destination "
                                f"pages for page indices {spec.first_page}..{last}")
        self.spec, self.link = spec, link
        self.page_table, self.page_size, self.last_page = page_table, page_size, last
        self.num_tokens = num_tokens
        layers = len(link.local.kv)
        # pools from target_layers on are MTP layers: the pair of the prompt's last
        # position is written only after the first token is sampled
        self.target_layers = layers if target_layers is None else target_layers
        self.sent = [spec.first_page] * layers  # per pool: page indices below were pushed
        self.final = self.final_mtp = spec.first_page
        self.closed = False

    def chunk_starts(self, end: int, last: bool) -> None:
        """The coming forward writes tokens up to `end`: which pages it finishes."""
        self.final = self.last_page if last else end // self.page_size
        self.final_mtp = min(end, self.num_tokens - 1) // self.page_size

    def layer_written(self, layer: int) -> None:
        self._push(layer, self.final if layer < self.target_layers else self.final_mtp)

    def finish(self, live_slot: int) -> int:
        """After the prefill's last write: the rest, the state, END. Returns pages sent."""
        for layer in range(len(self.sent)):
            self._push(layer, self.last_page)
        if self.spec.dest_state_slot >= 0:
            self.link.slot(self.spec, LIVE, live_slot, self.spec.dest_state_slot)
        if self.spec.snapshot_slot >= 0:
            self.link.slot(self.spec, SNAPSHOT, self.spec.snapshot_slot,
                           self.spec.dest_snapshot_slot)
        self.closed = True
        self.link.end(self.spec, aborted=False)
        return self.last_page - self.spec.first_page

    def abort(self) -> None:
        """The prefill stopped: tell the decode side nothing more comes (once)."""
        if not self.closed:
            self.closed = True
            self.link.end(self.spec, aborted=True)

    def _push(self, layer: int, until: int) -> None:
        until = min(until, self.last_page)
        start = self.sent[layer]
        if until <= start:
            return
        self.link.pages(self.spec, layer, start - self.spec.first_page,
                        list(self.page_table[start:until]))
        self.sent[layer] = until


# ------------------------------------------------------------ over the group


class DistLink(Link):
    def __init__(self, local: StoreBuffers, group: TransferGroup) -> None:
        super().__init__(local)
        self.group = group
        self._queues: dict[int, queue.Queue] = {}
        self._threads: dict[int, threading.Thread] = {}
        self._failed: dict[int, BaseException] = {}
        self._lock = threading.Lock()

    def pages(self, spec, layer, first, src_pages):
        payload = [self.local.kv[layer].gather(self.local.rows(src_pages))]
        self._queue(spec, header(spec.transfer_id, PAGES, first, len(src_pages), layer), payload)

    def slot(self, spec, role, src_slot, dst_slot):
        rows = self.local.rows([src_slot])
        payload = [layer.gather(rows) for layer in self.local.state]
        self._queue(spec, header(spec.transfer_id, SLOT, role=role), payload)

    def end(self, spec, aborted):
        self._queue(spec, header(spec.transfer_id, ABORT if aborted else END), [])

    def _queue(self, spec: TransferSpec, head: torch.Tensor, payload: list[torch.Tensor]) -> None:
        dst = self.group.config.decode_rank(spec.decode_worker)
        if dst in self._failed:
            raise TransferError(f"sending to decode rank {dst} failed: {self._failed[dst]}")
        ready = None
        if self.local.device.type == "cuda":  # the gather runs on this thread's stream
            ready = torch.cuda.Event()
            ready.record()
            if self.group.backend == "nccl":
                head = head.to(self.local.device)
        self._sender(dst).put((head, payload, ready))
        self.bytes_sent += sum(p.numel() for p in payload)

    def _sender(self, dst: int) -> queue.Queue:
        with self._lock:
            if dst not in self._queues:
                self._queues[dst] = queue.Queue()
                thread = threading.Thread(target=self._send_loop, args=(dst,), daemon=True,
                                          name=f"transfer-to-{dst}")
                self._threads[dst] = thread
                thread.start()
            return self._queues[dst]

    def _send_loop(self, dst: int) -> None:
        q = self._queues[dst]
        while True:
            item = q.get()
            if item is None:
                return
            head, payload, ready = item
            try:
                if ready is not None:
                    ready.synchronize()
                self.group.send(head, dst)
                for tensor in payload:
                    if tensor.is_cuda and self.group.backend != "nccl":
                        tensor = tensor.cpu()  # gloo moves host memory only
                    self.group.send(tensor, dst)
            except BaseException as e:  # the decode side is gone; later pushes fail fast
                self._failed[dst] = e
                return

    def close(self) -> None:
        for q in self._queues.values():
            q.put(None)


# --------------------------------------------------------------- peer copies


class PeerLink(Link):
    """Copies into decode stores mapped in this process, one per decode worker."""

    def __init__(self, local: StoreBuffers, peers: list[StoreBuffers]) -> None:
        super().__init__(local)
        for i, peer in enumerate(peers):
            if peer.fingerprint() != local.fingerprint():
                raise TransferError(f"decode store {i} lays out pages differently from this "
                                    "prefill store: same model, KV format and page size needed")
        self.peers = peers

    def pages(self, spec, layer, first, src_pages):
        peer = self._peer(spec)
        src = self.local.rows(src_pages)
        dst = peer.rows(spec.dest_pages[first:first + len(src_pages)])
        peer.kv[layer].copy_rows(self.local.kv[layer], src, dst)
        self.bytes_sent += len(src_pages) * self.local.kv[layer].row_bytes

    def slot(self, spec, role, src_slot, dst_slot):
        peer = self._peer(spec)
        src, dst = self.local.rows([src_slot]), peer.rows([dst_slot])
        for mine, theirs in zip(self.local.state, peer.state):
            theirs.copy_rows(mine, src, dst)
        self.bytes_sent += self.local.slot_bytes()

    def end(self, spec, aborted):
        if self.local.device.type == "cuda":  # copied before the router hears "done"
            torch.cuda.current_stream().synchronize()

    def _peer(self, spec: TransferSpec) -> StoreBuffers:
        if not 0 <= spec.decode_worker < len(self.peers):
            raise TransferError(f"no decode store {spec.decode_worker} mapped here "
                                f"({len(self.peers)} are)")
        return self.peers[spec.decode_worker]
