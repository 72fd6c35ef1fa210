"""A CPU stand-in for Primus-Turbo's attention entry points.

Primus-Turbo only builds on ROCm, yet the project's ``turbo`` backend must be
tested everywhere.  `fake_primus_turbo` puts modules named ``primus_turbo``,
``primus_turbo.pytorch``, ``primus_turbo.pytorch.ops`` and
``primus_turbo.pytorch.ops.attention`` into ``sys.modules`` for the duration of a
``with`` block, so ``import primus_turbo.pytorch.ops`` works and resolves to
entries that:

* have the real signatures (``inspect.signature`` shows the real parameters), so a
  backend that passes a keyword some build lacks gets the same ``TypeError``;
* apply the real kernels' and flex layer's checks, so wrong layouts, dtypes and
  boundaries fail on CPU the way they would fail on the GPU;
* compute with their own blockwise math (`._fake_math`), independent of the reference
  backend's, so outputs and gradients are exact up to rounding;
* record calls, so tests can assert *which* kernel got *which* arguments: the most
  recent `log_size` calls in full, and every call in counters per entry and kernel
  backend (`FakeTurbo.count`), so memory stays flat however long a run is.

While a fake is installed, AITER's kernel-level ops
(``torch.ops.primus_turbo.attention_aiter_{,varlen_}{forward,backward}_impl``, real
argument names, the backward's undeclared ``dsink``/``dbias`` writes included) run on
the fake's math too and are recorded like the entries (`._fake_kernels`), and so do the
gfx950 backends' kernel levels under their upstream module names: FlyDSL's ops and
``_impl`` wrappers (``primus_turbo.pytorch.kernels.attention.attention_flydsl_impl``,
`._fake_flydsl`) and HipKittens' layer and ``_impl`` wrappers (``primus_turbo.hipkittens.attention``,
``...kernels.attention.attention_hipkittens_impl``, `._fake_hipkittens`).

The keyword knobs pick which build is imitated, because the project must adapt to
each by inspecting signatures rather than version strings::

    with fake_primus_turbo(flex_deterministic=False) as fake:
        out = backend(q, k, v)
        assert fake.calls_to("flex_attention_bshd")

``faults`` opts into known silent defects of real builds (see `FAULTS`), so a test can
show that the project would notice one.

``arch`` ("gfx942" | "gfx950") models Primus-Turbo's per-arch kernel dispatch
(`._fake_dispatch`): calls no backend takes raise as on the GPU, and a backend's known
silent defect is reproduced whether or not ``faults`` asks for it.  The arch is also
presented as the device's (`primus_ext.backends.arch`), so ``turbo_arch: auto`` plans
for it as it would on that GPU.  Left None, nothing about kernel backends is modelled
(so float64 inputs keep working).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.machinery
import inspect
import sys
import types
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional

from ..backends.arch import presenting
from ..backends.turbo_build import TurboBuild, build_named
from . import _fake_backend_manager, _fake_gfx950, _fake_kernels
from ._call_log import DEFAULT_CAPACITY, CallLog
from ._fake_dispatch import DISPATCHED, Dispatcher, check_arch
from ._fake_entries import Body, dense_flash, flex_dense, flex_varlen, varlen_flash
from ._fake_math import CORRUPT_OUTPUT, FAULTS, SINK_BACKWARD_IGNORES_RIGHT_WINDOW, check_faults, corrupt_output
from ._fake_masks import MaskClassifier

_ROOT = "primus_turbo"
_PACKAGES = (_ROOT, f"{_ROOT}.pytorch", f"{_ROOT}.pytorch.ops", f"{_ROOT}.pytorch.ops.attention")

_POS = inspect.Parameter.POSITIONAL_OR_KEYWORD
_KW = inspect.Parameter.KEYWORD_ONLY
_REQUIRED = inspect.Parameter.empty

# Parameter lists copied from the reference contract; ``(name, default)``.
_QKV = [("q", _REQUIRED), ("k", _REQUIRED), ("v", _REQUIRED)]
_VARLEN_BOUNDS = [("cu_seqlens_q", _REQUIRED), ("cu_seqlens_k", _REQUIRED),
                  ("max_seqlen_q", _REQUIRED), ("max_seqlen_k", _REQUIRED)]
_FLASH_TAIL = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False),
               ("window_size", (-1, -1)), ("bias", None), ("alibi_slopes", None),
               ("deterministic", False), ("return_lse", False), ("return_attn_probs", False)]
_SINK = [("sink", None)]
_FP8 = [("fp8_config", None)]
_GROUPS = [("ulysses_group", None), ("ring_group", None)]
_FLEX_DENSE = [("query", _REQUIRED), ("key", _REQUIRED), ("value", _REQUIRED),
               ("score_mod", None), ("block_mask", None), ("scale", None),
               ("enable_gqa", False), ("return_lse", False), ("kernel_options", None),
               ("alibi_slopes", None), ("softcap", None), ("dropout_p", 0.0),
               ("sink", None), ("bias", None)]
_FLEX_VARLEN_POS = [("query", _REQUIRED), ("key", _REQUIRED), ("value", _REQUIRED)] + _VARLEN_BOUNDS
_FLEX_VARLEN_KW = [("causal", False), ("window_size", (-1, -1)), ("scale", None),
                   ("alibi_slopes", None), ("dropout_p", 0.0), ("sink", None),
                   ("softcap", None), ("return_lse", False)]
_DETERMINISTIC = [("deterministic", False)]


def _signature(positional: list[tuple[str, Any]],
               keyword_only: Optional[list[tuple[str, Any]]] = None) -> inspect.Signature:
    params = [inspect.Parameter(n, _POS, default=d) for n, d in positional]
    params += [inspect.Parameter(n, _KW, default=d) for n, d in keyword_only or []]
    return inspect.Signature(params)


@dataclass(frozen=True)
class BuildOptions:
    """Which Primus-Turbo build the fake imitates (see `fake_primus_turbo`)."""

    flex_bshd: bool = True
    flex_deterministic: bool = True
    varlen_sink: bool = True
    flex: bool = True
    faults: tuple[str, ...] = ()
    """Known silent defects the fake reproduces; each one of `FAULTS`."""
    arch: Optional[str] = None
    """The GPU arch whose kernel dispatch is modelled ("gfx942" | "gfx950"); None: none is."""
    kernels: str = "a6a16cd"
    """The kernel build imitated (`primus_ext.backends.turbo_build.BUILDS`): its dispatcher's gates and
    the signatures of its kernel layer (``_gqa_group_ok``, FlyDSL's backward ``deterministic``, Gluon)."""

    @property
    def build(self) -> TurboBuild:
        return build_named(self.kernels)


def entry_signatures(options: BuildOptions) -> dict[str, inspect.Signature]:
    """The attention entries a build with ``options`` has, with their signatures."""
    flash = _QKV + _FLASH_TAIL
    varlen = _QKV + _VARLEN_BOUNDS + _FLASH_TAIL
    sigs = {
        "flash_attn_func": _signature(flash + _SINK),
        "flash_attn_varlen_func": _signature(varlen + (_SINK if options.varlen_sink else [])),
        "flash_attn_fp8_func": _signature(flash + _FP8),
        "flash_attn_usp_func": _signature(flash + _GROUPS + [("qkv_format", None)]),
        "flash_attn_varlen_usp_func": _signature(varlen + _GROUPS),
        "flash_attn_fp8_usp_func": _signature(flash + _FP8 + _GROUPS),
    }
    if options.flex:
        det = _DETERMINISTIC if options.flex_deterministic else []
        sigs["flex_attention"] = _signature(_FLEX_DENSE + det)
        if options.flex_bshd:
            sigs["flex_attention_bshd"] = _signature(_FLEX_DENSE + det)
        sigs["flex_attention_varlen"] = _signature(_FLEX_VARLEN_POS, _FLEX_VARLEN_KW + det)
        sigs["create_block_mask"] = _signature(
            [("mask_mod", _REQUIRED), ("B", _REQUIRED), ("H", _REQUIRED), ("Q_LEN", _REQUIRED),
             ("KV_LEN", _REQUIRED), ("device", "cpu"), ("BLOCK_SIZE", 128), ("_compile", False)]
        )
    return sigs


def _create_block_mask(a: dict[str, Any], _classify: MaskClassifier) -> Any:
    """torch's own BlockMask, built eagerly (no compile) so it works on CPU."""
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(a["mask_mod"], a["B"], a["H"], a["Q_LEN"], a["KV_LEN"],
                             device=a["device"], BLOCK_SIZE=a["BLOCK_SIZE"], _compile=False)


_BODIES: dict[str, Callable[..., Body]] = {
    "flash_attn_func": dense_flash,
    "flash_attn_varlen_func": varlen_flash,
    "flash_attn_fp8_func": functools.partial(dense_flash, fp8=True),
    "flash_attn_usp_func": dense_flash,
    "flash_attn_varlen_usp_func": varlen_flash,
    "flash_attn_fp8_usp_func": functools.partial(dense_flash, fp8=True),
    "flex_attention": functools.partial(flex_dense, layout="bhsd"),
    "flex_attention_bshd": functools.partial(flex_dense, layout="bshd"),
    "flex_attention_varlen": flex_varlen,
    "create_block_mask": lambda _name, **_: _create_block_mask,
}


@dataclass(frozen=True)
class Call:
    """One recorded call: entry name and its bound arguments, defaults applied.

    Tensors are the very objects the caller passed, so tests can check identity,
    strides (``is_contiguous()``) and dtypes of what reached the kernel.
    """

    entry: str
    args: dict[str, Any]
    backend: Optional[str] = None
    """The kernel backend that took the call (FlyDSL, AITER, HipKittens), also when it then
    refused it; None when no arch is set, for entries that are not dispatched (fp8, usp), for
    calls no backend takes, and for calls that raised before the dispatch."""


class FakeTurbo:
    """Handle on an installed fake: its module, the call log and the probe counter."""

    def __init__(self, options: BuildOptions, log_size: int = DEFAULT_CAPACITY) -> None:
        self.options = options
        self.calls = CallLog(log_size)
        """The most recent calls (a bounded ring) and counters of all of them (`CallLog`)."""
        self._classifier = MaskClassifier()
        self.signatures = entry_signatures(options)
        self.module = self._build_module()

    @property
    def probe_count(self) -> int:
        """How many BlockMask classifications actually probed a mask_mod.

        Repeated calls with the same BlockMask object and shapes are memoised and do
        not add to it, which is what lets a test prove that BlockMasks are reused.
        """
        return self._classifier.probe_count

    def reset(self) -> None:
        """Forget recorded calls and their counters and zero `probe_count`; the classification
        memo stays, as it does in a real process."""
        self.calls.clear()
        self._classifier.probe_count = 0

    def record(self, entry: str, args: dict[str, Any], backend: Optional[str] = None) -> None:
        """Log a call made outside the entries (the kernel-level ops of `._fake_kernels`)."""
        self.calls.append(Call(entry, args, backend))

    def count(self, entry: str, backend: Optional[str] = None) -> int:
        """How many calls ``entry`` got since the last `reset` (taken by ``backend``, if given),
        counting those the bounded log no longer keeps."""
        if backend is None:
            return self.calls.by_entry[entry]
        return self.calls.by_backend[(entry, backend)]

    def calls_to(self, entry: str) -> list[Call]:
        """The recorded calls of one entry, in call order."""
        return [c for c in self.calls if c.entry == entry]

    def _entry(self, name: str, signature: inspect.Signature) -> Callable[..., Any]:
        record = self.calls
        current: list[Any] = [None]  # the call running now

        def ran_on(backend: str) -> None:
            record.set_backend(current[0], backend)

        routed = {}
        if self.options.arch is not None and name in DISPATCHED:
            routed["dispatch"] = Dispatcher(self.options.arch, ran_on, self.options.build)
        body = _BODIES[name](name, faults=self.options.faults, **routed)
        classifier = self._classifier
        corrupted = {backend for fault, backend in CORRUPT_OUTPUT.items() if fault in self.options.faults}

        def entry(*args: Any, **kwargs: Any) -> Any:
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError as exc:
                raise TypeError(f"{name}() {exc}") from None
            bound.apply_defaults()
            arguments = dict(bound.arguments)
            current[0] = Call(name, arguments)
            record.append(current[0])
            try:
                result = body(arguments, classifier)
                return corrupt_output(result) if current[0].backend in corrupted else result
            finally:
                current[0] = None  # only the log keeps a call (and its tensors) alive

        entry.__name__ = entry.__qualname__ = name
        entry.__module__ = _PACKAGES[-1]
        entry.__doc__ = f"CPU fake of primus_turbo.pytorch.ops.attention.{name}."
        entry.__signature__ = signature  # type: ignore[attr-defined]
        return entry

    def _build_module(self) -> types.ModuleType:
        module = _new_module(_PACKAGES[-1])
        for name, signature in self.signatures.items():
            setattr(module, name, self._entry(name, signature))
        module.__all__ = sorted(self.signatures)  # type: ignore[attr-defined]
        return module

    def install(self) -> dict[str, types.ModuleType]:
        """The fake modules, keyed by name, ready for ``sys.modules``."""
        root, pytorch, ops = (_new_module(n) for n in _PACKAGES[:3])
        root.__version__ = "0.0.0+cpu.fake"  # type: ignore[attr-defined]
        root.pytorch = pytorch  # type: ignore[attr-defined]
        pytorch.ops = ops  # type: ignore[attr-defined]
        ops.attention = self.module  # type: ignore[attr-defined]
        for name in self.signatures:  # re-exported one level up, as upstream does
            setattr(ops, name, getattr(self.module, name))
        core = _new_module(f"{_ROOT}.pytorch.core")
        backend = _fake_backend_manager.module(f"{_ROOT}.pytorch.core.backend", gluon=self.options.build.gluon)
        pytorch.core, core.backend = core, backend  # type: ignore[attr-defined]
        _fake_backend_manager.GlobalBackendManager.reset()  # a fresh process: no backend set in code
        return {**dict(zip(_PACKAGES, (root, pytorch, ops, self.module))), core.__name__: core,
                backend.__name__: backend, **_fake_gfx950.kernel_modules(root, pytorch, _new_module,
                                                                             self.options.build)}


def _new_module(name: str) -> types.ModuleType:
    """A package-like module with a spec, so importlib.util.find_spec() sees it."""
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    module.__path__ = []  # type: ignore[attr-defined]
    module.__fake_primus_turbo__ = True  # type: ignore[attr-defined]
    return module


def _owned(key: str) -> bool:
    return key == _ROOT or key.startswith(_ROOT + ".")


BUILDS: dict[str, dict[str, bool]] = {
    # Primus-Turbo main (v0.4.0-26) and the commit Primus pins: no flex entries; varlen sinks.
    "main": dict(flex=False, flex_bshd=False, flex_deterministic=False, varlen_sink=True),
    # Builds before varlen sinks: neither flex entries nor `sink` on flash_attn_varlen_func.
    "old": dict(flex=False, flex_bshd=False, flex_deterministic=False, varlen_sink=False),
    # The unmerged flex compat layer, first without `deterministic` and flex_attention_bshd.
    "flex": dict(flex=True, flex_bshd=False, flex_deterministic=False, varlen_sink=True),
    "flex-deterministic": dict(flex=True, flex_bshd=False, flex_deterministic=True, varlen_sink=True),
    # The newest flex layer: deterministic and the layout-native flex_attention_bshd.
    "newest": dict(flex=True, flex_bshd=True, flex_deterministic=True, varlen_sink=True),
}
"""The Primus-Turbo builds users have, as knob settings: "main" is a6a16cd (flash_attn_varlen_func takes
``sink``, flash_attn_interface.py l.763-780), "old" is v0.4.0 (it does not), "flex" is PR #472's head 9ee6421
(flex_attention.py, no ``deterministic``); the last two have no upstream commit to cite."""


@contextlib.contextmanager
def fake_primus_turbo(*, flex_bshd: bool = True, flex_deterministic: bool = True,
                      varlen_sink: bool = True, flex: bool = True,
                      faults: Iterable[str] = (), arch: Optional[str] = None,
                      build: Optional[str] = None, log_size: int = DEFAULT_CAPACITY,
                      kernels: str = "a6a16cd") -> Iterator[FakeTurbo]:
    """Install the fake Primus-Turbo modules for the ``with`` block; yield the `FakeTurbo`.

    Knobs select the build imitated: ``flex=False`` is an old build without any flex
    entry (nor ``create_block_mask``); ``flex_bshd=False`` lacks ``flex_attention_bshd``;
    ``flex_deterministic=False`` lacks ``deterministic`` on the flex entries;
    ``varlen_sink=False`` lacks ``sink`` on ``flash_attn_varlen_func``.  ``build`` names a
    build that exists instead (`BUILDS`: ``main``, ``old``, ``flex``, ``flex-deterministic``,
    ``newest``) and then sets all four knobs.

    ``faults`` (default none) switches on known silent defects, one per kernel backend
    (`FAULTS`): ``"sink_backward_ignores_right_window"`` (AITER: its sink path runs Triton
    kernels whose backward takes only the left window edge, so with a sink and a right
    window bound > 0 the forward is right and the gradients are computed as if the right
    bound were -1); ``"flydsl_narrow_window_backward_nan"`` (FlyDSL's kernel-level backward
    with a left window below 64 returns NaN dQ; with an arch set it always does);
    ``"hipkittens_forward_skips_rows_above_skv"`` (HipKittens' check lets ``Sq > Skv``
    through and its forward leaves the leading rows unwritten).  Injected faults, for testing a
    harness: ``"aiter_corrupt_output"``, ``"flydsl_corrupt_output"``,
    ``"hipkittens_corrupt_output"`` negate the last head of every entry call that backend takes
    (with an arch set).  Unknown names are a ``ValueError``.

    ``arch`` ("gfx942" | "gfx950"; default None, no dispatch modelled) makes
    ``flash_attn_func``, ``flash_attn_varlen_func`` and the flex entries pick a kernel
    backend per call from the call's actual dtype, shapes, window, sink, dropout, bias,
    ALiBi, ``deterministic``, document lengths and strides, with the project's dispatch
    model (`primus_ext.backends.dispatch.route`).  A call no backend takes raises
    ``ValueError("No compatible backend found for FlashAttn{Dense,Varlen}Dispatcher with
    inputs: ...")``; one the chosen backend refuses raises what it raises
    (``AssertionError`` for AITER's deterministic + sink, ``ValueError`` for its sink
    head-dim check).  A call hitting a known silent defect of its backend (AITER's sink
    backward ignoring the window's right bound) gets the defect applied automatically, as
    if its fault were listed in ``faults``: the real library is silently wrong there, and
    the fake must never be kinder than it.  `Call.backend` records which backend ran.

    ``kernels`` names the kernel build imitated (``a6a16cd``, or ``pt509``: a6a16cd with PT #509, #480,
    #469 and #481 merged; `primus_ext.backends.turbo_build.BUILDS`): FlyDSL's GQA gate, its backward's
    ``deterministic`` argument and the Gluon backend follow it, as do the signatures that tell them apart.

    ``log_size`` bounds the call log (`FakeTurbo.calls` keeps the most recent calls, and
    `FakeTurbo.count` counts all of them), so a long run on the fake keeps no more than
    that many calls' tensors alive.

    Every ``primus_turbo*`` entry of ``sys.modules`` present before is put back on
    exit, also when the block raises, and any added inside the block is dropped.
    """
    if build is not None:
        if build not in BUILDS:
            raise ValueError(f"build must be one of {sorted(BUILDS)}, got {build!r}")
        flex, flex_bshd = BUILDS[build]["flex"], BUILDS[build]["flex_bshd"]
        flex_deterministic, varlen_sink = BUILDS[build]["flex_deterministic"], BUILDS[build]["varlen_sink"]
    fake = FakeTurbo(BuildOptions(flex_bshd=flex_bshd, flex_deterministic=flex_deterministic,
                                  varlen_sink=varlen_sink, flex=flex,
                                  faults=tuple(sorted(check_faults(faults))), arch=check_arch(arch),
                                  kernels=build_named(kernels).name),
                     log_size=log_size)
    saved = {k: v for k, v in sys.modules.items() if _owned(k)}
    for key in saved:
        del sys.modules[key]
    sys.modules.update(fake.install())
    _fake_kernels.activate(fake)
    try:
        with presenting(fake.options.arch):  # what `turbo_arch: auto` reads on that device
            yield fake
    finally:
        _fake_kernels.deactivate(fake)
        for key in [k for k in sys.modules if _owned(k)]:
            del sys.modules[key]
        sys.modules.update(saved)


__all__ = ["BuildOptions", "Call", "FAULTS", "FakeTurbo", "SINK_BACKWARD_IGNORES_RIGHT_WINDOW",
           "entry_signatures", "fake_primus_turbo"]
