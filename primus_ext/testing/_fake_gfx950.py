"""The gfx950 backends' kernel levels in the fake: where they live and whom they report to.

Upstream has, beside the public entries, ``primus_turbo.pytorch.kernels.attention`` with
FlyDSL's and HipKittens' ``_impl`` layers and ``primus_turbo.hipkittens.attention``
(Primus-Turbo at a6a16cd: ``attention_flydsl_impl.py``, ``attention_hipkittens_impl.py`` and
``hipkittens/attention/attention.py``).  `kernel_modules` builds the fake's versions (`._fake_flydsl`,
`._fake_hipkittens`) for `fake_primus_turbo` to install, and registers FlyDSL's
``torch.library`` ops once per process.  Their calls are recorded in the log of the fake of
the innermost ``with`` block (the one AITER's kernel-level ops report to, `._fake_kernels`).
"""

from __future__ import annotations

import types
from typing import Any, Callable

from ..backends.turbo_build import BUILD_A6A16CD, TurboBuild



def kernel_modules(root: Any, pytorch: Any, new_module: Callable[[str], types.ModuleType],
                   build: TurboBuild = BUILD_A6A16CD) -> dict[str, types.ModuleType]:
    """The kernel-level modules, keyed by name, hung on ``root`` (``primus_turbo``) and ``pytorch``
    (``primus_turbo.pytorch``): FlyDSL's and HipKittens' ``_impl`` layers under
    ``pytorch.kernels.attention``, HipKittens' own ``hipkittens.attention``."""
    from . import _fake_flydsl, _fake_hipkittens

    _fake_flydsl.register()
    base = f"{root.__name__}.pytorch.kernels"
    kernels, attention = new_module(base), new_module(f"{base}.attention")
    flydsl = _fake_flydsl.module(f"{base}.attention.attention_flydsl_impl", new_module, build)
    gates = _fake_flydsl.gate_module(f"{base}.attention.attention_impl", new_module, build)
    hk_impl = _fake_hipkittens.impl_module(f"{base}.attention.attention_hipkittens_impl", new_module)
    hk_root = new_module(f"{root.__name__}.hipkittens")
    hk_layer = _fake_hipkittens.layer_module(f"{root.__name__}.hipkittens.attention", new_module)
    pytorch.kernels, kernels.attention, root.hipkittens, hk_root.attention = kernels, attention, hk_root, hk_layer
    attention.attention_flydsl_impl, attention.attention_hipkittens_impl = flydsl, hk_impl
    attention.attention_impl = gates
    return {m.__name__: m for m in (kernels, attention, flydsl, gates, hk_impl, hk_root, hk_layer)}


__all__ = ["kernel_modules"]
