"""The unit of work of one forward: a batch of sequences, each running some new
tokens on top of what its pages and state slot already hold.

This is the paged interface that the KV store and the workers build on: a
sequence is named by its page table (full-attention KV) and its state slot
(GDN recurrent state and conv window), never by a cache object of its own.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from engine.errors import InvalidRequestError
from engine.kv.attention import AttentionMetadata
from engine.uploads import upload


@dataclass(frozen=True)
class SequenceInput:
    """One sequence's share of a forward.

    tokens:      the new token ids to run, in order.
    start:       how many tokens of this sequence the cache already holds; the
                 first new token sits at position `start`.
    page_table:  page ids covering positions [0, start + len(tokens)).
    state_slot:  the GDN state slot (hybrid models); it holds the state after
                 `start` tokens and is updated in place. -1 for dense models.
    position_slots: empty, or one GDN slot per new token (speculative verify):
                 the state after new token j is written to position_slots[j]
                 (state_slot is only read, unless it is one of them), so the
                 caller can pick the state of whichever prefix it accepts
                 without running anything again.
    snapshot:    None, or (position, slot): also leave the GDN state and conv
                 window after `position` tokens (start < position < end) in
                 `slot`, for the prefix cache. It lets a prefill run a prompt's
                 last partial page in the same forward as the rest, where it
                 was a second forward of 1..16 tokens that read every weight
                 and the whole context's KV again (~40 ms of a 27B agent turn).
    """

    tokens: tuple[int, ...]
    start: int
    page_table: tuple[int, ...]
    state_slot: int = -1
    position_slots: tuple[int, ...] = ()
    snapshot: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if not self.tokens:
            raise InvalidRequestError("a sequence in a forward needs at least one new token")
        if self.start < 0:
            raise InvalidRequestError(f"start must be >= 0, got {self.start}")
        if self.position_slots and len(self.position_slots) != len(self.tokens):
            raise InvalidRequestError(f"{len(self.position_slots)} position slots for "
                                      f"{len(self.tokens)} new tokens: give one per token")
        if self.snapshot is not None:
            position, slot = self.snapshot
            if not self.start < position < self.end or slot < 0 or self.state_slot < 0:
                raise InvalidRequestError(
                    f"a snapshot at {position} tokens into slot {slot} must lie inside the "
                    f"forward's ({self.start}, {self.end}) of a sequence with a state slot")
            if self.position_slots:
                raise InvalidRequestError("a sequence keeps every state or takes one snapshot, "
                                          "not both")

    def split_at_snapshot(self) -> "tuple[SequenceInput, SequenceInput]":
        """The tokens up to the snapshot and those after it, as two sequences
        of the same slot and pages."""
        position, _ = self.snapshot
        cut = position - self.start
        return (SequenceInput(self.tokens[:cut], self.start, self.page_table, self.state_slot),
                SequenceInput(self.tokens[cut:], position, self.page_table, self.state_slot))

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclass
class GdnSlots:
    """The GDN slots of a forward as device tensors (the fused steps take only these).

    read:  [B] long, the slot holding each sequence's input state; -1 marks a
           padding copy of another sequence that no kernel computes;
    write: [T] long, the slot that takes the state after each new token, -1 for
           none: every token's position slot for a verify row, else the
           sequence's own slot after its last token;
    rows:  None, or [T] long: the GDN output of row r is that of row rows[r]
           (padding copies take their original's rows, so they write the same K/V).
    """

    read: torch.Tensor
    write: torch.Tensor
    rows: torch.Tensor | None = None


@dataclass
class SnapshotSplit:
    """A forward whose sequences leave a GDN snapshot inside it, as the GDN
    layers run it: the rows up to each snapshot (`before`, with the whole of
    every sequence that takes none), then the snapshots copied out of the
    state slots, then the rows after them (`after`). Everything else in the
    layer (projections, attention, MLP) runs over all rows at once.

    rows_before / rows_after: the forward's rows of each part, a slice when
    they are one range (a single sequence), else a [rows] long index."""

    before: "ForwardBatch"
    after: "ForwardBatch"
    rows_before: slice | torch.Tensor
    rows_after: slice | torch.Tensor
    from_slots: torch.Tensor  # [S] long: the sequences' state slots ...
    to_slots: torch.Tensor  # [S] long: ... copied into their snapshot slots

    def take_snapshots(self, *slot_tensors: torch.Tensor) -> None:
        """Copy each state slot's rows into its snapshot slot (one layer's
        recurrent state and conv window)."""
        for t in slot_tensors:
            t.index_copy_(0, self.to_slots, t.index_select(0, self.from_slots))


def _rows(ranges: list[tuple[int, int]], device) -> slice | torch.Tensor:
    if len(ranges) == 1:
        return slice(*ranges[0])
    return upload([r for lo, hi in ranges for r in range(lo, hi)], torch.long, device)


# fla-core's chunk_gated_delta_rule works in chunks of this many rows (its default)
GDN_CHUNK_ROWS = 64


@dataclass(frozen=True)
class VarlenIndex:
    """Ragged sequences packed along T, as fla-core's varlen kernels take
    them: cu_seqlens [B+1] long on the device and on the host, and
    chunk_indices [N, 2] long, (sequence, chunk within it) for each of the
    N chunks of GDN_CHUNK_ROWS rows, computed on the host."""

    cu_seqlens: torch.Tensor
    host_cu_seqlens: torch.Tensor
    chunk_indices: torch.Tensor

    @classmethod
    def build(cls, offsets: list[int], device: torch.device | str) -> "VarlenIndex":
        host = torch.tensor(offsets, dtype=torch.long)
        chunks = [(seq, c) for seq, (lo, hi) in enumerate(zip(offsets, offsets[1:]))
                  for c in range(-(-(hi - lo) // GDN_CHUNK_ROWS))]
        chunk_indices = torch.tensor(chunks, dtype=torch.long).reshape(-1, 2)
        return cls(upload(host, torch.long, device), host, upload(chunk_indices, torch.long, device))


@dataclass
class ForwardBatch:
    """Flattened tensors for a list of SequenceInput, built once per forward."""

    seqs: list[SequenceInput]
    page_size: int
    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    kv_slots: torch.Tensor  # [T] long: page * page_size + offset, where each new token's KV goes
    page_tables: list[torch.Tensor] = field(default_factory=list)  # per sequence, [n_pages] long
    state_slots: torch.Tensor | None = None  # [B] long
    offsets: list[int] = field(default_factory=list)  # seq i's tokens are [offsets[i], offsets[i+1])
    _attention: AttentionMetadata | None = field(default=None, repr=False)
    _gdn: GdnSlots | None = field(default=None, repr=False)
    _row_sequences: torch.Tensor | None = field(default=None, repr=False)
    _fresh: torch.Tensor | None = field(default=None, repr=False)
    _varlen: "VarlenIndex | None" = field(default=None, repr=False)
    _last_rows: torch.Tensor | None = field(default=None, repr=False)
    _snapshot_split: "SnapshotSplit | None" = field(default=None, repr=False)
    _host_page_tables: list[torch.Tensor] = field(default_factory=list, repr=False)
    # [T, H] the new tokens' embeddings, when the model looked them up before
    # the forward (a table in host memory: CausalLM.embed); None: the forward does
    input_embeds: torch.Tensor | None = None

    @classmethod
    def build(cls, seqs: list[SequenceInput], page_size: int, device: torch.device | str) -> "ForwardBatch":
        if not seqs:
            raise InvalidRequestError("a forward needs at least one sequence")
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        offsets = [0]
        for seq in seqs:
            _check_page_table(seq, page_size)
            ids.extend(seq.tokens)
            pos = range(seq.start, seq.end)
            positions.extend(pos)
            slots.extend(seq.page_table[p // page_size] * page_size + p % page_size for p in pos)
            offsets.append(len(ids))

        def longs(values) -> torch.Tensor:
            return upload(values, torch.long, device)

        # each page table made a tensor once (numpy reads a long tuple ~3x
        # faster than torch.tensor), for the device copy and the attention's
        host_tables = [torch.from_numpy(np.asarray(s.page_table, dtype=np.int64)) for s in seqs]
        return cls(
            seqs=seqs,
            page_size=page_size,
            input_ids=longs(ids),
            positions=longs(positions),
            kv_slots=longs(slots),
            page_tables=[longs(t) for t in host_tables],
            state_slots=longs([s.state_slot for s in seqs]),
            offsets=offsets,
            _host_page_tables=host_tables,
        )

    @property
    def attention(self) -> AttentionMetadata:
        """Which keys each sequence's queries see; built once, shared by all layers."""
        if self._attention is None:
            self._attention = AttentionMetadata.build(
                self.offsets, [s.end for s in self.seqs], self.page_tables, self.input_ids.device,
                host_page_tables=self._host_page_tables or [s.page_table for s in self.seqs])
        return self._attention

    @property
    def gdn(self) -> "GdnSlots":
        """Where the fused GDN steps read and write state slots; built once from
        the sequences (CUDA graphs hand in static buffers instead)."""
        if self._gdn is None:
            writes: list[int] = []
            for seq in self.seqs:
                if seq.position_slots:
                    writes.extend(seq.position_slots)
                    continue
                seq_writes = [-1] * (len(seq.tokens) - 1) + [seq.state_slot]
                if seq.snapshot is not None:
                    position, slot = seq.snapshot
                    seq_writes[position - seq.start - 1] = slot
                writes.extend(seq_writes)
            self._gdn = GdnSlots(self.state_slots,
                                 upload(writes, torch.long, self.input_ids.device))
        return self._gdn

    @property
    def row_sequences(self) -> torch.Tensor:
        """[T] int32: the sequence each row belongs to; built once, shared by all layers."""
        if self._row_sequences is None:
            counts = torch.tensor([len(s.tokens) for s in self.seqs])
            self._row_sequences = upload(torch.repeat_interleave(
                torch.arange(len(self.seqs), dtype=torch.int32), counts), torch.int32,
                self.input_ids.device)
        return self._row_sequences

    @property
    def fresh(self) -> torch.Tensor:
        """[B] bool: sequences whose first new token is at position 0 (no state yet)."""
        if self._fresh is None:
            self._fresh = upload([s.start == 0 for s in self.seqs], torch.bool,
                                 self.input_ids.device)
        return self._fresh

    @property
    def varlen(self) -> "VarlenIndex":
        """The batch's ragged layout for fla-core's chunked GDN, built once and
        handed to every GDN layer: a new device copy of the offsets per layer
        was two stream syncs a layer (the copy, and fla reading the lengths
        back to build its chunk indices)."""
        if self._varlen is None:
            self._varlen = VarlenIndex.build(self.offsets, self.input_ids.device)
        return self._varlen

    @property
    def takes_snapshots(self) -> bool:
        return any(seq.snapshot is not None for seq in self.seqs)

    @property
    def snapshot_split(self) -> SnapshotSplit:
        """The GDN layers' two passes around the snapshots (takes_snapshots);
        built once, shared by every layer."""
        if self._snapshot_split is None:
            device = self.input_ids.device
            before, after, rows_before, rows_after, froms, tos = [], [], [], [], [], []
            after_parents = []
            for i, (seq, lo, hi) in enumerate(zip(self.seqs, self.offsets, self.offsets[1:])):
                if seq.snapshot is None:
                    before.append(seq)
                    rows_before.append((lo, hi))
                    continue
                head, tail = seq.split_at_snapshot()
                before.append(head)
                after.append(tail)
                after_parents.append(i)
                rows_before.append((lo, lo + len(head.tokens)))
                rows_after.append((lo + len(head.tokens), hi))
                froms.append(seq.state_slot)
                tos.append(seq.snapshot[1])
            rows_before, rows_after = _rows(rows_before, device), _rows(rows_after, device)
            self._snapshot_split = SnapshotSplit(
                self._part(before, list(range(len(self.seqs))), rows_before),
                self._part(after, after_parents, rows_after), rows_before, rows_after,
                upload(froms, torch.long, device), upload(tos, torch.long, device))
        return self._snapshot_split

    def _part(self, seqs: list[SequenceInput], parents: list[int],
              rows: slice | torch.Tensor) -> "ForwardBatch":
        """A batch of `seqs`, parts of this batch's sequences `parents` (in
        order), over `rows` of it, from this batch's device tensors: building
        it anew uploaded each sequence's page table again (100K tokens: 6K
        pages) and took ~4 ms of host time at an agent turn's start."""
        device = self.input_ids.device
        offsets = [0]
        for seq in seqs:
            offsets.append(offsets[-1] + len(seq.tokens))
        kv_lens = [seq.end for seq in seqs]
        whole = parents == list(range(len(self.seqs)))
        index = None if whole else upload(parents, torch.long, device)
        table = self.attention.page_table
        tables = [self.page_tables[i] for i in parents]
        attention = AttentionMetadata(
            q_offsets=upload(offsets, torch.int32, device),
            kv_lens=upload(kv_lens, torch.int32, device),
            page_table=table if whole else table.index_select(0, index),
            max_new_tokens=max(len(seq.tokens) for seq in seqs), max_kv_len=max(kv_lens),
            host_offsets=offsets, host_kv_lens=kv_lens, page_tables=tables)
        return ForwardBatch(
            seqs=seqs, page_size=self.page_size, input_ids=self.input_ids[rows],
            positions=self.positions[rows], kv_slots=self.kv_slots[rows], page_tables=tables,
            state_slots=self.state_slots if whole else self.state_slots.index_select(0, index),
            offsets=offsets, _attention=attention,
            input_embeds=None if self.input_embeds is None else self.input_embeds[rows])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def is_decode(self) -> bool:
        """Every sequence runs exactly one new token."""
        return self.num_tokens == len(self.seqs)

    def host_token_ids(self) -> torch.Tensor:
        """input_ids as a CPU tensor, from the host lists (no device sync)."""
        return torch.tensor([t for seq in self.seqs for t in seq.tokens], dtype=torch.long)

    def last_token_indices(self) -> torch.Tensor:
        """[B] long: each sequence's last row; built once."""
        if self._last_rows is None:
            self._last_rows = upload([o - 1 for o in self.offsets[1:]], torch.long,
                                     self.input_ids.device)
        return self._last_rows


def _check_page_table(seq: SequenceInput, page_size: int) -> None:
    needed = -(-seq.end // page_size)
    if len(seq.page_table) < needed:
        raise InvalidRequestError(
            f"page table has {len(seq.page_table)} pages but {seq.end} tokens need {needed} "
            f"pages of {page_size}")
