"""Fast-engine rules, one module per layer family; importing this package registers them all."""

from dpfy.train.grads.rules import attention, conv, embedding, hf_conv1d, linear, norm, recurrent

__all__ = ["attention", "conv", "embedding", "hf_conv1d", "linear", "norm", "recurrent"]
