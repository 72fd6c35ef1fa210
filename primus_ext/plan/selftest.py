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
kernel (route, arch, selection, storage, dtype, length, split), so a model of many layers
with one pattern pays for one test.  On CPU it runs against whatever ``primus_turbo`` is
importable (the CPU fake in tests).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from ..attention.pattern import pattern_from_flash_args
from ..backends import make_backend
from ..backends.adapter import TurboFlexAttention
from ..backends.direct import DirectRunner, choose_direct
from ..backends.layout import kernel_views
from ..backends.turbo import load_ops
from ..errors import Reason, UnsupportedConfigError
from .plan import AttentionPlan

MIN_SEQ = 64
_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 2e-4, torch.float64: 1e-9}
"""Max error, relative to the largest reference value, that a route may show per dtype
(bf16's 8-bit mantissa rounds each product to ~4e-3; blockwise and one-pass softmax
round differently, and errors add over a 64-key row)."""


@dataclass(frozen=True)
class RouteResult:
    """One route's self-test: ``error`` is set when it could not run or disagreed."""

    route: str
    kernels: str
    forward_error: float
    backward_error: float
    ms: float
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


_DONE: dict[tuple, RouteResult] = {}


def seq_length(plan: AttentionPlan) -> int:
    """Long enough that every window bound is reached from both ends (a window of 128 is not causal
    on 64 tokens), a multiple of 16."""
    bounds = [b for b in (plan.window + ((plan.pattern.left, plan.pattern.right) if plan.pattern else ())) if b > 0]
    reach = 2 * max(bounds, default=0) + 16
    return max(MIN_SEQ, -(-reach // 16) * 16)


def splits(plan: AttentionPlan, packed: bool, seq: int) -> list[Optional[tuple[int, ...]]]:
    """The document splits of a packed route: equal lengths (FlyDSL's varlen takes them) and unequal."""
    if not packed:
        return [None]
    equal = (0, seq // 2, seq)
    return [equal] if getattr(plan, "equal_documents", False) else [equal, (0, seq // 4, seq)]


def _key(plan: AttentionPlan, packed: bool, device: torch.device, dtype: torch.dtype, seq: int,
         split: Optional[tuple[int, ...]]) -> tuple:
    return (plan.path, plan.pattern if not packed else plan.window, plan.causal, plan.window, plan.sink,
            plan.alibi_slopes, plan.num_heads, plan.num_kv_heads, plan.head_dim, plan.head_dim_v, plan.scale,
            plan.deterministic, plan.mask_hook, plan.score_hook, packed, str(device), dtype, plan.arch,
            plan.selection, plan.storage, seq, split)


def _describe(plan: AttentionPlan, packed: bool, split: Optional[tuple[int, ...]], dtype: torch.dtype) -> str:
    inside = pattern_from_flash_args(plan.causal, plan.window).describe()
    what = f"{plan.path} {'packed' if packed else 'dense'}: {plan.pattern_text if not packed else inside}"
    extras = [x for x, on in (("sink", plan.sink), ("ALiBi", plan.alibi_slopes is not None)) if on]
    if split is not None:
        extras.append(f"documents {list(split)}")
    extras.append(str(dtype).replace("torch.", ""))
    return what + ", " + ", ".join(extras) + f", heads {plan.num_heads}/{plan.num_kv_heads}"


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
        views = lambda f: megatron_qkv(f, plan)  # noqa: E731
        grad = rand(seq, plan.num_heads, plan.head_dim_v)
    else:
        views = lambda f: kernel_views(*megatron_qkv(f, plan), plan.storage)  # noqa: E731
        grad = rand(2, seq, plan.num_heads, plan.head_dim_v)
    sink = rand(plan.num_heads).float() if plan.sink else None
    return fused, views, grad, sink


def _run(call, fused, views, grad, sink):
    """One forward and backward from a fresh leaf of the fused projection: q, k, v keep the layouts
    the layer gives the kernels, and their gradients arrive in the projection's."""
    leaf = fused.detach().clone().requires_grad_(True)
    sink_leaf = sink.detach().clone().requires_grad_(True) if sink is not None else None
    out = call(*views(leaf), sink_leaf)
    (out.float() * grad.float()).sum().backward()
    grads = [leaf.grad] + ([sink_leaf.grad] if sink_leaf is not None else [])
    return out.detach(), grads


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = float(want.detach().abs().max().float()) + 1e-6
    return float((got.detach().float() - want.detach().float()).abs().max()) / scale


def _calls(plan: AttentionPlan, packed: bool, split: Optional[tuple[int, ...]]):
    """``(turbo call, reference call)`` taking ``(q, k, v, sink)``."""
    reference = TurboFlexAttention(dataclasses.replace(plan, path="flex", backend="reference"),
                                   make_backend("reference"))
    bounds = split or (0, 1)
    cu = torch.tensor(bounds, dtype=torch.int32)
    longest = max(b - a for a, b in zip(bounds, bounds[1:]))
    flash = dict(causal=plan.causal, window_size=plan.window) if plan.mask_mod is None else {}

    def through(layer):
        if packed:
            return lambda q, k, v, s: layer(q, k, v, sink=s, cu_seqlens_q=cu.to(q.device),
                                            cu_seqlens_kv=cu.to(q.device), max_seqlen_q=longest,
                                            max_seqlen_kv=longest, **flash)
        return lambda q, k, v, s: layer(q, k, v, sink=s, **flash)

    if plan.flex:
        return through(TurboFlexAttention(plan)), through(reference)
    runner = DirectRunner(load_ops(), choose_direct(load_ops(), fp8=False, context_parallel=False))
    if packed:
        def direct(q, k, v, s):
            c = cu.to(q.device)
            return runner.packed_call(q, k, v, c, c, longest, longest, dropout_p=0.0, scale=plan.scale,
                                      causal=plan.causal, window=plan.window, sink=s,
                                      deterministic=plan.deterministic)
    else:
        def direct(q, k, v, s):
            return runner.dense_call(q, k, v, dropout_p=0.0, scale=plan.scale, causal=plan.causal,
                                     window=plan.window, sink=s, deterministic=plan.deterministic)
    return direct, through(reference)


def check_route(plan: AttentionPlan, packed: bool, device: torch.device, dtype: torch.dtype,
                split: Optional[tuple[int, ...]] = None) -> RouteResult:
    """Run one route on Turbo and on the reference; cached per process."""
    seq = seq_length(plan)
    split = split if split is not None or not packed else splits(plan, packed, seq)[0]
    key = _key(plan, packed, device, dtype, seq, split)
    if key in _DONE:
        return _DONE[key]
    route, kernels = _describe(plan, packed, split, dtype), "; ".join(plan.kernels) or "-"
    plan = dataclasses.replace(plan, dropout=0.0)  # numbers are compared, so no random drops
    start = time.perf_counter()
    try:
        turbo, reference = _calls(plan, packed, split)
        fused, views, grad, sink = _inputs(plan, packed, device, dtype, seq)
        out, grads = _run(turbo, fused, views, grad, sink)
        want, want_grads = _run(reference, fused, views, grad, sink)
        fwd = _error(out, want)
        bwd = max(_error(g, w) for g, w in zip(grads, want_grads))
    except Exception as exc:  # noqa: BLE001 - whatever the kernel raises is the finding
        result = RouteResult(route, kernels, float("nan"), float("nan"), 1e3 * (time.perf_counter() - start),
                             f"{type(exc).__name__}: {exc}")
    else:
        tol = TOLERANCE.get(dtype, 1e-3)
        bad = [name for name, err in (("forward", fwd), ("backward", bwd)) if not err <= tol]
        why = f"{' and '.join(bad)} differ from the reference by more than {tol:g}" if bad else ""
        result = RouteResult(route, kernels, fwd, bwd, 1e3 * (time.perf_counter() - start), why)
    _DONE[key] = result
    return result


def routes_of(plan: AttentionPlan) -> list[bool]:
    """The call kinds a plan makes that the self-test can run: ``packed`` flags."""
    if plan.backend != "turbo" or (not plan.flex and (plan.dense_entry or "").endswith(("_usp_func", "_fp8_func"))):
        return []  # reference needs no test; context-parallel and fp8 entries need their own harness
    hooks = plan.mask_mod is not None or plan.score_mod is not None  # packed calls with hooks are refused (B17)
    return [packed for packed in (False, True)
            if (plan.packed is None or plan.packed is packed) and not (packed and hooks)]


def self_test(plans: Sequence[AttentionPlan], *, device: Optional[torch.device] = None,
              dtype: Optional[torch.dtype] = None) -> list[RouteResult]:
    """Each distinct route of ``plans`` once, in each plan's own dtype (else bf16 on a GPU, float32
    on CPU), each packed route on each document split."""
    device = device or (torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    results: dict[str, RouteResult] = {}
    for plan in plans:
        chosen = dtype or _TORCH_DTYPES.get(plan.dtype or "") or (
            torch.bfloat16 if device.type == "cuda" else torch.float32)
        for packed in routes_of(plan):
            for split in splits(plan, packed, seq_length(plan)):
                found = check_route(plan, packed, device, chosen, split)
                results.setdefault(found.route, found)
    return list(results.values())


def refuse_failures(results: Sequence[RouteResult], layer: int) -> None:
    """Raise `UnsupportedConfigError` naming every route that failed its self-test."""
    reasons = [Reason(("turbo_selftest",), f"the self-test of route [{r.route}] (kernels: {r.kernels}) failed: "
                      f"{r.error} (forward {r.forward_error:.2g}, backward {r.backward_error:.2g}).",
                      "report it with the route; set turbo_flex_attention_backend: reference meanwhile, "
                      "or turbo_selftest: false to train anyway.", "B33")
               for r in results if not r.ok]
    if reasons:
        raise UnsupportedConfigError(reasons, context=f"layer {layer} self-test")


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


__all__ = ["RouteResult", "check_route", "clear", "refuse_failures", "routes_of", "self_test", "selftest_enabled"]
