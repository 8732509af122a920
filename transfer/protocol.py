"""What one transfer is, and the header every group message starts with.

A transfer (one request's prompt, prefill store -> decode store) is a series
of messages from one prefill rank to one decode rank, each a header followed
by payloads:

    PAGES  first, count,  one uint8 tensor: `count` pages of KV pool `layer`
           layer          (the store's kv layer order), which land in
                          dest_pages[first : first + count] of that layer
    SLOT   role           one uint8 tensor per GDN layer: a state slot, which
                          lands in the live (role 0) or snapshot (role 1) slot
    END                   everything arrived
    ABORT                 the prefill stopped; nothing more comes

Pages go layer by layer, each as soon as that layer's write of a chunk made
them final, so a layer travels while the following layers compute. The
header names the transfer, so the decode side needs no agreement on
order beyond "each pair's messages arrive in the order sent"."""
from __future__ import annotations

from dataclasses import dataclass

import torch

HEADER_LEN = 6
PAGES, SLOT, END, ABORT = 1, 2, 3, 4
LIVE, SNAPSHOT = 0, 1


class TransferError(Exception):
    """A transfer could not be completed (peer gone, group broken, timeout)."""


@dataclass(frozen=True)
class TransferSpec:
    """Where one request's prompt goes, as the router planned it."""

    transfer_id: int
    decode_worker: int  # index among the decode workers
    first_page: int  # index into the request's page table of the first page to send
    dest_pages: tuple[int, ...]  # decode store page ids for page indices first_page..
    dest_state_slot: int = -1  # the decode store's live GDN slot (-1: dense model)
    snapshot_slot: int = -1  # a prefill store slot to send as the prompt-end snapshot
    dest_snapshot_slot: int = -1

    def __post_init__(self) -> None:
        if self.transfer_id <= 0 or self.decode_worker < 0 or self.first_page < 0:
            raise ValueError("transfer id must be > 0, decode worker and first page >= 0")
        if (self.snapshot_slot < 0) != (self.dest_snapshot_slot < 0):
            raise ValueError("a snapshot transfer names both its source and destination slot")


def header(transfer_id: int, kind: int, first: int = 0, count: int = 0,
           role: int = 0) -> torch.Tensor:
    return torch.tensor([transfer_id, kind, first, count, role, 0], dtype=torch.int64)


def parse_header(t: torch.Tensor) -> tuple[int, int, int, int, int]:
    tid, kind, first, count, role, _ = (int(v) for v in t.tolist())
    return tid, kind, first, count, role
