"""Exact counts of tensor copies and host syncs per attention call, on every path.

Counted with `primus_ext.testing.counting` (a ``TorchDispatchMode`` plus a
``TorchFunctionMode`` for ``tolist``): copies are ``aten.copy_`` / ``aten.clone``
(``.contiguous()`` dispatches it) / ``aten._to_copy``; host syncs are
``aten._local_scalar_dense`` (``item``), ``aten.equal``, ``aten.is_nonzero``, ops with
data-dependent shapes, device-to-host copies and ``Tensor.tolist`` / ``numpy``.

Ops run inside the kernel are counted apart ("kernel" columns): the Primus-Turbo entries
(here the CPU fake, whose checks mirror the real ones, e.g. the varlen boundary
read), or the whole reference backend, which is the kernel on CPU.  "ours" is what
primus_ext adds around the kernel: the adapter, the routing, Megatron's layout changes.
One forward call is counted after a warm-up call (hooks verified).

Goals: 0 host syncs of ours on the flex dense and packed paths; 0 copies of ours on
the bshd dense path where the device takes strided input (CPU, gfx950 on AITER); exactly 3
(q, k, v made contiguous) in gfx942 mode; exactly 1 in gfx950 FlyDSL mode (dense or varlen) with
megatron-core's own tensors (the value, a split view of the fused QKV; q and k come
contiguous out of RoPE).

    python -m benchmarks.copies_and_syncs
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from typing import Any, Callable, Iterator, Optional

import torch

from . import _common as c

NAME = "copies_and_syncs"
B, S, HQ, HKV, D = 2, 64, 4, 2, 16
WINDOW = (8, 0)
BOUNDS = (0, 30, 64, 128)


def _settings(**keys: Any) -> Any:
    from primus_ext.settings import TurboAttentionSettings

    return TurboAttentionSettings.from_dict({"use_turbo_attention": True, "use_turbo_flex_attention": True, **keys})


def _kernel_backend(backend: Any) -> None:
    """The reference backend is the kernel on CPU: count its ops as the kernel's."""
    from primus_ext.testing.counting import as_kernel

    if backend is not None and getattr(backend, "name", "") == "reference":
        backend.dense = as_kernel(backend.dense)
        backend.packed = as_kernel(backend.packed)


@contextlib.contextmanager
def turbo_kernels(mode: Optional[str]) -> Iterator[Any]:
    """Primus-Turbo entries counted as kernels: ``fake`` is the CPU fake (real checks,
    exact math), ``stub`` the no-op stubs returning a contiguous bshd / thd output;
    ``None`` installs nothing (reference backend)."""
    if mode is None:
        yield None
        return
    from primus_ext.testing import fake_primus_turbo
    from primus_ext.testing.counting import kernels_attributed

    from ._stubs import stubbed_turbo

    if mode == "stub":
        with stubbed_turbo() as (ops, outputs):
            outputs.dense = torch.empty(B, S, HQ, D)
            outputs.packed = torch.empty(B * S, HQ, D)
            with kernels_attributed(ops, sys.modules["primus_turbo.pytorch.ops.attention"]):
                yield ops
        return
    with fake_primus_turbo() as fake:
        with kernels_attributed(sys.modules["primus_turbo.pytorch.ops"], fake.module):
            yield fake


def adapter(backend: str, *, packed: bool = False, sink: bool = False, window: tuple[int, int] = (-1, -1)) -> Any:
    from primus_ext.call.adapter import TurboFlexAttention
    from primus_ext.plan import LayerFacts, build_plan

    plan = build_plan(_settings(turbo_flex_attention_backend=backend, use_sink_attention=sink,
                                sink_sliding_window=max(window[0], 0)),  # the plan's window, as the call passes it
                      LayerFacts(num_heads=HQ, num_kv_heads=HKV, head_dim=D, seq_length=S, packed=packed))
    run = TurboFlexAttention(plan)
    _kernel_backend(run.backend)
    return run


def core(backend: Optional[str], *, storage: str = "as-given") -> Any:
    """A Megatron core attention; ``backend=None`` is the direct path."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from primus_ext.megatron.core import TurboAttentionCore

    config = TransformerConfig(num_layers=1, hidden_size=HQ * D, num_attention_heads=HQ, num_query_groups=HKV,
                               use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0)
    keys = {"use_turbo_flex_attention": False} if backend is None else {"turbo_flex_attention_backend": backend}
    module = TurboAttentionCore(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                attention_dropout=None, softmax_scale=None, k_channels=None, v_channels=None,
                                cp_comm_type=None, pg_collection=None, settings=_settings(**keys))
    module.storage = storage  # what the plan decides for a gfx942 / gfx950 at construction (AttentionPlan.storage)
    if module.adapter is not None:
        _kernel_backend(module.adapter.backend)
    return module


def inputs(dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, S, HQ, D, generator=gen, dtype=dtype)
    k = torch.randn(B, S, HKV, D, generator=gen, dtype=dtype)
    v = torch.randn(B, S, HKV, D, generator=gen, dtype=dtype)
    cu = torch.tensor(BOUNDS, dtype=torch.int32)
    longest = max(b - a for a, b in zip(BOUNDS, BOUNDS[1:]))
    return {"bshd": (q, k, v), "sbhd": tuple(t.transpose(0, 1).contiguous() for t in (q, k, v)),
            "thd": tuple(t.reshape(B * S, *t.shape[2:]) for t in (q, k, v)), "cu": cu, "longest": longest}


def packed_params(x: dict[str, Any]) -> Any:
    from megatron.core.packed_seq_params import PackedSeqParams

    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=x["cu"], cu_seqlens_kv=x["cu"],
                           max_seqlen_q=x["longest"], max_seqlen_kv=x["longest"])


def count(fn: Callable[[], Any]) -> Any:
    """Counts of one call of ``fn``, after one warm-up call."""
    from primus_ext.testing.counting import count_copies_and_syncs

    fn()
    with count_copies_and_syncs() as counts:
        fn()
    return counts


def scenarios() -> list[tuple[str, str, Optional[str], Callable[[], Callable[[], Any]]]]:
    """``(path, kernel, turbo_kernels mode, build)``; ``build()`` returns the call to count."""
    x = inputs()
    q, k, v = x["bshd"]
    tq, tk, tv = x["thd"]
    sq, sk, sv = x["sbhd"]
    cu, longest = x["cu"], x["longest"]
    thd_kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest)
    sink_bf16 = torch.zeros(HQ, dtype=torch.bfloat16)

    def dense(backend: str, window: tuple[int, int] = (-1, -1), **kw: Any) -> Callable[[], Callable[[], Any]]:
        sink = kw.pop("sink", None)
        return lambda: (lambda run: lambda: run(q, k, v, causal=True, window_size=window, sink=sink))(
            adapter(backend, sink=sink is not None, window=window))

    def thd(backend: str) -> Callable[[], Callable[[], Any]]:
        return lambda: (lambda run: lambda: run.varlen(tq, tk, tv, causal=True, **thd_kw))(adapter(backend, packed=True))

    def megatron(backend: Optional[str], storage: str = "as-given", layout: str = "sbhd"):
        def build() -> Callable[[], Any]:
            module = core(backend, storage=storage)
            if layout == "thd":
                params = packed_params(x)
                return lambda: module.forward(tq.unsqueeze(1), tk.unsqueeze(1), tv.unsqueeze(1), None,
                                              packed_seq_params=params)
            if layout == "split":  # megatron-core's own tensors: RoPE'd q and k, value a split view
                return lambda: module.forward(sq, sk, split_v, None)
            if layout == "split-thd":  # the same for a packed batch
                params = packed_params(x)
                return lambda: module.forward(tq.unsqueeze(1), tk.unsqueeze(1), split_tv.unsqueeze(1), None,
                                              packed_seq_params=params)
            return lambda: module.forward(sq, sk, sv, None)
        return build

    # value as megatron-core 0.16.1 hands it over: a torch.split view of the fused QKV projection
    fused = torch.cat([sq.reshape(S, B, HKV, -1), sk, sv], dim=-1)
    split_v = fused.split([HQ // HKV * D, D, D], dim=-1)[2]
    split_tv = torch.cat([tq.reshape(B * S, HKV, -1), tk, tv], dim=-1).split([HQ // HKV * D, D, D], dim=-1)[2]

    fake, stub = "fake", "stub"
    return [
        ("flex dense bshd, causal", "reference (SDPA)", None, dense("reference")),
        (f"flex dense bshd, window {WINDOW}", "reference (blockwise)", None, dense("reference", WINDOW)),
        ("flex dense bshd, causal", "fake turbo: flash_attn_func", fake, dense("turbo")),
        (f"flex dense bshd, window {WINDOW}", "fake turbo: flash_attn_func", fake, dense("turbo", WINDOW)),
        ("flex dense bshd, causal + bf16 sink", "fake turbo: flash_attn_func", fake,
         dense("turbo", sink=sink_bf16)),
        ("flex packed thd, causal", "reference (blockwise per document)", None, thd("reference")),
        ("flex packed thd, causal", "fake turbo: flash_attn_varlen_func", fake, thd("turbo")),
        ("Megatron sbhd core, flex", "reference (SDPA)", None, megatron("reference")),
        ("Megatron sbhd core, flex", "stub turbo: flash_attn_func", stub, megatron("turbo")),
        ("Megatron sbhd core, direct", "stub turbo: flash_attn_func", stub, megatron(None)),
        ("Megatron sbhd core, flex", "fake turbo: flash_attn_func", fake, megatron("turbo")),
        ("Megatron thd core, flex", "stub turbo: flash_attn_varlen_func", stub, megatron("turbo", layout="thd")),
        ("Megatron thd core, direct", "stub turbo: flash_attn_varlen_func", stub, megatron(None, layout="thd")),
        ("Megatron thd core, flex", "fake turbo: flash_attn_varlen_func", fake, megatron("turbo", layout="thd")),
        ("Megatron thd core, direct", "fake turbo: flash_attn_varlen_func", fake, megatron(None, layout="thd")),
        ("gfx942 mode, Megatron sbhd core, flex", "stub turbo: flash_attn_func", stub,
         megatron("turbo", "contiguous-bshd")),
        ("gfx942 mode, Megatron sbhd core, direct", "stub turbo: flash_attn_func", stub,
         megatron(None, "contiguous-bshd")),
        ("gfx950 FlyDSL mode, Megatron sbhd core (split value), flex", "stub turbo: flash_attn_func", stub,
         megatron("turbo", "contiguous-sbhd", "split")),
        ("gfx950 FlyDSL mode, Megatron sbhd core (split value), direct", "stub turbo: flash_attn_func", stub,
         megatron(None, "contiguous-sbhd", "split")),
        ("gfx950 AITER mode, Megatron sbhd core (split value), direct", "stub turbo: flash_attn_func", stub,
         megatron(None, "as-given", "split")),
        ("gfx950 FlyDSL varlen mode, Megatron thd core (split value), flex", "stub turbo: flash_attn_varlen_func",
         stub, megatron("turbo", "contiguous-thd", "split-thd")),
        ("gfx950 FlyDSL varlen mode, Megatron thd core (split value), direct", "stub turbo: flash_attn_varlen_func",
         stub, megatron(None, "contiguous-thd", "split-thd")),
    ]


def _ops(counter: Any, kind: str, kernel: bool) -> str:
    found = counter.by_op(kind, kernel=kernel)
    return ", ".join(f"{op.replace('aten.', '').replace('.default', '')} x{n}" for op, n in sorted(found.items()))


def goal(path: str, kernel: str, counts: Any) -> tuple[Optional[bool], str]:
    """Which goal a row is held to, and whether it is met."""
    if path.startswith("gfx942"):
        return counts.copies == 3 and counts.syncs == 0, "3 copies (q, k, v), 0 syncs"
    if path.startswith("gfx950 FlyDSL"):
        return counts.copies == 1 and counts.syncs == 0, "1 copy (the split value), 0 syncs"
    if "bf16 sink" in path:
        return counts.copies == 1 and counts.syncs == 0, "1 copy (sink to fp32, B12), 0 syncs"
    if "core" in path and kernel.startswith("fake"):
        # The fake computes in bhsd and returns a strided view; Megatron's reshape to
        # [S, B, H*D] ([T, H*D]) cannot view that layout and copies the kernel's output once.
        return counts.copies == 1 and counts.syncs == 0, "1 copy (the kernel's strided output), 0 syncs"
    return counts.copies == 0 and counts.syncs == 0, "0 copies, 0 syncs"


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{NAME}", description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    started = time.perf_counter()
    torch.set_num_threads(1)
    env = c.environment()
    c.header(NAME, "copies and host syncs per forward call, exact counts", env)
    rows, results = [], []
    from megatron.core import parallel_state  # noqa: F401  (import before counting: no import-time ops)

    for path, kernel, mode, build in scenarios():
        with turbo_kernels(mode):
            counts = count(build())
        ok, rule = goal(path, kernel, counts)
        results.append({"path": path, "kernel": kernel, **counts.summary(), "goal": rule, "goal_met": ok})
        rows.append([path, kernel, counts.copies, counts.syncs, counts.kernel_copies, counts.kernel_syncs,
                     _ops(counts, "copy", False) or "-", _ops(counts, "copy", True) or "-",
                     _ops(counts, "sync", True) or "-", f"{rule}: {c.verdict(ok)}"])
    print(c.table(["path", "kernel", "our copies", "our syncs", "kernel copies", "kernel syncs",
                   "our copy ops", "kernel copy ops", "kernel sync ops", "goal"], rows))
    print(f"\nfloat32 q/k/v, B={B}, S={S}, heads {HQ}/{HKV}, head dim {D}; packed rows: documents {list(BOUNDS)}; "
          "one forward call after a warm-up call. Kernels: 'fake turbo' = the CPU fake of Primus-Turbo (its "
          "checks and exact math), 'stub turbo' = no-op entries returning a contiguous output, 'reference' = "
          "the reference backend as a whole.")
    path_ = c.write_json(NAME, {"benchmark": NAME, "environment": env,
                                "shape": {"B": B, "S": S, "HQ": HQ, "HKV": HKV, "D": D, "documents": BOUNDS},
                                "results": results})
    c.footer(path_, started)
    return 0 if all(r["goal_met"] is not False for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
