"""Conversions between the internal protobufs (tandem.internal.v1) and the
engine's types, in one place for the router, both workers and the store's
RPC edge: protobuf stops at these functions.

Token ids of whole prompts travel packed: 4-byte little-endian unsigned ints
in one `bytes` field (pack_token_ids / unpack_token_ids). As repeated varints
a 100K-token prompt cost ~8 ms of Python per call to build, parse and turn
into ints; packed it is one C loop to build and a zero-copy numpy view to
read, and a prefix of the prompt is a prefix of its bytes (packed_prefix)."""
from __future__ import annotations

import array
import sys

import numpy as np

from engine.errors import InvalidRequestError
from engine.sampling import SamplingParams
from tandem.internal.v1 import workers_pb2 as pb

# the packed layout: one little-endian uint32 per token id
TOKEN_ID_DTYPE = np.dtype("<u4")
TOKEN_ID_BYTES = TOKEN_ID_DTYPE.itemsize
_TOKEN_ID_LIMIT = 2**32
# array.array packs a list ~2x faster than numpy (one C loop, no dtype
# inference): the typecode of a 4-byte unsigned int on this platform
_ARRAY_UINT32 = next(code for code in "IL" if array.array(code).itemsize == TOKEN_ID_BYTES)


def pack_token_ids(ids) -> bytes:
    """`ids` (a list, tuple, range, numpy array or CPU torch tensor of ints) as
    the packed bytes of a token-id field. Raises ValueError naming the first
    id that is not an int in [0, 2**32)."""
    if isinstance(ids, (bytes, bytearray, memoryview)):
        raise TypeError("token ids given as bytes: already packed? pack_token_ids takes ints")
    if not isinstance(ids, (list, tuple)) and not hasattr(ids, "__array__"):
        ids = list(ids)
    if isinstance(ids, (list, tuple)):
        try:
            packed = array.array(_ARRAY_UINT32, ids)
        except (OverflowError, TypeError):
            bad = next((t for t in ids if not _packable(t)), None)
            raise ValueError(_bad_id_message(bad)) from None
        if sys.byteorder == "big":
            packed.byteswap()
        return packed.tobytes()
    values = np.asarray(ids)
    if values.ndim != 1 or values.dtype.kind not in "iu":
        raise ValueError(f"token ids must be a flat sequence of ints, got an array of "
                         f"{values.dtype} with shape {values.shape}")
    if values.size and (values.min() < 0 or values.max() >= _TOKEN_ID_LIMIT):
        raise ValueError(_bad_id_message(values[(values < 0) | (values >= _TOKEN_ID_LIMIT)][0]))
    return values.astype(TOKEN_ID_DTYPE, copy=False).tobytes()


def unpack_token_ids(data: bytes) -> np.ndarray:
    """The token ids packed in `data`, as a read-only uint32 array viewing it
    (no copy). Raises ValueError when the length is not a whole number of ids."""
    if len(data) % TOKEN_ID_BYTES:
        raise ValueError(f"{len(data)} bytes is not a whole number of token ids: pack each id "
                         f"as a {TOKEN_ID_BYTES}-byte little-endian unsigned int "
                         "(tandem.wire.pack_token_ids)")
    return np.frombuffer(data, dtype=TOKEN_ID_DTYPE)


def packed_prefix(data: bytes, num_tokens: int) -> bytes:
    """The packed bytes of the first `num_tokens` ids of packed `data`."""
    return data[:num_tokens * TOKEN_ID_BYTES]


def token_ids_from_pb(data: bytes, field: str) -> np.ndarray:
    """A request's packed token-id field for a worker: unpack_token_ids, with a
    malformed field an InvalidRequestError (INVALID_ARGUMENT) naming it."""
    try:
        return unpack_token_ids(data)
    except ValueError as e:
        raise InvalidRequestError(f"{field}: {e}") from None


def _packable(value) -> bool:
    return isinstance(value, (int, np.integer)) and 0 <= value < _TOKEN_ID_LIMIT


def _bad_id_message(bad) -> str:
    shown = int(bad) if isinstance(bad, (int, np.integer)) else repr(bad)
    return f"token id {shown} cannot be packed: token ids are ints in [0, 2**32)"


def sampling_to_pb(params: SamplingParams, stop_token_ids) -> pb.Sampling:
    """Fully resolved settings: `stop_token_ids` already holds EOS unless ignore_eos."""
    return pb.Sampling(temperature=params.temperature, top_p=params.top_p, top_k=max(0, params.top_k),
                       min_p=params.min_p, repetition_penalty=params.repetition_penalty,
                       presence_penalty=params.presence_penalty,
                       frequency_penalty=params.frequency_penalty, seed=params.seed,
                       max_new_tokens=params.max_new_tokens, stop_token_ids=stop_token_ids,
                       ignore_eos=params.ignore_eos,
                       logprobs=-1 if params.logprobs is None else params.logprobs)


def sampling_from_pb(s: pb.Sampling) -> SamplingParams:
    return SamplingParams(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
        repetition_penalty=s.repetition_penalty, presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty, seed=s.seed,
        max_new_tokens=max(1, s.max_new_tokens), stop_token_ids=tuple(s.stop_token_ids),
        ignore_eos=s.ignore_eos, logprobs=None if s.logprobs < 0 else s.logprobs)


def generated_token_pb(token_id: int, logprob: float | None,
                       top: list[tuple[int, float]] | None) -> pb.GeneratedToken:
    return pb.GeneratedToken(token_id=token_id, logprob=logprob or 0.0,
                             top=[pb.TokenLogprob(token_id=t, logprob=lp) for t, lp in top or []])
