"""The attention plan: what each layer computes, or every reason it cannot."""

from .build import build_plan, layer_window
from .facts import LayerFacts
from .plan import AttentionPlan
from .rules import RULES, Rule, RuleInput, failing_reasons

__all__ = ["RULES", "AttentionPlan", "LayerFacts", "Rule", "RuleInput", "build_plan", "failing_reasons", "layer_window"]
