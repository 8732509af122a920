"""The store's control RPC in this process: the real KVStoreService and
StoreControl over real gRPC on a unix socket, without loading a model (the
handlers only read the store's control state). What a client sees when the
store itself fails: INTERNAL with the reason, never grpc's bare UNKNOWN, and a
store that keeps serving."""
from __future__ import annotations

import tempfile
import types
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest

from kvstore.control import StoreControl
from kvstore.server import CHANNEL_OPTIONS, KVStoreService
from tandem.internal.v1 import kvstore_pb2 as pb
from tandem.internal.v1 import kvstore_pb2_grpc as pb_grpc
from tandem.wire import pack_token_ids
from tests.test_kvstore_control import DEEP, PAGE, deep_conversation


@asynccontextmanager
async def serving(control: StoreControl):
    """A stub to `control` through the store's gRPC service."""
    with tempfile.TemporaryDirectory() as directory:  # short: a socket path has <= 107 bytes
        socket = f"unix:{Path(directory) / 'kv.sock'}"
        server = grpc.aio.server(options=CHANNEL_OPTIONS)
        pb_grpc.add_KVStoreServicer_to_server(
            KVStoreService(types.SimpleNamespace(control=control)), server)
        server.add_insecure_port(socket)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(socket, options=CHANNEL_OPTIONS) as channel:
                yield pb_grpc.KVStoreStub(channel)
        finally:
            await server.stop(0)


async def test_a_sink_page_is_allocated_past_a_conversation_thousands_of_turns_deep():
    """The client's side of the deep-tree eviction: this Allocate was UNKNOWN
    (a RecursionError inside the store), every time."""
    c = StoreControl(DEEP + 4, 0, PAGE, False, vocab_size=1000, namespace_prefix="m|rk4p",
                     staging_pages=1)
    deep_conversation(c, c.open_session("router").id)
    other = c.open_session("router-2")
    async with serving(c) as stub:
        reply = await stub.Allocate(pb.AllocateRequest(session_id=other.id, num_pages=1,
                                                       num_staging=1))
    assert list(reply.staging) == [DEEP + 4] and c.stats().cached_pages == 0


async def test_a_failure_inside_the_store_is_internal_with_its_reason(capfd):
    c = StoreControl(16, 4, PAGE, True, vocab_size=100, namespace_prefix="m|x")
    session = c.open_session("router")
    c.allocate(session.id, 2, 1)
    before = c.stats()

    def broken(namespace, tokens):
        raise RuntimeError("simulated bug in the prefix cache")
    c.cache.match = broken
    async with serving(c) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Match(pb.MatchRequest(session_id=session.id,
                                             tokens_le32=pack_token_ids(range(9))))
        assert err.value.code() == grpc.StatusCode.INTERNAL
        assert "RuntimeError: simulated bug in the prefix cache" in err.value.details()
        # still serving, nothing lost: the session and what it holds are there
        assert (await stub.Stats(pb.StatsRequest())).held_pages == 2
        del c.cache.match
        reply = await stub.Match(pb.MatchRequest(session_id=session.id,
                                                 tokens_le32=pack_token_ids(range(9))))
        assert reply.num_tokens == 0
    assert c.stats().held_pages == before.held_pages and session.id in c.sessions
    log = capfd.readouterr().err
    assert "internal error answering a request" in log and "Traceback" in log
