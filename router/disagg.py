"""The router over the disaggregated topology: N prefill workers and M decode
workers, each with its own KV store, one request = one prefill worker + one
decode worker + one transfer between their stores.

Routing (`preference`): each store is asked for its cached prefix of the
prompt (an unlocked Match), then workers are ranked by (overloaded, longest
cached prefix, fewest requests in flight, fewest routed so far). "Overloaded"
means more than `balance_slack` requests in flight above the least loaded
worker, so a popular prefix cannot pile every request onto one worker.

One request:
  1. lock-match the prompt in the chosen prefill store (c_p cached tokens) and
     reserve pages for the rest of the prompt and its GDN slots there;
  2. lock-match it in the decode store (c_d) and reserve pages from c_d for
     the prompt and the whole output, the live/boundary/spare slots and one
     for the prompt-end snapshot (a full store: the next decode worker);
  3. register the transfer at the decode worker (dist) and run the prefill,
     which pushes pages c_d / page_size .. the last prompt page, the live
     state and the snapshot to the decode store as the chunks complete;
  4. the first token goes to the client as soon as the prefill returns;
     then wait for the transfer's last byte, cache the prompt in both stores
     and give back everything else in the prefill store;
  5. decode as in the shared topology, on the decode worker and its store.
"""
from __future__ import annotations

import asyncio
import itertools
import secrets
import time
from dataclasses import dataclass, field

import grpc

from engine.chunking import snapshot_points
from kvstore.client import StoreCapacityError, StoreClient, StoreUnavailable
from router.server import Held, Plan, Router, Running, first_token_of
from tandem.internal.v1 import workers_pb2 as wpb
from tandem.serving import WorkerUnavailable


@dataclass
class Worker:
    """One worker and its store, as the router balances them."""

    name: str  # "prefill-0", "decode-1"
    index: int
    store: StoreClient
    stub: object
    in_flight: int = 0
    assigned: int = 0


def preference(workers: list[Worker], cached: list[int], balance_slack: int) -> list[Worker]:
    """Workers, best first, for a request of which worker i caches cached[i] tokens."""
    least = min(w.in_flight for w in workers)
    return [w for _, w in sorted(
        ((w.in_flight > least + balance_slack, -cached[i], w.in_flight, w.assigned, w.index), w)
        for i, w in enumerate(workers))]


def layout_signature(info) -> tuple:
    """What must be equal between stores that trade pages: model, format, page
    size, and every KV/state buffer's dtype and per-row shape."""
    rows = tuple((t.name, str(t.dtype), t.shape[1:]) for arena in ("kv", "state")
                 for t in info.arenas[arena].layout.tensors)
    return (info.model_id, info.kv_format.describe(), info.page_size, rows)


def page_bytes(info) -> int:
    total = 0
    for t in info.arenas["kv"].layout.tensors:
        n = t.dtype.itemsize
        for d in t.shape[1:]:
            n *= d
        total += n
    return total


@dataclass
class Route:
    """What one request uses in the disaggregated topology."""

    prefill: Worker
    decode: Worker
    prefill_plan: Plan
    decode_cached: int  # tokens the decode store already held (not transferred)
    transfer_id: int
    snapshot: tuple[int, int, int] | None = None  # (tokens, prefill slot, decode slot)
    receive_call: object = None
    prefill_done: float = 0.0
    transferred_bytes: int = 0
    transferred_pages: int = 0
    released_prefill: bool = False
    counted: list = field(default_factory=list)  # workers whose in_flight we raised


class DisaggRouter(Router):
    def __init__(self, prefills: list[Worker], decodes: list[Worker], tokenizer, metrics, config,
                 method: str = "dist", transfer_timeout_s: float = 120.0,
                 balance_slack: int = 2) -> None:
        super().__init__(decodes[0].store, prefills[0].stub, decodes[0].stub, tokenizer, metrics,
                         config)
        signatures = {layout_signature(w.store.info) for w in (*prefills, *decodes)}
        if len(signatures) != 1:
            raise ValueError("the stores lay out their pages differently: every store of a "
                             "disaggregated service needs the same model, KV format and page size")
        if self.open_pages:
            # a transfer moves real pages and GDN state, not a sequence's staging pages
            raise ValueError(f"KV format {decodes[0].store.info.kv_format.name} keeps open pages "
                             "in staging, which KV transfers do not carry: run it in the shared "
                             "topology (tandem serve) or pick int8 / rk4 here")
        self.prefills, self.decodes = prefills, decodes
        self.method = method
        self.transfer_timeout_s = transfer_timeout_s
        self.balance_slack = balance_slack
        self.max_context = min(min(w.store.info.config.max_position_embeddings,
                                   w.store.info.num_pages * w.store.info.page_size)
                               for w in (*prefills, *decodes))
        self.page_bytes = page_bytes(decodes[0].store.info)
        # unique across router restarts, so a worker never mistakes an old transfer for a new one
        self._ids = itertools.count((secrets.randbits(28) << 32) + 1)

    # --- admission -------------------------------------------------------------
    async def _admit(self, req, handle: Running, held: Held, sampling, context):
        prompt = req.prompt
        reserving = time.perf_counter()
        cached_p, cached_d = await self._probe(req)
        # pick and count in one step (no await between): concurrent requests see each other
        prefill = preference(self.prefills, cached_p, self.balance_slack)[0]
        order = preference(self.decodes, cached_d, self.balance_slack)
        counted = handle.counted = [prefill, order[0]]
        for w in counted:
            w.in_flight += 1
            w.assigned += 1
        handle.prefill_stub, handle.prefill_store = prefill.stub, prefill.store
        handle.prefill_held = Held()
        prefill_plan = await self._reserve_prefill(req, prefill, handle.prefill_held)
        points = [t for t, _ in prefill_plan.snapshots]
        decode, plan, snapshot = await self._reserve_decode(req, order, handle, held, points)
        if decode is not order[0]:  # order[0] was full: count the one that took it
            for w, step in ((order[0], -1), (decode, 1)):
                w.in_flight += step
                w.assigned += step
            counted[1] = decode
        handle.decode_stub = decode.stub
        route = handle.route = Route(prefill, decode, prefill_plan, plan.cached, next(self._ids))
        route.counted = counted
        if snapshot is not None:
            slot = dict(prefill_plan.snapshots)[snapshot[0]]
            route.snapshot = (snapshot[0], slot, snapshot[1])
        for w in (prefill, decode):
            self.metrics.worker_assigned(w.name)
        self.metrics.cache_query(len(prompt), prefill_plan.cached)
        transfer = self._transfer_pb(route, plan, len(prompt))
        handle.busy_in = "transfer"
        if self.method == "dist":
            await self._register(handle.worker_id, route, transfer, context)
        self.metrics.ttft_phase("reserve", time.perf_counter() - reserving)
        with self._phase("prefill"):
            reply = await self._prefill_on(prefill, req, handle.worker_id, prefill_plan, sampling,
                                           transfer, context)
        first = first_token_of(reply, prefill.name)
        route.prefill_done = time.perf_counter()
        route.transferred_pages, route.transferred_bytes = (reply.transferred_pages,
                                                            reply.transferred_bytes)
        self._done_with(route, prefill)
        if self.method != "dist":  # peer copies are complete when the prefill returns
            handle.busy_in = None
        # usage.cached_tokens: the prompt tokens the prefill did not compute
        plan.cached = prefill_plan.cached
        return plan, first

    @staticmethod
    async def _prefill_on(prefill: Worker, req, worker_id: str, plan: Plan, sampling, transfer,
                          context):
        return await prefill.stub.Prefill(wpb.PrefillRequest(
            request_id=worker_id, tokens_le32=req.packed_prompt, start=plan.cached,
            pages=plan.pages, state_slot=plan.state_slot, restore_slot=plan.restore_slot,
            snapshots=[wpb.SnapshotPoint(tokens=t, slot=s) for t, s in plan.snapshots],
            sampling=sampling, transfer=transfer), timeout=context.time_remaining())

    async def _probe(self, req) -> tuple[list[int], list[int]]:
        """Each store's cached prefix of the prompt (nothing locked)."""
        async def one(w: Worker) -> int:
            try:
                return (await asyncio.to_thread(w.store.match, req.packed_prompt,
                                                req.cache_salt, False)).num_tokens
            except StoreUnavailable:
                return -1  # a store that does not answer ranks last on affinity
        found = await asyncio.gather(*(one(w) for w in (*self.prefills, *self.decodes)))
        n = len(self.prefills)
        return list(found[:n]), list(found[n:])

    async def _reserve_prefill(self, req, worker: Worker, held: Held) -> Plan:
        """The prompt only (its output is decoded elsewhere): pages past the
        cached prefix, the live slot and one per snapshot point."""
        prompt = req.prompt
        store = worker.store
        match = await self._acquire(held, store.match, req.packed_prompt, req.cache_salt, True)
        points = (snapshot_points(match.num_tokens, len(prompt), self.page_size,
                                  self.config.snapshot_every) if self.hybrid else [])
        slots = 1 + len(points) if self.hybrid else 0
        pages = -(-len(prompt) // self.page_size) - len(match.pages)
        try:
            grant = await self._acquire(held, store.allocate, pages, slots)
        except StoreCapacityError as e:
            raise StoreCapacityError(e.code, f"{worker.name}'s store has no room for a "
                                             f"{len(prompt)}-token prompt now: {e}") from None
        plan = Plan(cached=match.num_tokens, pages=list(match.pages) + list(grant.pages))
        if self.hybrid:
            plan.state_slot = grant.slots[0]
            plan.restore_slot = match.snapshot_slot if match.num_tokens else -1
            plan.snapshots = list(zip(points, grant.slots[1:]))
        return plan

    async def _reserve_decode(self, req, order: list[Worker], handle: Running, held: Held,
                              points: list[int]):
        """The first decode worker (in preference order) whose store has room:
        pages from its cached prefix through the whole output, its slots."""
        last_error = None
        for worker in order:
            # before its first store call: whatever `held` takes from here on
            # (also if the request is cancelled or fails meanwhile) goes back
            # to this worker's store, never to another decode store
            handle.decode_store = worker.store
            try:
                return await self._reserve_decode_on(req, worker, held, points)
            except StoreCapacityError as e:
                last_error = e
                await self._release(held, worker.store)
        raise StoreCapacityError(last_error.code, f"no decode store has room for a "
                                                  f"{len(req.prompt)}-token prompt plus "
                                                  f"{req.params.max_new_tokens} new tokens now: "
                                                  f"{last_error.details}")

    async def _reserve_decode_on(self, req, worker: Worker, held: Held, points: list[int]):
        prompt, store = req.prompt, worker.store
        match = await self._acquire(held, store.match, req.packed_prompt, req.cache_salt, True)
        # the prompt-end snapshot goes along when the decode store lacks it
        snapshot_at = points[-1] if self.hybrid and points and points[-1] > match.num_tokens else 0
        slots = (2 + self.spare_slots + (1 if snapshot_at else 0)) if self.hybrid else 0
        total_pages = -(-(len(prompt) + req.params.max_new_tokens) // self.page_size)
        grant = await self._acquire(held, store.allocate, total_pages - len(match.pages), slots)
        plan = Plan(cached=match.num_tokens, pages=list(match.pages) + list(grant.pages))
        snapshot = None
        if self.hybrid:
            plan.state_slot, plan.boundary_slot = grant.slots[0], grant.slots[1]
            plan.spare_slots = list(grant.slots[2:2 + self.spare_slots])
            if snapshot_at:
                snapshot = (snapshot_at, grant.slots[-1])
        return worker, plan, snapshot

    def _transfer_pb(self, route: Route, plan: Plan, prompt_len: int) -> wpb.KVTransfer:
        first = route.decode_cached // self.page_size
        last = -(-prompt_len // self.page_size)
        snap = route.snapshot
        return wpb.KVTransfer(transfer_id=route.transfer_id, decode_worker=route.decode.index,
                              first_page=first, dest_pages=plan.pages[first:last],
                              dest_state_slot=plan.state_slot,
                              snapshot_slot=snap[1] if snap else -1,
                              dest_snapshot_slot=snap[2] if snap else -1)

    async def _register(self, worker_id: str, route: Route, transfer: wpb.KVTransfer,
                        context) -> None:
        call = route.receive_call = route.decode.stub.Receive(wpb.ReceiveRequest(
            request_id=worker_id, transfer_id=transfer.transfer_id,
            prefill_worker=route.prefill.index, dest_pages=transfer.dest_pages,
            dest_state_slot=transfer.dest_state_slot,
            dest_snapshot_slot=transfer.dest_snapshot_slot), timeout=context.time_remaining())
        event = await call.read()
        if event is grpc.aio.EOF or not event.HasField("registered"):
            raise WorkerUnavailable(f"{route.decode.name} did not register the transfer")

    # --- after the first token ------------------------------------------------
    async def _before_decode(self, req, plan, handle: Running, held: Held, context) -> None:
        route: Route = handle.route
        if route.receive_call is not None:
            await self._await_transfer(route, context)
        handle.busy_in = None
        self.metrics.kv_transfer(route.transferred_pages, route.transferred_bytes,
                                 time.perf_counter() - route.prefill_done)
        prefill_store = route.prefill.store
        await self._cache_prompt(req, route.prefill_plan, handle.prefill_held, prefill_store)
        await self._release(handle.prefill_held, prefill_store)  # the prefill store is done
        route.released_prefill = True
        await self._cache_decode_prompt(req, plan, held, route)

    async def _await_transfer(self, route: Route, context) -> None:
        remaining = context.time_remaining()
        timeout = self.transfer_timeout_s if remaining is None else min(remaining,
                                                                        self.transfer_timeout_s)
        try:
            event = await asyncio.wait_for(route.receive_call.read(), timeout)
        except asyncio.TimeoutError:
            raise WorkerUnavailable(f"the KV transfer to {route.decode.name} did not finish "
                                    f"within {timeout:.0f} s") from None
        except grpc.aio.AioRpcError as e:
            raise WorkerUnavailable(f"the KV transfer from {route.prefill.name} to "
                                    f"{route.decode.name} failed: {e.details()}") from None
        if event is grpc.aio.EOF or not event.HasField("done"):
            raise WorkerUnavailable(f"{route.decode.name} ended the transfer early")
        route.transferred_bytes = max(route.transferred_bytes, event.done.bytes)

    async def _cache_decode_prompt(self, req, plan: Plan, held: Held, route: Route) -> None:
        """The prompt's whole pages (with the transferred snapshot) into the
        decode store's cache, so the next turn there skips the transfer too."""
        if self.hybrid:
            if route.snapshot is None:
                return
            end, slot = route.snapshot[0], route.snapshot[2]
        else:
            end, slot = len(req.prompt) // self.page_size * self.page_size, None
            if end <= route.decode_cached:
                return
        await self._insert(route.decode.store, req, end, plan, held, slot, lock=True)

    # --- giving back ------------------------------------------------------------
    def _done_with(self, route: Route, worker: Worker) -> None:
        """The worker's part of the request is over (its in-flight count drops)."""
        if worker in route.counted:
            route.counted.remove(worker)
            worker.in_flight -= 1

    async def _give_back(self, held: Held, handle: Running) -> None:
        route: Route | None = handle.route
        if route is not None and route.receive_call is not None:
            route.receive_call.cancel()
        try:
            await super()._give_back(held, handle)
        finally:
            while handle.counted:
                handle.counted.pop().in_flight -= 1

