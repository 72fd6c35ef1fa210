"""Recognition of user hooks: exact patterns, refusals with reasons, score kinds."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from primus_ext.attention import masks, recognition
from primus_ext.attention.pattern import CAUSAL, FULL, Pattern
from primus_ext.attention.recognition import recognize_mask, verify_pattern
from primus_ext.attention.score_recognition import recognize_score


def user_window(left: int, right: int):
    """A window written the way a user would, with no primus_pattern attached."""

    def mask(b, h, q_idx, kv_idx):
        ok = torch.ones_like(q_idx - kv_idx, dtype=torch.bool)
        if left >= 0:
            ok = ok & (q_idx - kv_idx <= left)
        if right >= 0:
            ok = ok & (kv_idx - q_idx <= right)
        return ok

    return mask


# ---------------------------------------------------------------- library masks
@pytest.mark.parametrize("factory", [
    masks.full, masks.causal,
    lambda: masks.sliding_window(3, 0), lambda: masks.sliding_window(2, 5),
    lambda: masks.packed_documents([0, 5, 12, 20], causal=True),
])
def test_library_masks_are_taken_without_probing(factory):
    library = factory()
    spy = mock.Mock(wraps=library)
    spy.primus_pattern = library.primus_pattern
    result = recognize_mask(spy, 20, 20)
    assert result.pattern == library.primus_pattern
    assert verify_pattern(spy, library.primus_pattern, 20, 20) is None
    spy.assert_not_called()


def test_library_pattern_differing_from_the_asked_one_is_reported():
    reason = verify_pattern(masks.sliding_window(3, 0), CAUSAL, 16, 16)
    assert reason is not None and "kv=0" in reason


def test_library_mask_without_pattern_is_probed_and_refused():
    result = recognize_mask(masks.prefix_lm(4), 16, 16)
    assert result.pattern is None
    assert "not a window or document pattern" in result.reason


# ---------------------------------------------------------------- user windows
@pytest.mark.parametrize("window",
                         [(3, 0), (2, 2), (0, 3), (-1, 2), (-1, 0), (-1, -1), (0, 0), (7, 1)])
@pytest.mark.parametrize("shape", [(40, 40), (24, 56), (56, 24)])
def test_user_windows_are_recognised_with_exact_bounds(window, shape):
    result = recognize_mask(user_window(*window), *shape)
    assert result.pattern == Pattern(*window), result.reason
    q, kv = shape
    assert "checked on every cell" in result.reason
    rows, cols = torch.arange(q).view(-1, 1), torch.arange(kv).view(1, -1)
    assert torch.equal(Pattern(*window).allows(rows, cols), result.pattern.allows(rows, cols))


def test_user_causal_and_full_are_the_canonical_patterns():
    assert recognize_mask(lambda b, h, q, kv: q >= kv, 33, 33).pattern == CAUSAL
    assert recognize_mask(lambda b, h, q, kv: torch.ones_like(q >= kv), 33, 17).pattern == FULL
    assert recognize_mask(lambda b, h, q, kv: True, 5, 9).pattern == FULL
    assert recognize_mask(None, 5, 9).pattern == FULL


def test_bound_that_never_binds_is_unbounded_and_verify_catches_it_later():
    mask = user_window(10, 0)
    result = recognize_mask(mask, 8, 8)
    assert result.pattern == CAUSAL  # exact on 8 x 8: no row reaches 10 keys back
    assert verify_pattern(mask, result.pattern, 8, 8) is None
    reason = verify_pattern(mask, result.pattern, 32, 32)
    assert reason == "at q=11, kv=0 the mask blocks attention but causal allows it"
    assert verify_pattern(mask, Pattern(10, 0), 64, 64) is None


def test_window_with_empty_tail_rows_when_queries_outnumber_keys():
    # Rows q >= kv_len + left see nothing; the pattern itself says so.
    assert recognize_mask(user_window(2, 0), 10, 4).pattern == Pattern(2, 0)
    assert recognize_mask(user_window(0, -1), 10, 1).pattern == Pattern(0, -1)


# ---------------------------------------------------------------- documents
def doc_ids(lengths):
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


def test_user_packed_documents_with_causal_inside():
    docs = doc_ids([3, 4, 5, 4, 9])

    def mask(b, h, q_idx, kv_idx):
        return (docs[q_idx] == docs[kv_idx]) & (kv_idx <= q_idx)

    result = recognize_mask(mask, 25, 25)
    assert result.pattern == Pattern(-1, 0, boundaries=(0, 3, 7, 12, 16, 25)), result.reason
    assert verify_pattern(mask, result.pattern, 25, 25) is None
    assert "boundaries" in verify_pattern(mask, result.pattern, 30, 30)


def test_user_packed_documents_with_window_inside():
    docs = doc_ids([6, 10, 8])

    def mask(b, h, q_idx, kv_idx):
        return (docs[q_idx] == docs[kv_idx]) & (kv_idx <= q_idx) & (q_idx - kv_idx <= 2)

    assert recognize_mask(mask, 24, 24).pattern == Pattern(2, 0, boundaries=(0, 6, 16, 24))


def test_chunked_local_attention_is_exactly_equal_documents():
    result = recognize_mask(masks.chunked(4), 16, 16)
    assert result.pattern == Pattern(-1, 0, boundaries=(0, 4, 8, 12, 16))


# ---------------------------------------------------------------- refusals
def test_prefix_lm_is_refused_with_reason():
    result = recognize_mask(lambda b, h, q, kv: (kv <= q) | (kv < 4), 16, 16)
    assert result.pattern is None
    assert result.reason == ("is not a window or document pattern: "
                             "row 0 reaches 3 keys to the right but row 1 reaches 2")


def test_head_dependent_mask_is_refused():
    result = recognize_mask(lambda b, h, q, kv: (kv <= q) & (h == 0), 16, 16)
    assert result.pattern is None
    assert result.reason.startswith("depends on the head index")


def test_batch_dependent_mask_is_refused():
    result = recognize_mask(lambda b, h, q, kv: (kv <= q) | (b == 1), 16, 16)
    assert result.pattern is None
    assert result.reason.startswith("depends on the batch index")


def test_row_with_a_hole_is_described():
    result = recognize_mask(lambda b, h, q, kv: (kv <= q) & (kv != 3), 16, 16)
    assert result.pattern is None
    assert result.reason == "is not a window or document pattern: row 4 allows kv 0..2 and 4"


def test_empty_mask_and_strictly_past_masks_are_refused():
    assert recognize_mask(lambda b, h, q, kv: q < -1, 8, 8).pattern is None
    past = recognize_mask(lambda b, h, q, kv: kv < q, 8, 8)
    assert past.pattern is None and "row" in past.reason


# ---------------------------------------------------------------- above the cell cap
@pytest.fixture
def small_cap(monkeypatch):
    """Shrink the cap so the sampled path runs on a small grid."""
    monkeypatch.setattr(recognition, "EXACT_CELL_LIMIT", 1000)
    monkeypatch.setattr(recognition, "LEADING_BLOCK", 16)
    monkeypatch.setattr(recognition, "SAMPLED_EDGE_ROWS", 8)
    monkeypatch.setattr(recognition, "SAMPLED_SPREAD_ROWS", 16)


def test_above_cap_window_uses_block_and_sampled_rows(small_cap):
    result = recognize_mask(user_window(5, 0), 600, 600)
    assert result.pattern == Pattern(5, 0)
    assert "sampled complete rows" in result.reason
    # A right bound past the leading block is read from the complete rows.
    assert recognize_mask(user_window(-1, 40), 600, 600).pattern == Pattern(-1, 40)


def test_above_cap_documents_are_refused(small_cap):
    docs = doc_ids([200, 400])
    result = recognize_mask(lambda b, h, q, kv: docs[q] == docs[kv], 600, 600)
    assert result.pattern is None
    assert "packed documents are only recognised up to 1000 grid cells" in result.reason


def test_above_cap_verify_checks_sampled_rows(small_cap):
    assert verify_pattern(user_window(5, 0), Pattern(5, 0), 600, 600) is None
    assert verify_pattern(user_window(5, 0), Pattern(4, 0), 600, 600) is not None


# ---------------------------------------------------------------- score_mod
def test_identity_score():
    result = recognize_score(lambda s, b, h, q, kv: s, 4)
    assert (result.kind, result.alibi_slopes, result.softcap) == ("identity", None, None)
    assert recognize_score(None, 4).kind == "identity"


def test_alibi_slopes_are_read_per_head_in_turbo_sign():
    slopes = torch.tensor([2.0 ** -1, 2.0 ** -2, 2.0 ** -3, 2.0 ** -8 / 3])

    def alibi(s, b, h, q_idx, kv_idx):
        return s - slopes[h] * (q_idx - kv_idx)  # standard ALiBi: penalise distant past keys

    result = recognize_score(alibi, 4)
    assert result.kind == "alibi", result.reason
    assert result.alibi_slopes == tuple(slopes.tolist())
    negative = recognize_score(lambda s, b, h, q, kv: s + slopes[h] * (q - kv), 4)
    assert negative.alibi_slopes == tuple((-slopes).tolist())


def test_alibi_with_slopes_float32_cannot_hold_is_other():
    slopes = torch.tensor([0.5, 1 / 3], dtype=torch.float64)
    result = recognize_score(lambda s, b, h, q, kv: s + slopes[h] * (kv - q), 2)
    assert result.kind == "other" and "not a float32 value" in result.reason


def test_softcap_is_fitted():
    result = recognize_score(lambda s, b, h, q, kv: 30.0 * torch.tanh(s / 30.0), 3)
    assert result.kind == "softcap" and result.softcap == pytest.approx(30.0, rel=1e-12)


@pytest.mark.parametrize("mod, words", [
    (lambda s, b, h, q, kv: s * 2, "does not saturate"),
    (lambda s, b, h, q, kv: s.clamp(-30, 30), "is not 30 * tanh"),
    (lambda s, b, h, q, kv: torch.where(q >= kv, s, s - 1), "depends on the position"),
    (lambda s, b, h, q, kv: s + b, "depends on the batch index"),
])
def test_other_scores_have_reasons(mod, words):
    result = recognize_score(mod, 2)
    assert result.kind == "other" and words in result.reason, result.reason
