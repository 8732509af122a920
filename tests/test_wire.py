"""Packed token ids (tandem.wire): what every internal RPC that carries a
prompt sends. Round trips from every type callers hold, the byte layout, and
a clear error for each malformed input."""
import struct

import numpy as np
import pytest
import torch

from engine.errors import InvalidRequestError
from engine.vocabulary import first_outside_vocabulary
from tandem.wire import (pack_token_ids, packed_prefix, token_ids_from_pb,
                         unpack_token_ids)

IDS = [0, 1, 255, 256, 65_535, 248_319, 2**31, 2**32 - 1]


@pytest.mark.parametrize("given", [
    IDS, tuple(IDS), np.array(IDS, dtype=np.int64), np.array(IDS, dtype=np.uint32),
    np.array(IDS, dtype=np.uint64), torch.tensor(IDS, dtype=torch.int64), iter(IDS),
], ids=["list", "tuple", "int64", "uint32", "uint64", "torch", "iterator"])
def test_round_trip_from_every_type_callers_hold(given):
    packed = pack_token_ids(given)
    assert packed == struct.pack(f"<{len(IDS)}I", *IDS)  # 4 bytes each, little-endian
    ids = unpack_token_ids(packed)
    assert ids.dtype == np.dtype("<u4") and ids.tolist() == IDS


def test_empty_and_range():
    assert pack_token_ids([]) == pack_token_ids(np.zeros(0, np.int64)) == b""
    assert unpack_token_ids(b"").tolist() == []
    assert unpack_token_ids(pack_token_ids(range(5, 9))).tolist() == [5, 6, 7, 8]


def test_unpacked_ids_view_the_bytes_read_only():
    packed = pack_token_ids([7, 8, 9])
    ids = unpack_token_ids(packed)
    assert not ids.flags.writeable and ids.base is not None  # no copy was made
    with pytest.raises(ValueError):
        ids[0] = 1


def test_a_prefix_of_the_bytes_is_the_prefix_of_the_ids():
    ids = list(range(100, 140))
    packed = pack_token_ids(ids)
    for n in (0, 1, 16, 40):
        assert packed_prefix(packed, n) == pack_token_ids(ids[:n])


@pytest.mark.parametrize("given, named", [
    ([1, -1, 2], "-1"),
    ([1, 2**32], "4294967296"),
    ((3, 2**70), str(2**70)),
    ([1, 2.5], "2.5"),
    ([1, "7"], "'7'"),
    (np.array([4, -5, -6]), "-5"),
    (np.array([0, 2**32], dtype=np.int64), "4294967296"),
    (torch.tensor([1, 2**40]), str(2**40)),
], ids=["negative", "too-large", "huge", "float", "str", "np-negative", "np-too-large", "torch"])
def test_unpackable_ids_are_refused_by_name(given, named):
    with pytest.raises(ValueError, match="token id") as e:
        pack_token_ids(given)
    assert named in str(e.value) and "[0, 2**32)" in str(e.value)


def test_non_integer_arrays_and_bytes_are_refused():
    with pytest.raises(ValueError, match="flat sequence of ints"):
        pack_token_ids(np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="flat sequence of ints"):
        pack_token_ids(np.zeros((2, 2), np.int64))
    with pytest.raises(TypeError, match="already packed"):
        pack_token_ids(b"\x01\x00\x00\x00")


@pytest.mark.parametrize("length", [1, 2, 3, 5, 401])
def test_a_length_that_is_not_whole_ids_is_refused(length):
    with pytest.raises(ValueError, match=f"{length} bytes is not a whole number of token ids"):
        unpack_token_ids(b"\x00" * length)


def test_a_workers_malformed_field_is_an_invalid_request_naming_it():
    assert token_ids_from_pb(pack_token_ids([3, 4]), "tokens_le32").tolist() == [3, 4]
    with pytest.raises(InvalidRequestError, match="prompt_le32: 6 bytes is not a whole number "
                                                  "of token ids: pack each id as a 4-byte"):
        token_ids_from_pb(b"\x00" * 6, "prompt_le32")


def test_first_outside_vocabulary():
    assert first_outside_vocabulary(np.array([0, 5, 9], np.uint32), 10) is None
    assert first_outside_vocabulary([], 10) is None
    assert first_outside_vocabulary(np.array([1, 12, 3, 11], np.uint32), 10) == 12
    assert first_outside_vocabulary([4, -2, 99], 10) == -2
    assert first_outside_vocabulary(unpack_token_ids(pack_token_ids([9, 10])), 10) == 10
