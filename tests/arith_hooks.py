"""Hooks whose meaning depends on torch's arithmetic, not school arithmetic (type promotion of Python numbers
into narrow integer dtypes, float32 overflow): `tests/test_proof_arithmetic.py`."""

import torch

FLAG16 = torch.tensor([0] * 8 + [4] + [0] * 7, dtype=torch.uint8)
"""One head (8) of 16 flagged: a cross-check sampling the first and last heads never calls it."""
FLAG4 = torch.tensor([4, 4, 4, 4], dtype=torch.uint8)
SMALL8 = torch.tensor([3, 3, 3, 3], dtype=torch.int8)


def flag_equals_260(b, h, q_idx, kv_idx):
    """torch converts 260 to uint8 (4) before comparing: head 8 attends everywhere."""
    return (kv_idx <= q_idx) | (FLAG16[h] == 260)


def all_flags_equal_260(b, h, q_idx, kv_idx):
    """Every head's flag is 4, which equals 260 in uint8: full attention, as torch computes it."""
    return (kv_idx <= q_idx) | (FLAG4[h] == 260)


def flag_times_260(b, h, q_idx, kv_idx):
    """260 is 4 in uint8: 4 * 4 = 16 at head 8, 0 elsewhere."""
    return (kv_idx <= q_idx) | (FLAG16[h] * 260 == 16)


def flag_modulo_260(b, h, q_idx, kv_idx):
    """``x % 260`` is ``x % 4`` on a uint8 table: 0 at every head."""
    return (kv_idx <= q_idx) | (FLAG16[h] % 260 == 0)


def small_plus_256(b, h, q_idx, kv_idx):
    """256 wraps to 0 in int8: 3 + 256 is 3."""
    return (kv_idx <= q_idx) | (SMALL8[h] + 256 == 3)


def flag_below_position(b, h, q_idx, kv_idx):
    """A uint8 table and an int64 index meet in int64 (both 0-d under vmap): no wrap, causal plus head 8."""
    return (kv_idx <= q_idx) | (FLAG16[h] > q_idx + 1000)


def overflowing_identity(score, b, h, q_idx, kv_idx):
    """The score over the reals, ``inf`` or ``nan`` in float32 for ordinary scores."""
    big = score * 1000.0 * 1000.0 * 1000.0 * 1000.0 * 1000.0 * 1000.0 * 1000.0 * 1000.0 * 1000.0 * 1000.0 * 1000.0
    return big / 1000.0 / 1000.0 / 1000.0 / 1000.0 / 1000.0 / 1000.0 / 1000.0 / 1000.0 / 1000.0 / 1000.0 / 1000.0


def underflowing_identity(score, b, h, q_idx, kv_idx):
    """The score over the reals, 0 in float32 (2**-156 of the score underflows)."""
    tiny = score / 4096.0 / 4096.0 / 4096.0 / 4096.0 / 4096.0 / 4096.0 / 4096.0 / 4096.0 / 4096.0 / 4096.0 / 4096.0
    tiny = tiny / 4096.0 / 4096.0
    back = tiny * 4096.0 * 4096.0 * 4096.0 * 4096.0 * 4096.0 * 4096.0 * 4096.0 * 4096.0 * 4096.0 * 4096.0 * 4096.0
    return back * 4096.0 * 4096.0


def zero_in_reals_bias(score, b, h, q_idx, kv_idx):
    """Adds ``d * 3 / 3 - d`` (0 over the reals), whose float32 rounding is not 0 at large distances."""
    d = (q_idx - kv_idx).float()
    return score + (d * 3.0 / 3.0 - d)


def alibi(score, b, h, q_idx, kv_idx):
    """One addition of a bias of the indices: the form the kernels compute."""
    return score + 0.25 * (kv_idx - q_idx)


def widened_identity(score, b, h, q_idx, kv_idx):
    """float32 into float64 keeps every value: the identity."""
    return score.double()


def rounded_to_half(score, b, h, q_idx, kv_idx):
    return score.half().float()


def huge_bias(score, b, h, q_idx, kv_idx):
    """A bias ALiBi-shaped over the reals whose float32 steps overflow (4096**12 is past float32)."""
    far = (kv_idx - q_idx) * 4096.0 * 4096.0 * 4096.0 * 4096.0 * 4096.0 * 4096.0 * 4096.0 * 4096.0 * 4096.0 * 4096.0
    return score + far / 4096.0 / 4096.0 / 4096.0 / 4096.0 / 4096.0 / 4096.0 / 4096.0 / 4096.0 / 4096.0 / 4096.0 * 0.5
