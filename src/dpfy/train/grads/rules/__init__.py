"""Fast-engine rules, one module per layer family; importing this package registers them all."""

from dpfy.train.grads.rules import attention, conv, embedding, linear, norm

__all__ = ["attention", "conv", "embedding", "linear", "norm"]
