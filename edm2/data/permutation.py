"""A pseudo-random permutation of [0, n) computed per index in O(1) memory: a keyed Feistel network on the
smallest even-bit domain 2**(2h) >= n, with cycle-walking back into [0, n).

A Feistel network is a bijection of its domain whatever its round function; cycle-walking (re-applying it while the
value lies outside [0, n)) turns it into a bijection of [0, n), because following the network from a value in
[0, n) must return to [0, n) before it cycles. The domain is less than 4n, so an index takes fewer than four walks
on average.
"""

from __future__ import annotations

import numpy as np

ROUNDS = 6  # Luby-Rackoff: four rounds already give a pseudo-random permutation; six for good measure
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)  # splitmix64's finalizer constants


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a bijective avalanche of 64-bit words (arithmetic modulo 2**64)."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


class FeistelPermutation:
    """The permutation of [0, size) keyed by (seed, *key): permutation[i] for arrays of i, nothing stored."""

    def __init__(self, size: int, seed: int, *key: int):
        if size < 1:
            raise ValueError(f"a permutation needs at least one element, not {size}")
        self.size = size
        self.half_bits = max(1, ((size - 1).bit_length() + 1) // 2)
        self._mask = np.uint64((1 << self.half_bits) - 1)
        self._keys = np.random.SeedSequence([seed, *key]).generate_state(ROUNDS, np.uint64)

    def _network(self, x: np.ndarray) -> np.ndarray:
        """One pass of the Feistel network over the domain [0, 4**half_bits)."""
        shift = np.uint64(self.half_bits)
        left, right = x >> shift, x & self._mask
        for key in self._keys:
            left, right = right, left ^ (_mix(right ^ key) & self._mask)
        return (left << shift) | right

    def __call__(self, indices: np.ndarray | int) -> np.ndarray:
        """permutation[i] for each i in [0, size) (an array of int64, the shape of indices)."""
        x = np.array(indices, dtype=np.uint64, ndmin=1)
        out = self._network(x)
        outside = out >= np.uint64(self.size)
        while outside.any():  # cycle-walking: each value returns to [0, size) after a few passes
            out[outside] = self._network(out[outside])
            outside = out >= np.uint64(self.size)
        return out.astype(np.int64).reshape(np.shape(indices))
