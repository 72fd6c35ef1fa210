"""On-device self-test (B33): run each distinct route once against the exact backend.

A plan says what a layer computes; the self-test checks, on the machine that will
train, that the installed Primus-Turbo computes it.  Each distinct route (pattern, sink,
ALiBi, dense or packed, head shape) runs once forward and backward on its Turbo path and on
the ``reference`` backend on the same device, and any disagreement refuses the build naming
the route.  To reach the kernels the layer's own calls reach, the inputs are what the layer
hands them: megatron-core's storage (the fused QKV projection split into q, k and v, so value
is a strided view), stored as the plan decides (`AttentionPlan.storage`, the same function as
the modules), in the model's dtype, long enough to reach past the widest window, and for
packed calls each document split the dispatch model tells apart (equal lengths, which FlyDSL
takes, and unequal ones).  Results are kept per process, keyed by everything that decides the
kernel (route, arch, selection, storage, dtype, length, split, pinned backend), so a model of
many layers with one pattern pays for one test.  Under autotune (`Selection.autotune`, no pin)
any backend that takes a call may run it, so each route runs once per candidate the dispatch
model names (`Route.candidates`), pinned for that run through the installed build's
``GlobalBackendManager.set_attn_backend`` and restored after (`pinned_backend`).  On CPU it runs
against whatever ``primus_turbo`` is importable (the CPU fake in tests).  A plan on the ``flex``
backend (torch's FlexAttention) has its routes tested alike, through the layer's adapter, with its
hooks; on the CPU with torch's kernel forward only (no CPU backward): `primus_ext.call.selftest_flex`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import time
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from ..attention.pattern import pattern_from_flash_args
from ..backends import make_backend
from .adapter import TurboFlexAttention
from ..backends.base import CallArgs
from ..backends.direct import DirectRunner, choose_direct
from ..backends.dispatch import ARCHES, DENSE, VARLEN, CallFeatures, Selection, default_scale
from ..backends.dispatch import route as dispatch_route
from ..backends.flex import FlexBackend
from ..backends.layout import kernel_views, storage_features, thd_views
from ..backends.turbo import load_ops
from .. import refusals as R
from ..plan.plan import AttentionPlan
from . import selftest_flex as flex_test
from .selftest_result import TOLERANCE, RouteResult
from .selftest_shared_prefix import shared_prefix_route

MIN_SEQ = 64
_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}


_DONE: dict[tuple, RouteResult] = {}


def seq_length(plan: AttentionPlan) -> int:
    """Long enough that every window bound is reached from both ends (a window of 128 is not causal
    on 64 tokens), a multiple of 16; a hook plan's own ``seq_length`` where known (its hooks may index
    captured per-token tensors)."""
    if (plan.mask_mod is not None or plan.score_mod is not None) and plan.seq_length:
        return int(plan.seq_length)
    bounds = [b for b in (plan.window + ((plan.pattern.left, plan.pattern.right) if plan.pattern else ())) if b > 0]
    reach = 2 * max(bounds, default=0) + 16
    return max(MIN_SEQ, -(-reach // 16) * 16)


def splits(plan: AttentionPlan, packed: bool, seq: int) -> list[Optional[tuple[int, ...]]]:
    """The document splits of a packed route: one document and equal lengths (FlyDSL's varlen gate reads
    each call's boundaries and takes both), and unequal ones unless the plan promises equal documents."""
    if not packed:
        return [None]
    single, equal = (0, seq), (0, seq // 2, seq)
    return [single, equal] if getattr(plan, "equal_documents", False) else [single, equal, (0, seq // 4, seq)]


def _key(plan: AttentionPlan, packed: bool, device: torch.device, dtype: torch.dtype, seq: int,
         split: Optional[tuple[int, ...]], pinned: Optional[str] = None,
         flex: Optional[FlexBackend] = None) -> tuple:
    return (plan.path, plan.backend, plan.pattern if not packed else plan.window, plan.causal, plan.window, plan.sink,
            plan.alibi_slopes, plan.num_heads, plan.num_kv_heads, plan.head_dim, plan.head_dim_v, plan.scale,
            plan.deterministic, plan.mask_hook, plan.score_hook, packed, str(device), dtype, plan.arch,
            plan.selection, plan.storage, seq, split, pinned) + flex_test.key_part(plan, device, flex)


def _describe(plan: AttentionPlan, packed: bool, split: Optional[tuple[int, ...]], dtype: torch.dtype,
              pinned: Optional[str] = None) -> str:
    inside = pattern_from_flash_args(plan.causal, plan.window).describe()
    kind = f"{plan.path} {'packed' if packed else 'dense'}"
    what = f"{kind}: {plan.pattern_text if not packed else inside}"
    if flex_test.on_flex(plan):  # named apart from a Turbo route, with the hooks it runs
        what = f"{kind} on FlexAttention: {flex_test.mask_text(plan, packed, inside)}"
    extras = [x for x, on in (("sink", plan.sink), ("ALiBi", plan.alibi_slopes is not None)) if on]
    if split is not None:
        extras.append(f"documents {list(split)}")
    extras.append(str(dtype).replace("torch.", ""))
    pin = f", pinned {pinned} (autotune candidate)" if pinned else ""
    return what + ", " + ", ".join(extras) + f", heads {plan.num_heads}/{plan.num_kv_heads}" + pin


def megatron_qkv(fused: torch.Tensor, plan: AttentionPlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as megatron-core's SelfAttention passes them (attention.py l.1458-1463 in 0.16.1), from
    the fused projection ``[..., Hkv, (G + 2) * D]``: split along the last dim, q reshaped (a copy),
    k through RoPE (a copy), v the strided split view."""
    group, d, dv = plan.num_heads // plan.num_kv_heads, plan.head_dim, plan.head_dim_v
    query, key, value = fused.split([group * d, d, dv], dim=-1)
    return query.reshape(*fused.shape[:-2], plan.num_heads, d), key.contiguous(), value


def _inputs(plan: AttentionPlan, packed: bool, device: torch.device, dtype: torch.dtype, seq: int):
    """``(fused, views, grad, sink)``: the fused projection (the leaf of both runs), the function giving
    the kernel's q, k, v from it as the layer would, the upstream gradient and the sink."""
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)

    group = plan.num_heads // plan.num_kv_heads
    lead = (seq,) if packed else (seq, 2)  # thd [T, 1, H, D] squeezed, or Megatron's sbhd
    fused = rand(*lead, plan.num_kv_heads, group * plan.head_dim + plan.head_dim + plan.head_dim_v)
    if packed:
        views = lambda f: thd_views(*megatron_qkv(f, plan), plan.storage)  # noqa: E731
        grad = rand(seq, plan.num_heads, plan.head_dim_v)
    else:
        views = lambda f: kernel_views(*megatron_qkv(f, plan), plan.storage)  # noqa: E731
        grad = rand(2, seq, plan.num_heads, plan.head_dim_v)
    sink = rand(plan.num_heads).float() if plan.sink else None
    return fused, views, grad, sink


def _run(call, fused, views, grad, sink, backward: bool = True):
    """One forward and backward (``backward`` False: a forward without gradients, and no grads) from a
    fresh leaf of the fused projection: q, k, v keep the layouts the layer gives the kernels, and their
    gradients arrive in the projection's."""
    if not backward:
        with torch.no_grad():
            return call(*views(fused), sink).detach(), []
    leaf = fused.detach().clone().requires_grad_(True)
    sink_leaf = sink.detach().clone().requires_grad_(True) if sink is not None else None
    out = call(*views(leaf), sink_leaf)
    (out.float() * grad.float()).sum().backward()
    grads = [leaf.grad] + ([sink_leaf.grad] if sink_leaf is not None else [])
    return out.detach(), grads


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = float(want.detach().abs().max().float()) + 1e-6
    return float((got.detach().float() - want.detach().float()).abs().max()) / scale


def _calls(plan: AttentionPlan, packed: bool, split: Optional[tuple[int, ...]], backend=None):
    """``(turbo call, reference call)`` taking ``(q, k, v, sink)``; a flex-path plan's through its adapter
    over ``backend`` (None: the plan's, `make_backend`)."""
    reference = TurboFlexAttention(dataclasses.replace(plan, path="flex", backend="reference"),
                                   make_backend("reference"))
    bounds = split or (0, 1)
    cu = torch.tensor(bounds, dtype=torch.int32)
    longest = max(b - a for a, b in zip(bounds, bounds[1:]))
    flash = dict(causal=plan.causal, window_size=plan.window) if plan.mask_mod is None else {}

    def through(layer):
        if packed:
            return lambda q, k, v, s: layer.varlen(q, k, v, cu.to(q.device), cu.to(q.device), longest, longest,
                                                   sink=s, **flash)
        return lambda q, k, v, s: layer(q, k, v, sink=s, **flash)

    if plan.flex:
        return through(TurboFlexAttention(plan, backend)), through(reference)
    runner = DirectRunner(load_ops(), choose_direct(load_ops(), fp8=False, context_parallel=False))

    def direct(q, k, v, s):
        c = cu.to(q.device) if packed else None
        lengths = (longest, longest) if packed else (q.shape[1], k.shape[1])
        return runner.run(CallArgs(q, k, v, c, c, *lengths, s, None, None, plan.causal, plan.window, plan.scale, 0.0,
                                   plan.deterministic))
    return direct, through(reference)


def _call_features(plan: AttentionPlan, packed: bool, split: Optional[tuple[int, ...]],
                   dtype: torch.dtype) -> CallFeatures:
    """The self-test's Turbo call as upstream's dispatcher reads it: the same storage (from the
    layer's own views), dtype, heads, mask and document split."""
    seq = seq_length(plan)
    fused, views, _, _ = _inputs(plan, packed, torch.device("cpu"), dtype, seq)
    flash = pattern_from_flash_args(plan.causal, plan.window)
    common: dict[str, Any] = dict(
        arch=plan.arch, dtype=_DTYPE_NAMES.get(dtype, str(dtype)), head_dim=plan.head_dim,
        head_dim_v=plan.head_dim_v, heads=plan.num_heads, kv_heads=plan.num_kv_heads, sink=plan.sink,
        dropout=0.0, alibi=plan.alibi_slopes is not None, deterministic=plan.deterministic,
        default_scale=default_scale(plan.scale, plan.head_dim))
    equal = lambda b: len({y - x for x, y in zip(b, b[1:])}) <= 1  # noqa: E731
    pattern = plan.pattern if plan.flex and not packed and plan.pattern is not None else flash
    if packed or pattern.documents:  # a flex documents mask reaches the varlen kernel
        bounds = split or pattern.at_length(seq).boundaries or (0, seq)
        return CallFeatures(entry=VARLEN, causal=pattern.right == 0, window=pattern.window,
                            equal_documents=equal(bounds), **common)
    _, sbhd, contiguous_sbhd, contiguous_bshd = storage_features(*views(fused))
    return CallFeatures(entry=DENSE, causal=pattern.right == 0, window=pattern.window, sbhd_storage=sbhd,
                        contiguous_sbhd=contiguous_sbhd, contiguous_bshd=contiguous_bshd, **common)


def candidates(plan: AttentionPlan, packed: bool, split: Optional[tuple[int, ...]],
               dtype: torch.dtype) -> tuple[str, ...]:
    """Under autotune with no pin, the kernel backends the dispatch model says take the self-test's
    call on the plan's arch (`Route.candidates`: any of them may run the layer's calls); else () (and on flex:
    torch's kernel runs its calls)."""
    selection = plan.selection
    if not selection.autotune or selection.pin is not None or plan.arch not in ARCHES or flex_test.on_flex(plan) or (
            _core() is None):
        return ()  # without the manager (older builds) nothing can be pinned: the route runs as dispatched
    return dispatch_route(_call_features(plan, packed, split, dtype), Selection(autotune=True)).candidates


_MISSING = object()


def _core() -> Any:
    """The installed ``primus_turbo.pytorch.core.backend`` with its manager, or None."""
    try:
        core = importlib.import_module("primus_turbo.pytorch.core.backend")
        if not all(hasattr(core, n) for n in ("GlobalBackendManager", "BackendType", "PrecisionType")) or not hasattr(
                core.GlobalBackendManager, "set_attn_backend"):
            return None
    except ImportError:
        return None
    return core


@contextlib.contextmanager
def pinned_backend(name: Optional[str]) -> Iterator[None]:
    """Pin attention to kernel backend ``name`` (`dispatch` spelling: ``FlyDSL``, ``AITER``, ``HipKittens``)
    through the installed build's ``GlobalBackendManager.set_attn_backend``, and restore what was in
    force after, whatever happens.  Upstream's ``set_attn_backend(None)`` forgets every code setting (the
    environment rules again), which would also drop one set for another precision (fp8), and older
    fakes read it as "no backend" for every precision; so the manager's code setting (``_attn_backend``)
    is put back as it was where it has one, else the public call is used and checked.  ``name`` None:
    nothing is pinned."""
    if name is None:
        yield
        return
    core = _core()
    manager, precision = core.GlobalBackendManager, core.PrecisionType.BF16_FP16_FP32
    saved = getattr(manager, "_attn_backend", _MISSING)
    saved = dict(saved) if isinstance(saved, dict) else saved
    try:
        before = manager.get_attn_backend(precision)
    except Exception:  # noqa: BLE001 - an unreadable environment: restored with the code setting alone
        before = _MISSING
    manager.set_attn_backend(core.BackendType[name.upper()])
    try:
        yield
    finally:
        if saved is not _MISSING:
            manager._attn_backend = saved
        else:
            manager.set_attn_backend(None)
            if before is not _MISSING and manager.get_attn_backend(precision) != before:
                manager.set_attn_backend(before)


def _cannot_handle(exc: BaseException) -> bool:
    """Upstream's answer when a pinned backend does not take the call (``ValueError("User specified
    backend ... cannot handle ...")``)."""
    return isinstance(exc, ValueError) and "User specified backend" in str(exc) and "cannot handle" in str(exc)


def check_route(plan: AttentionPlan, packed: bool, device: torch.device, dtype: torch.dtype,
                split: Optional[tuple[int, ...]] = None, pinned: Optional[str] = None,
                flex_kernel: Optional[Callable] = None) -> RouteResult:
    """Run one route on Turbo (with kernel backend ``pinned``, if given), or on the flex backend (torch's
    ``flex_attention``, or ``flex_kernel`` with its contract), and on the reference; cached per process."""
    seq = seq_length(plan)
    split = split if split is not None or not packed else splits(plan, packed, seq)[0]
    backend = flex_test.flex_backend(flex_kernel) if flex_test.on_flex(plan) else None
    key = _key(plan, packed, device, dtype, seq, split, pinned, backend)
    if key in _DONE:
        return _DONE[key]
    route, kernels = _describe(plan, packed, split, dtype, pinned), "; ".join(plan.kernels) or "-"
    backward = backend is None or flex_test.checks_backward(device, backend)
    unchecked = "" if backward else flex_test.FORWARD_ONLY
    route += "" if backward else f", {flex_test.FORWARD_ONLY}"
    plan = dataclasses.replace(plan, dropout=0.0)  # numbers are compared, so no random drops
    start = time.perf_counter()
    ms = lambda: 1e3 * (time.perf_counter() - start)  # noqa: E731
    if plan.seq_length is None and flex_test.reads_captured_tensors(plan):
        result = _DONE[key] = RouteResult(route, kernels, float("nan"), float("nan"), ms(), skipped=(
            "the hooks read captured tensors and the layer's seq_length is not known here, so no length "
            "the hooks are written for can be chosen"))
        return result
    if pinned is not None and pinned.upper() not in _core().BackendType.__members__:
        result = _DONE[key] = RouteResult(route, kernels, float("nan"), float("nan"), ms(), pinned=pinned,
                                          skipped=f"this Primus-Turbo has no BackendType.{pinned.upper()}")
        return result
    try:
        turbo, reference = _calls(plan, packed, split, backend)
        fused, views, grad, sink = _inputs(plan, packed, device, dtype, seq)
        with pinned_backend(pinned):
            out, grads = _run(turbo, fused, views, grad, sink, backward)
        want, want_grads = _run(reference, fused, views, grad, sink, backward)
        fwd = _error(out, want)
        bwd = max((_error(g, w) for g, w in zip(grads, want_grads)), default=float("nan"))
    except Exception as exc:  # noqa: BLE001 - whatever the kernel raises is the finding
        if pinned is not None and _cannot_handle(exc):
            result = RouteResult(route, kernels, float("nan"), float("nan"), ms(), pinned=pinned,
                                 skipped=f"{pinned} does not take the call: {exc}")
        else:
            result = RouteResult(route, kernels, float("nan"), float("nan"), ms(), f"{type(exc).__name__}: {exc}",
                                 pinned=pinned or "", unchecked=unchecked)
    else:
        tol = TOLERANCE.get(dtype, 1e-3)
        checked = (("forward", fwd), ("backward", bwd)) if backward else (("forward", fwd),)
        bad = [name for name, err in checked if not err <= tol]
        why = f"{' and '.join(bad)} differ from the reference by more than {tol:g}" if bad else ""
        result = RouteResult(route, kernels, fwd, bwd, ms(), why, pinned=pinned or "", unchecked=unchecked)
    _DONE[key] = result
    return result


def routes_of(plan: AttentionPlan) -> list[bool]:
    """The call kinds a plan makes that the self-test can run: ``packed`` flags (on turbo, and on flex)."""
    if plan.backend not in ("turbo", "flex") or (not plan.flex and (plan.dense_entry or "").endswith("_fp8_func")):
        return []  # reference needs no test; context-parallel and fp8 entries need their own harness
    hooks = plan.mask_mod is not None or plan.score_mod is not None  # packed calls with hooks are refused (B17)
    if plan.mask_documents:  # dense batches' documents, read from Megatron's mask, run on the varlen entry
        return [True]
    return [packed for packed in (False, True)
            if (plan.packed is None or plan.packed is packed) and not (packed and hooks)]


def self_test(plans: Sequence[AttentionPlan], *, device: Optional[torch.device] = None,
              dtype: Optional[torch.dtype] = None, flex_kernel: Optional[Callable] = None) -> list[RouteResult]:
    """Each distinct route of ``plans`` once, in each plan's own dtype (else bf16 on a GPU, float32
    on CPU), each packed route on each document split; under autotune once per candidate kernel
    backend (`candidates`), each pinned for its run; a flex plan's on ``flex_kernel`` if given (a
    function with ``flex_attention``'s contract), else torch's.  Of two results one row names, a
    failure is kept."""
    device = device or (torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    results: dict[str, RouteResult] = {}
    for plan in plans:
        chosen = dtype or _TORCH_DTYPES.get(plan.dtype or "") or (
            torch.bfloat16 if device.type == "cuda" else torch.float32)
        for packed in routes_of(plan):
            for split in splits(plan, packed, seq_length(plan)):
                for pinned in candidates(plan, packed, split, chosen) or (None,):
                    found = check_route(plan, packed, device, chosen, split, pinned, flex_kernel)
                    if found.route not in results or not found.ok:
                        results[found.route] = found
        found = shared_prefix_route(plan, device, chosen)  # a shared-prefix layer's merge (B37)
        if found is not None and (found.route not in results or not found.ok):
            results[found.route] = found
    return list(results.values())


def refuse_failures(results: Sequence[RouteResult], where: str) -> None:
    """Raise `UnsupportedConfigError` naming every route that failed its self-test; ``where`` names the layers
    tested ("layer 3", "layers 1-4")."""
    reasons = [R.SELFTEST_FAILED.reason_for(route=r.route, kernels=r.kernels, error=r.error,
                                            forward=f"{r.forward_error:.2g}", backward=f"{r.backward_error:.2g}")
               for r in results if not r.ok]
    if reasons:
        raise R.refuse_all(reasons, context=f"{where} self-test")


def selftest_enabled(setting: object) -> bool:
    """``turbo_selftest``: true / false, or auto = on when a GPU is present (cheap there)."""
    if setting in (True, "true"):
        return True
    if setting in (False, "false"):
        return False
    return torch.cuda.is_available()


def clear() -> None:
    """Forget the results of this process (a test may install another Primus-Turbo)."""
    _DONE.clear()


__all__ = ["RouteResult", "candidates", "check_route", "clear", "pinned_backend", "refuse_failures", "routes_of",
           "self_test", "selftest_enabled"]
