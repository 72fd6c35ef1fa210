"""The call path: what runs on every attention call, between a caller and a backend.

The flash-attn-compatible entries (`TurboFlexAttention`), the per-call checks, whose
``causal`` / ``window_size`` a call runs (`agreement`), the prepared-call cache, and the
``torch.library`` custom ops that carry a call through a compiled graph.  It runs an
`~primus_ext.plan.AttentionPlan` on a backend; backends never import it.
"""

from .adapter import TurboFlexAttention

__all__ = ["TurboFlexAttention"]
