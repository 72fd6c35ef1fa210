"""BlockMask cache: analytic builds equal torch's, identity on hits, one warning on eviction."""

from __future__ import annotations

import time
import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from primus_ext.attention.library import library_pattern

from primus_ext.attention.block_mask_cache import BlockMaskCache, build_block_mask
from primus_ext.attention.pattern import CAUSAL, FULL, Pattern

TABLES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
          "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


def assert_same_block_mask(ours, theirs):
    assert ours.seq_lengths == theirs.seq_lengths
    assert ours.BLOCK_SIZE == theirs.BLOCK_SIZE
    assert torch.equal(ours.to_dense(), theirs.to_dense())
    for name in TABLES:
        a, b = getattr(ours, name), getattr(theirs, name)
        assert a.dtype == b.dtype == torch.int32, name
        assert a.shape == b.shape, name
        assert torch.equal(a, b), name


WINDOWS = [CAUSAL, FULL, Pattern(3, 0), Pattern(130, 0), Pattern(127, 0), Pattern(128, 0),
           Pattern(2, 2), Pattern(0, 300), Pattern(200, 129), Pattern(-1, 5), Pattern(0, 0)]
SHAPES = [(128, 128), (300, 300), (1000, 1000), (257, 513), (513, 257), (1, 700), (640, 640)]


@pytest.mark.parametrize("pattern", WINDOWS, ids=lambda p: p.describe())
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_analytic_block_mask_equals_torch(pattern, shape):
    q_len, kv_len = shape
    ours = build_block_mask(pattern, q_len, kv_len, "cpu")
    theirs = create_block_mask(pattern.mask_mod(), None, None, q_len, kv_len, device="cpu",
                               _compile=False)
    assert_same_block_mask(ours, theirs)
    assert library_pattern(ours.mask_mod) == pattern


def test_causal_tiles_are_diagonal_partial_and_lower_full():
    bm = build_block_mask(CAUSAL, 512, 512, "cpu")
    assert bm.kv_num_blocks.flatten().tolist() == [1, 1, 1, 1]
    assert bm.full_kv_num_blocks.flatten().tolist() == [0, 1, 2, 3]


def test_document_pattern_falls_back_to_torch():
    pattern = Pattern(-1, 0, boundaries=(0, 100, 300, 333))
    ours = BlockMaskCache().get(pattern, 333, 333, "cpu")
    theirs = create_block_mask(pattern.mask_mod(), None, None, 333, 333, device="cpu")
    assert_same_block_mask(ours, theirs)


def test_hit_returns_the_same_object():
    cache = BlockMaskCache()
    first = cache.get(CAUSAL, 256, 256, "cpu")
    assert cache.get(Pattern(-1, 0), 256, 256, torch.device("cpu")) is first
    assert cache.get(CAUSAL, 256, 384, "cpu") is not first
    assert (cache.hits, cache.misses, len(cache)) == (1, 2, 2)


def test_least_recently_used_entry_is_evicted():
    cache = BlockMaskCache(maxsize=2)
    a = cache.get(CAUSAL, 128, 128, "cpu")
    cache.get(CAUSAL, 256, 256, "cpu")
    assert cache.get(CAUSAL, 128, 128, "cpu") is a  # now most recent
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        cache.get(CAUSAL, 384, 384, "cpu")
    assert cache.get(CAUSAL, 128, 128, "cpu") is a
    assert cache.key(CAUSAL, 256, 256, "cpu") not in cache


def test_first_eviction_warns_once_and_size_stays_bounded():
    cache = BlockMaskCache()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in range(1, 66):
            cache.get(Pattern(3, 0), n, n, "cpu")
        assert len(cache) == 64 and cache.evictions == 1
        for n in range(66, 80):
            cache.get(Pattern(3, 0), n, n, "cpu")
    runtime = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(runtime) == 1
    message = str(runtime[0].message)
    assert "64 BlockMasks is full" in message and "65 distinct (q_len, kv_len) shapes" in message
    assert len(cache) == 64 and cache.evictions == 15 and cache.misses == 79


def test_clear_empties_the_cache():
    cache = BlockMaskCache(maxsize=4)
    cache.get(CAUSAL, 128, 128, "cpu")
    cache.clear()
    assert len(cache) == 0
    with pytest.raises(ValueError):
        BlockMaskCache(maxsize=0)


@pytest.mark.parametrize("pattern", [CAUSAL, Pattern(4095, 0)], ids=lambda p: p.describe())
def test_long_sequence_builds_finish(pattern):
    seq = 131072
    start = time.perf_counter()
    bm = BlockMaskCache().get(pattern, seq, seq, "cpu")
    elapsed_ms = (time.perf_counter() - start) * 1e3
    print(f"analytic BlockMask {pattern.describe()} at S={seq}: {elapsed_ms:.1f} ms")
    assert bm.seq_lengths == (seq, seq)
    assert bm.kv_indices.shape == (1, 1, seq // 128, seq // 128)
    assert int(bm.full_kv_num_blocks[0, 0, -1]) == (1023 if pattern == CAUSAL else 31)
