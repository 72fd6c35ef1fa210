"""What a flex hook captures, as the BlockMask cache and the learned-table rules see it (found by review).

* Writes that bump no version counter (``.data``, numpy, the storage) to a small captured tensor rebuild the
  BlockMask: such tensors are also compared by value.
* Equal values are stamped each time they are read (a list ``[4, 4, 40] -> [4, 40, 40]``, globals
  ``(0, 0, 40) -> (0, 40, 40)``), not once per object (small ints are one object).
* A user package whose name merely begins like a skipped one (``torchy``, ``mathy``) is walked.
* A learned table behind an ``nn.Module``, a ``functools.partial`` or a callable instance is found.
"""

from __future__ import annotations

import functools
import sys
import types

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from primus_ext.attention import masks
from primus_ext.backends.flex import FlexBackend
from primus_ext.backends.flex_cache import BlockMaskCache
from primus_ext.backends.flex_masks import captured_state, learned_tensors, same_state

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
S = 48
IDS = torch.tensor([0] * 10 + [1] * 14 + [2] * 24)
ROWS = [4, 4, 40]
A, B, C = 0, 0, 40


def by_ids(b, h, q_idx, kv_idx):
    return (IDS[q_idx] == IDS[kv_idx]) & (kv_idx <= q_idx)


def by_list(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (q_idx - kv_idx <= ROWS[1])


def by_globals(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) | (kv_idx < B + A * C)


def _masks(hook, change):
    """The cached BlockMask before and after ``change()``, and a fresh one built after it."""
    cache = BlockMaskCache()
    backend = FlexBackend(block_masks=cache, block_size=16)
    build = lambda: backend.block_mask(hook, None, None, S, S, torch.device("cpu"), captured_state(hook))  # noqa: E731
    build()
    change()
    got = build()
    fresh = create_block_mask(hook, None, None, S, S, device="cpu", BLOCK_SIZE=16)
    return cache, got, fresh


WRITES = {
    ".data.copy_": lambda t, new: t.data.copy_(new),
    "numpy": lambda t, new: t.numpy().__setitem__(slice(None), new.numpy()),
    "storage": lambda t, new: t.untyped_storage().copy_(new.untyped_storage()),
}


@pytest.mark.parametrize("how", sorted(WRITES))
def test_a_write_behind_the_version_counter_rebuilds(how):
    saved = IDS.clone()
    try:
        cache, got, fresh = _masks(by_ids, lambda: WRITES[how](IDS, torch.arange(S) // 6))
        assert cache.builds == 2
        assert torch.equal(got.to_dense(), fresh.to_dense())
    finally:
        IDS.copy_(saved)


def test_equal_values_are_each_stamped():
    saved = list(ROWS)
    try:
        cache, got, fresh = _masks(by_list, lambda: ROWS.__setitem__(slice(None), [4, 40, 40]))
        assert cache.builds == 2 and torch.equal(got.to_dense(), fresh.to_dense())
    finally:
        ROWS[:] = saved
    before = captured_state(by_globals)
    module = sys.modules[__name__]
    module.B = 40
    try:
        assert not same_state(before, captured_state(by_globals))
    finally:
        module.B = 0


def test_a_package_named_like_a_skipped_one_is_walked():
    module = types.ModuleType("torchy_masks")
    exec("PREFIX = 0\ndef prefix(b, h, q_idx, kv_idx):\n    return (kv_idx <= q_idx) | (kv_idx < PREFIX)\n",
         module.__dict__)
    sys.modules["torchy_masks"] = module
    try:
        before = captured_state(module.prefix)
        module.PREFIX = 40
        assert not same_state(before, captured_state(module.prefix))
    finally:
        del sys.modules["torchy_masks"]


class _Table(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.table = torch.nn.Parameter(torch.zeros(16))


class _Lookup:
    def __init__(self):
        self.table = torch.zeros(16, requires_grad=True)

    def __call__(self, d):
        return self.table[d]


MODULE, LOOKUP = _Table(), _Lookup()
PARTIAL = functools.partial(torch.index_select, torch.zeros(16, requires_grad=True), 0)


def via_module(score, b, h, q_idx, kv_idx):
    return score + MODULE.table[(q_idx - kv_idx).clamp(0, 15)]


def via_instance(score, b, h, q_idx, kv_idx):
    return score + LOOKUP((q_idx - kv_idx).clamp(0, 15))


def via_partial(score, b, h, q_idx, kv_idx):
    return score + PARTIAL((q_idx - kv_idx).clamp(0, 15).reshape(1))[0]


@pytest.mark.parametrize("hook", [via_module, via_instance, via_partial], ids=lambda f: f.__name__)
def test_a_learned_table_behind_an_object_is_found(hook):
    assert learned_tensors(hook) == 1


# -- what a hook is, not what it is named (issue: a `functools.wraps` wrapper of a library mask inherited
# primus_ext's __module__, the cache skipped its globals, and a changed global reused the old BlockMask)
WIDTH = 4


@functools.wraps(masks.causal())
def wrapped_band(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (q_idx - kv_idx <= WIDTH)


def test_a_hook_wrapped_like_a_library_mask_is_walked_by_its_own_globals():
    assert wrapped_band.__module__ == "primus_ext.attention.masks"  # what functools.wraps copied
    module = sys.modules[__name__]
    cache, got, fresh = _masks(wrapped_band, lambda: setattr(module, "WIDTH", 20))
    try:
        assert cache.builds == 2
        assert torch.equal(got.to_dense(), fresh.to_dense())
    finally:
        module.WIDTH = 4


def test_a_function_named_like_a_torch_call_wrapper_is_not_unwrapped():
    """The flex backend runs the user's hook behind `as_torch_calls`'s own wrappers (known by code object); a
    function that merely says so by name and ``__wrapped__`` runs as itself."""
    from primus_ext.backends.flex_masks import user_hook
    from primus_ext.hooks.crosscheck import as_torch_calls

    def impostor(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    impostor.__qualname__ = "as_torch_calls.<locals>.mask_mod"
    impostor.__wrapped__ = wrapped_band
    assert user_hook(impostor, "mask_mod") is impostor
    assert user_hook(as_torch_calls(wrapped_band, "mask_mod"), "mask_mod") is wrapped_band


def test_a_class_or_object_saying_it_is_torchs_is_not_trusted_as_code():
    from primus_ext.hooks.trace import _is_code

    class Pretends:
        __module__ = "torch.nn"

        def __call__(self, x):
            return x

    assert not _is_code(Pretends())
    assert _is_code(torch.ops.aten.add.Tensor) and _is_code(torch.where)


BIG = torch.zeros(8192)


def by_big_table(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) | (kv_idx - q_idx < BIG[0])


@pytest.mark.parametrize("how", sorted(WRITES))
def test_a_large_captured_tensor_written_behind_its_version_counter_rebuilds(how):
    """Regression: past the old 4096-element snapshot bound a write through .data or numpy was unseen and the
    cache served the causal BlockMask for a now full mask (0.96 off on a block-sparse kernel)."""
    saved = BIG.clone()
    try:
        new = BIG.clone()
        new[0] = 100000.0
        cache, got, fresh = _masks(by_big_table, lambda: WRITES[how](BIG, new))
        assert cache.builds == 2
        assert torch.equal(got.to_dense(), fresh.to_dense())
    finally:
        BIG.copy_(saved)


def test_a_tensor_too_large_to_watch_is_volatile_and_no_proof_rests_on_it():
    from primus_ext.hooks.proof import prove_mask
    from primus_ext.hooks.trace import SNAPSHOT_MAX

    huge = torch.zeros(SNAPSHOT_MAX + 1)

    def reads_huge(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) | (kv_idx - q_idx < huge[0])

    assert ("volatile",) in captured_state(reads_huge)
    assert not same_state(captured_state(reads_huge), captured_state(reads_huge))
    proof = prove_mask(reads_huge, num_heads=4)
    assert proof.pattern is None and "too large to watch" in proof.reason
