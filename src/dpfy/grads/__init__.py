"""Per-example gradient clipping engines (placeholder docs; see make_engine)."""

from dpfy.grads.engine import ClipResult, GradEngine, LossReduction
from dpfy.grads.make import EngineChoice, fast_blocker, make_engine
from dpfy.grads.registry import LayerRule, find_rule, register_rule, registered_layers

__all__ = [
    "ClipResult",
    "EngineChoice",
    "GradEngine",
    "LayerRule",
    "LossReduction",
    "fast_blocker",
    "find_rule",
    "make_engine",
    "register_rule",
    "registered_layers",
]
