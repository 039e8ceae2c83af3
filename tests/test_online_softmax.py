"""The Triton kernel's softmax, in NumPy: one row of scores folded in tile by tile equals the full softmax.

``online_attention`` keeps the same state as ``_paged_attention_kernel`` (running max, running sum,
accumulator, all rescaled when the max grows) and ``merge_splits`` is ``_merge_splits_kernel``'s merge of
split-KV partials. Natural exp here; the kernel works in base 2 with scores pre-multiplied by log2(e).
"""

import numpy as np
import pytest


def online_attention(scores: np.ndarray, values: np.ndarray, tile: int) -> tuple[float, float, np.ndarray]:
    """Fold ``scores`` ([keys], -inf = masked) and ``values`` ([keys, dim]) in ``tile`` keys at a time.
    Returns the state (max, sum, accumulator); the output is accumulator / sum."""
    running_max, running_sum, acc = -np.inf, 0.0, np.zeros(values.shape[1])
    for start in range(0, len(scores), tile):
        s, v = scores[start:start + tile], values[start:start + tile]
        new_max = max(running_max, s.max())
        shift = 0.0 if new_max == -np.inf else new_max  # nothing visible yet: exp gives 0, not NaN
        probs = np.exp(s - shift)
        rescale = np.exp(running_max - shift)  # earlier tiles were weighted against the old max
        running_sum = running_sum * rescale + probs.sum()
        acc = acc * rescale + probs @ v
        running_max = new_max
    return running_max, running_sum, acc


def merge_splits(parts: list[tuple[float, float, np.ndarray]]) -> np.ndarray:
    """Split-KV: each split folded its own key range; reweight every partial to the global max."""
    global_max = max(m for m, _, _ in parts)
    weights = [np.exp(m - global_max) for m, _, _ in parts]
    return sum(w * acc for w, (_, _, acc) in zip(weights, parts)) / sum(w * s for w, (_, s, _) in zip(weights, parts))


def full_softmax_attention(scores: np.ndarray, values: np.ndarray) -> np.ndarray:
    probs = np.exp(scores - scores.max())
    return probs @ values / probs.sum()


@pytest.mark.parametrize("tile", [1, 4, 16, 64])
def test_online_softmax_over_tiles_equals_the_full_softmax(tile):
    rng = np.random.default_rng(tile)
    scores, values = rng.normal(scale=4, size=50), rng.normal(size=(50, 8))
    scores[:7] += 30  # the max sits in the first tile: later tiles only add
    scores[40] = 60  # and then grows in a later one: earlier tiles must be rescaled
    _, running_sum, acc = online_attention(scores, values, tile)
    np.testing.assert_allclose(acc / running_sum, full_softmax_attention(scores, values), rtol=1e-10)


def test_masked_keys_and_a_fully_masked_first_tile_add_nothing():
    rng = np.random.default_rng(0)
    scores, values = rng.normal(size=40), rng.normal(size=(40, 4))
    scores[:16] = -np.inf  # a whole tile masked (the causal rule or padding): no NaN, no weight
    scores[30:] = -np.inf
    _, running_sum, acc = online_attention(scores, values, 16)
    np.testing.assert_allclose(acc / running_sum, full_softmax_attention(scores[16:30], values[16:30]), rtol=1e-10)


def test_split_kv_partials_merge_to_the_full_softmax():
    rng = np.random.default_rng(1)
    scores, values = rng.normal(scale=5, size=96), rng.normal(size=(96, 8))
    parts = [online_attention(scores[start:start + 32], values[start:start + 32], 16) for start in (0, 32, 64)]
    np.testing.assert_allclose(merge_splits(parts), full_softmax_attention(scores, values), rtol=1e-10)
