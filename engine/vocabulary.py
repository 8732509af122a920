"""Token ids checked against a vocabulary, vectorized: a 100K-token prompt
checked id by id in Python cost ~2 ms in each process it passed through on
its way to the first token; numpy's min and max take ~0.05 ms."""
from __future__ import annotations

import numpy as np


def first_outside_vocabulary(ids, vocab_size: int) -> int | None:
    """The first of `ids` (an array, or a sequence of ints) outside
    [0, vocab_size), or None when every id is inside."""
    values = np.asarray(ids)
    if values.size == 0 or (values.min() >= 0 and values.max() < vocab_size):
        return None
    return int(values[(values < 0) | (values >= vocab_size)][0])
