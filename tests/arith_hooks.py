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


# -- found by a hostile review of the proofs' arithmetic (each was proven, and torch computes otherwise)
_SLOPES = [2.0 ** -(i % 8 + 1) for i in range(64)]
SL32, SL16 = torch.tensor(_SLOPES), torch.tensor(_SLOPES, dtype=torch.float16)
FAR = 3 * 2 ** 37 + 12345
LOW, HIGH16, HIGH17 = torch.tensor(FAR), torch.tensor(FAR + 2 ** 16), torch.tensor(FAR + 2 ** 17)
PER_HEAD = torch.tensor([2.0 ** -(1 + i % 8) for i in range(64)])
NEG = torch.tensor([-96], dtype=torch.int8)
"""int8(32 * 5) is -96: equal in eager 0-d promotion (int8 wins), not under vmap (int64)."""
MILLION = torch.tensor(10 ** 6)
ONE_ZERO = torch.tensor([0])
DISTANCE = torch.tensor(12345)


def float16_slope_at_one_head(score, b, h, q_idx, kv_idx):
    """Head 32's bias in float16: inf at distance 200000, 2048 instead of 2048.5 at 4097."""
    return score + torch.where(h == 32, SL16[h] * (kv_idx - q_idx), SL32[h] * (kv_idx - q_idx))


def float64_cancellation(score, b, h, q_idx, kv_idx):
    """``m`` over the reals; in float64, (m + 2**62) rounds to multiples of 1024 and the difference is off."""
    m = torch.clamp(kv_idx, LOW, HIGH16) - LOW
    wobble = (m + 2 ** 62).double() - (m - m + 2 ** 62).double()
    return score + (((kv_idx - m) - q_idx).double() + wobble)


def float32_cancellation(score, b, h, q_idx, kv_idx):
    """The same in float32, by the promotion of an int64 times a Python float."""
    m = torch.clamp(kv_idx, LOW, HIGH17) - LOW
    wobble = (m + 2 ** 40) * 1.0 - (m - m + 2 ** 40) * 1.0
    return score + (((kv_idx - m) - q_idx) * 1.0 + wobble)


def head_step_promoted_as_vmap(score, b, h, q_idx, kv_idx):
    """A step fixed by the head (``h * 5 == NEG``) that eager 0-d torch computes in int8 and vmap in int64."""
    d = kv_idx - q_idx
    s_far = torch.where((h * 5 == NEG)[0], PER_HEAD[h] * 4, PER_HEAD[h])
    s_near = torch.where(h == 32, PER_HEAD[h] * 4, PER_HEAD[h])
    return score + torch.where(torch.abs(d) > MILLION, s_far * d, s_near * d)


def raises_only_in_eager(b, h, q_idx, kv_idx):
    """A dead line that raises on eager 0-d values (not under vmap) hid the uint8 wrap of ``u`` (250 + 10 is 4)."""
    z8 = torch.zeros_like(ONE_ZERO + q_idx * 0, dtype=torch.int8)
    unused = torch.where(q_idx >= 0, torch.clamp(q_idx, z8, z8 + 100), 300)  # noqa: F841
    u = torch.full_like(q_idx, 250, dtype=torch.uint8) + 10
    return (kv_idx <= q_idx) | ((u == 4) & (b >= 2))


def zero_d_constant_meets_a_batched_table(b, h, q_idx, kv_idx):
    """Under vmap FLAG16[h] is a batched uint8 value, which a 0-d int64 tensor's 260 meets in uint8 (4)."""
    return (kv_idx <= q_idx) | (FLAG16[h] == torch.tensor(260))
