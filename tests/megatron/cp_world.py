"""Shared pieces of the context-parallel tests: the layers, their inputs, the float64 oracle, the run.

Every layer is built and run the same way on every rank (same order, same seeds), so the ranks'
collectives pair up; the oracle is the whole sequence's, and each rank compares its rows of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from tests.flex_standin import flex_standin
from tests.fuzz import oracle as fuzz_oracle
from tests.fuzz import user_hooks
from tests.megatron import gpt

SEQ, BATCH, DIM = 16, 2, 16
WINDOW = 3
DIRECT: dict = {}
REFERENCE = dict(use_turbo_flex_attention=True, turbo_flex_attention_backend="reference")
TURBO = dict(use_turbo_flex_attention=True, turbo_flex_attention_backend="turbo")
FLEX = dict(use_turbo_flex_attention=True, turbo_flex_attention_backend="flex")
SINK = dict(use_sink_attention=True)
HOOKS = "tests.fuzz.user_hooks:"


@dataclass(frozen=True)
class Layer:
    """One layer configuration run on every rank (all ranks build the same ones, in the same order)."""

    keys: dict
    causal: bool = True
    window: Optional[tuple] = None
    comm: str = "a2a"
    mask_hook: Optional[str] = None
    score_hook: Optional[str] = None
    compiled: bool = False
    sizes: tuple = (2, 4)
    extra: dict = field(default_factory=dict)

    @property
    def sink(self) -> bool:
        return bool(self.keys.get("use_sink_attention"))


LAYERS = {
    "direct-causal": Layer(DIRECT),
    "direct-window-sink": Layer({**DIRECT, **SINK}, window=(WINDOW, 0), comm="p2p"),
    "direct-full": Layer(DIRECT, causal=False, comm="a2a+p2p", sizes=(2,)),
    "direct-causal-sink-compiled": Layer({**DIRECT, **SINK}, compiled=True, sizes=(2,)),
    "reference-window-sink": Layer({**REFERENCE, **SINK}, window=(WINDOW, 0), comm="all_gather"),
    "reference-alibi": Layer(REFERENCE, score_hook=HOOKS + "alibi"),
    "reference-head-and-position-mask": Layer(REFERENCE, mask_hook=HOOKS + "first_head_sees_all"),
    "reference-every-other-key": Layer(REFERENCE, mask_hook=HOOKS + "every_other_key", sizes=(2,)),
    "reference-sink-compiled": Layer({**REFERENCE, **SINK}, compiled=True, sizes=(2,)),
    "turbo-causal-sink": Layer({**TURBO, **SINK}),
    "turbo-window": Layer(TURBO, window=(WINDOW, 0), comm="p2p", sizes=(2,)),
    "turbo-alibi": Layer(TURBO, score_hook=HOOKS + "alibi"),
    # flex: torch's FlexAttention has no CPU backward, so these run over the autograd stand-in (`build`)
    "flex-window-sink": Layer({**FLEX, **SINK}, window=(WINDOW, 0)),
    "flex-head-and-position-mask": Layer(FLEX, mask_hook=HOOKS + "first_head_sees_all"),
    "flex-alibi": Layer(FLEX, score_hook=HOOKS + "alibi", sizes=(2,)),
    "flex-sink-compiled": Layer({**FLEX, **SINK}, compiled=True, sizes=(2,)),
}


def heads(cp: int) -> tuple[int, int]:
    """Query and key/value heads: two query heads sharing one key/value head per CP rank (GQA)."""
    return 2 * cp, cp


def sink_values(hq: int) -> torch.Tensor:
    return torch.tensor([0.5, -0.25, 1.0, 0.0, -1.0, 0.75, 0.25, -0.5][:hq])


def inputs(hq: int, hkv: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Whole-sequence bshd q, k, v and an upstream gradient ``[B, S, H * D]``, the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    return dict(q=torch.randn(BATCH, SEQ, hq, DIM, generator=gen),
                k=torch.randn(BATCH, SEQ, hkv, DIM, generator=gen),
                v=torch.randn(BATCH, SEQ, hkv, DIM, generator=gen),
                grad=torch.randn(BATCH, SEQ, hq * DIM, generator=gen))


def hook(spec: Optional[str]) -> Optional[Callable]:
    return getattr(user_hooks, spec.split(":")[1]) if spec else None


def oracle(layer: Layer, whole: dict[str, torch.Tensor], hq: int) -> dict[str, Any]:
    """float64 attention of the whole sequence (bshd), its q/k/v gradients for ``grad``, and the sink's."""
    leaves = {n: whole[n].double().requires_grad_(True) for n in "qkv"}
    sink = sink_values(hq).double().requires_grad_(True) if layer.sink else None
    if layer.mask_hook:
        mask = fuzz_oracle.hook_mask(hook(layer.mask_hook), BATCH, hq, SEQ, SEQ)
    else:
        mask = fuzz_oracle.flash_mask(SEQ, SEQ, causal=layer.causal, window=layer.window or (-1, -1))
    out, _ = fuzz_oracle.attention(leaves["q"], leaves["k"], leaves["v"], mask, sink=sink,
                                   score_fn=hook(layer.score_hook))
    out = out.reshape(BATCH, SEQ, -1)
    out.backward(whole["grad"].double())
    return dict(out=out.detach(), dq=leaves["q"].grad, dk=leaves["k"].grad, dv=leaves["v"].grad,
                dsink=sink.grad if sink is not None else None)


def megatron_split(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's part of bshd tensors, as megatron-core's own ``get_batch_on_this_cp_rank`` cuts it."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    return get_batch_on_this_cp_rank(dict(batch))


def build(layer: Layer, cp: int, hq: int, hkv: int, *, config_cp: Optional[int] = None, tp: int = 1,
          flex_kernel: Optional[Callable] = flex_standin, dropout: float = 0.0) -> Any:
    """The layer's module; a ``flex`` layer over ``flex_kernel`` (None: torch's own flex_attention)."""
    from megatron.core.transformer.enums import AttnMaskType

    import primus_ext.call.adapter as adapter_module
    from primus_ext.backends import make_backend
    from primus_ext.backends.flex import FlexBackend
    from primus_ext.megatron import PrimusTurboLocalAttention

    keys = dict(layer.keys)
    for kind, spec in (("mask", layer.mask_hook), ("score", layer.score_hook)):
        if spec:
            keys[f"turbo_flex_attention_{kind}_mod"] = spec
    cfg = gpt.config(context_parallel_size=config_cp or cp, kv_channels=DIM, num_attention_heads=hq,
                     num_query_groups=hkv, hidden_size=hq * DIM, window_size=layer.window,
                     tensor_model_parallel_size=tp, attention_dropout=dropout)
    mask = AttnMaskType.causal if layer.causal else AttnMaskType.no_mask
    made = adapter_module.make_backend
    if flex_kernel is not None:
        adapter_module.make_backend = lambda name: FlexBackend(kernel=flex_kernel) if name == "flex" else made(name)
    try:
        module = PrimusTurboLocalAttention(cfg, 1, mask, "self", cp_comm_type=layer.comm,
                                           settings=gpt.settings(**keys))
    finally:
        adapter_module.make_backend = made
    if layer.sink:  # the tensor-parallel rank's entries (`tp_heads`)
        with torch.no_grad():
            module.softmax_offset.copy_(tp_heads(sink_values(hq).view(1, 1, -1, 1), tp)[0, 0, :, 0])
    return module


def tp_heads(t: torch.Tensor, tp: int) -> torch.Tensor:
    """This tensor-parallel rank's heads (dim 2) of a bshd tensor, as megatron-core's column split gives them."""
    if tp == 1:
        return t
    from megatron.core import parallel_state

    n = t.shape[2] // tp
    rank = parallel_state.get_tensor_model_parallel_rank()
    return t[:, :, rank * n:(rank + 1) * n]


def tp_part(part: dict[str, torch.Tensor], tp: int, hq: int) -> dict[str, torch.Tensor]:
    """``part`` cut to this tensor-parallel rank's heads (the gradient ``[B, S, H * D]`` too)."""
    out = {n: tp_heads(part[n], tp) for n in "qkv"}
    out["grad"] = tp_heads(part["grad"].unflatten(2, (hq, DIM)), tp).flatten(2)
    return out


def run(module: Any, part: dict[str, torch.Tensor], mask: Optional[torch.Tensor] = None,
        compiled: bool = False) -> dict:
    """Forward in training mode on Megatron's sbhd layout and backward of the part's gradient; output and
    q/k/v gradients back in bshd, and the sink's gradient.  ``compiled``: under ``torch.compile(fullgraph=True)``,
    with the code of the graphs Dynamo made (``graphs``)."""
    from torch._dynamo.backends.debugging import aot_eager

    leaves = [part[n].transpose(0, 1).contiguous().requires_grad_(True) for n in "qkv"]
    module.train()
    graphs: list[str] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm.print_readable(print_output=False))
        return aot_eager(gm, example_inputs)

    call = torch.compile(module, fullgraph=True, backend=backend) if compiled else module
    out = call(*leaves, mask)
    out.backward(part["grad"].transpose(0, 1))
    grads = [t.grad.transpose(0, 1) for t in leaves]
    sink = getattr(module, "softmax_offset", None)
    return dict(out=out.detach().transpose(0, 1), dq=grads[0], dk=grads[1], dv=grads[2],
                dsink=sink.grad.clone() if sink is not None else None, graphs=graphs)


def outcome(fn: Callable[[], Any]) -> tuple[str, tuple, str]:
    """``(exception type, rule codes, message)`` of a call that must raise, or ``("returned", (), "")``."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the type is what the test compares
        return type(exc).__name__, tuple(getattr(exc, "codes", ())), str(exc)
    return "returned", (), ""
