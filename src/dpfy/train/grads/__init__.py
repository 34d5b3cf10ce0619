"""Per-example gradient clipping engines: the fast core of DP-SGD.

DP-SGD (guide alg. 1) needs, for every example i of a batch, its gradient gᵢ over *all* trainable
parameters jointly, clipped to norm C, and only the sum Σᵢ cᵢ·gᵢ with cᵢ = min(1, C/‖gᵢ‖). An engine
computes that sum from the user's ordinary training code, watching the model through hooks::

    engine = dpfy.train.grads.make_engine(model)          # "auto" | "fast" | "vmap"
    for x, y in physical_batches:                   # one or more per logical batch
        loss = criterion(model(x), y)               # reduction "mean" or "sum"
        loss.backward()
        result = engine.clip_and_accumulate(max_grad_norm=C, loss_reduction="mean")
    sums = engine.summed_grads()                    # {name: Σ clipped}, every trainable param
    ...                                             # optimizer: + N(0, σ²C²), ÷ expected B, step
    engine.reset()                                  # next logical batch
    engine.detach()                                 # when done: the model as it was

Contract for the optimizer that consumes an engine
--------------------------------------------------
``make_engine(model, engine="auto", *, batch_first=True) -> GradEngine``
    Attaches hooks (and, for ``nn.MultiheadAttention``, an exact substitute: see below).
    ``engine.kind`` is ``"fast"`` or ``"vmap"``; under ``"auto"``, ``engine.fallback_reason``
    names the first layer that forced ``"vmap"`` (None otherwise). ``"fast"`` on a model it cannot
    run raises ``ValueError`` naming the layer. A layer called more than once in a forward pass
    is only seen when it runs: under ``"auto"`` the fast engine then forms that layer's
    per-example gradients as the vmap engine does (``engine.replayed_layers`` names it) and
    keeps its rules for the rest; an explicit ``"fast"`` refuses it. A parameter carrying a
    gradient hook (``Tensor.register_hook``, ``register_post_accumulate_grad_hook``) is refused
    (at ``make_engine``, or at the step when added later): no engine runs it per example.
    ``batch_first=False`` for sequence-first models:
    sequence tensors are then (T, B, ...) (token indices (T, B)); pooled (B, d) features and
    channels-first layers (convolutions, GroupNorm) keep the batch first.

``engine.clip_and_accumulate(max_grad_norm, loss_reduction="mean", *, microbatch_size=None,
groups=None, noise=None, scale=1.0)``
    Call once after each ``loss.backward()``. ``loss_reduction`` states how the loss combined the
    n examples of the physical batch: ``"mean"`` (loss = (1/n) Σ ℓᵢ; gradients are multiplied
    back by n) or ``"sum"``. Adds the clipped sum into the accumulator (so physical batches add up
    to one logical batch: virtual batching) and returns a :class:`ClipResult` with the per-unit
    norms *before* clipping (``norms``, detached), ``num_examples`` and ``num_units``.
    ``scale`` multiplies every clipped unit gradient before it is summed (the private optimizer
    passes 1/B, so the sum it reads is already the average).
    ``microbatch_size=k`` clips the *average* gradient of each group of k consecutive examples
    instead (guide alg. 3; a last, smaller group is averaged over its own size). Its sensitivity
    is **2C**: the optimizer must add noise of std 2σC; the engine only sums.
    ``groups`` (an integer tensor, one id per example, any order and group sizes) clips the
    average gradient of each group of examples sharing an id instead: one group per user gives
    user-level DP-SGD (:mod:`dpfy.train.user_level`), whose sensitivity is C because the whole group
    is the protected record. Both are laid out by :class:`dpfy.train.grads.layout.Units`.
    Afterwards every trainable ``p.grad`` is **None**: the non-private gradient of the backward
    pass is discarded, so an optimizer cannot step on it by accident. An empty batch (n = 0), or
    no backward since the last call, adds nothing and reports 0 examples; it never raises, and
    the optimizer must still add noise. ``noise`` (a :class:`NoiseStart`, on
    the last physical batch of a logical batch) opens the named parameters' sums from their
    noise just before each layer is summed (each exactly once, also on an empty batch); clipped
    sums are then added into them in place (rules with ``add_clipped_sum`` write their products
    straight in), so a step holds no second parameter-sized buffer; see
    :class:`dpfy.train.optim.DPOptimizer`. ``engine.summing`` says whether a logical batch's sum is
    open.

``engine.summed_grads() -> dict[str, Tensor]``
    The accumulated clipped sum for *every* trainable parameter, keyed by the name it has in
    ``model.named_parameters()``; zeros for parameters that received no gradient (they still
    need noise: every trainable parameter is noised every step). ``engine.params`` maps the
    same names to the Parameters.
``engine.write_grads()``
    Sets each trainable ``p.grad`` to its accumulated clipped sum (a copy), for optimizers that
    add noise in place and call ``torch.optim`` afterwards.
``engine.num_examples``
    Examples accumulated since the last ``reset`` (the *realised* batch size; divide by the
    *expected* batch size instead).
``engine.reset()`` / ``engine.detach()``
    Clear the accumulator / remove every hook and substitution (idempotent); the model is then
    exactly as before ``make_engine`` (same modules, same Parameter objects, same state_dict).

Engines
-------
``fast`` (:mod:`dpfy.train.grads.fast`): one forward, one backward. Hooks keep each layer's
    inputs and output gradients; a per-layer *rule* (:mod:`dpfy.train.grads.registry`, one
    small class per layer type registered with ``@register_rule``) gives per-example squared
    norms, and the clipped sum is one product ``aᵀ diag(c) g`` per layer (book-keeping, Bu et
    al. 2023). Linear layers on sequences use the ghost norm ``⟨aaᵀ, ggᵀ⟩`` (Li et al. 2022) or
    the direct per-example gradient, whichever is cheaper (``2T² < p·d``). While a watched layer
    runs forward, its parameters' ``requires_grad`` is switched off so autograd skips the
    ordinary parameter gradient that would be thrown away (a layer whose inputs need no gradient
    gets a fresh autograd root for its output instead). Layers whose per-example gradients are
    smaller than their captured tensors (convolutions on the direct route, normalisation layers)
    are reduced to them during backward, releasing activations early. Rules: ``nn.Linear`` (any
    leading dims), ``nn.Conv1d``, ``nn.Conv2d`` (stride, padding incl. "same" and non-zero
    modes, dilation, groups), ``nn.Embedding`` (``padding_idx``; not ``scale_grad_by_freq``),
    ``nn.LayerNorm``, ``nn.GroupNorm``, ``nn.RMSNorm``, ``nn.InstanceNorm1d/2d/3d`` (affine, no
    running statistics), attention's input projection, Hugging Face's ``Conv1D`` (GPT-2;
    registered by name, so transformers is never imported), and ``nn.RNN``, ``nn.GRU``,
    ``nn.LSTM`` (any ``batch_first``, stacked, bidirectional; per-example gradients from one
    replay of the batch, :mod:`dpfy.train.grads.rules.recurrent`; packed batches are
    replayed as the vmap engine does; ``proj_size`` is left to vmap). ``nn.MultiheadAttention`` is
    replaced while attached by :class:`~dpfy.train.grads.substitutions.DPMultiheadAttention`, an
    exact equivalent built from hookable projections holding the *same* Parameters, so
    ``nn.TransformerEncoder`` runs on the fast engine (``add_bias_kv`` is not supported). A
    parameter shared by several layers (tied input and output embeddings) is clipped by the norm
    of its summed gradient (:mod:`dpfy.train.grads.shared`) when every layer's rule can factor
    it (Linear, Embedding, Conv1D); otherwise ``fast`` refuses and ``auto`` picks ``vmap``. A
    layer called twice in one forward pass is refused by ``fast`` and, under ``auto``, replayed
    per example as ``vmap`` does (the other layers keep their rules).
``vmap`` (:mod:`dpfy.train.grads.vmap`): any layer that acts on each example separately; per-example
    gradients of each layer's own parameters from ``torch.func`` (``vmap`` of ``vjp`` through
    ``functional_call``), one layer at a time, summed across repeated calls and shared
    parameters; the clipped sum is one batched ``vjp`` with weighted output gradients. Memory
    grows with batch × the largest layer. The general fallback and the tests' second reference.
    Each call is replayed with its keyword arguments and whatever holds its inputs (dicts,
    lists), each tensor's batch dim read from the layer where the layer fixes it (recurrent
    layers' states are (layers·directions, B, H)), a packed batch of sequences one length at a
    time (:mod:`dpfy.train.grads.replay`, :mod:`dpfy.train.grads.recurrent`); a layer's own
    forward hooks are not run again (the engine captured the output of its ``forward``, so a
    user's hook that rescales it stays part of the model downstream). A layer that owns
    parameters and has children (a ViT's ``x + self.pos_embed`` then ``nn.Dropout``) replays
    the dropout masks its forward drew (:mod:`dpfy.train.grads.dropout`); other random draws in
    a replayed forward (a functional dropout) are refused naming the layer, as is a
    ``PackedSequence`` handed to a layer other than nn.RNN/GRU/LSTM, and a recurrent layer's
    own dropout between stacked layers in training mode.

Adding a layer type: subclass :class:`LayerRule` (``sq_norms``, ``clipped_sum``, optionally
``per_example_grads`` and ``add_clipped_sum``), decorate it with ``@register_rule(MyLayer)``,
and test it against the batch-of-one reference in ``tests/test_grads.py``.

Both engines, in batch-first models, run a layer called on an input of batch size 1 that every
example shares (BERT's and GPT-2's default position ids (1, T)) by expanding its output to the
batch; any use of that output other than elementwise with the batch raises
(:mod:`dpfy.train.grads.broadcast`). Under ``torch.autocast`` (bf16, fp16) or on bf16 weights,
norms and sums are computed and accumulated in float32 at least, with autocast off, and each
finished sum is cast to its parameter's dtype (:mod:`dpfy.train.grads.precision`).

Batch-coupled layers (BatchNorm) are not detected here; :mod:`dpfy.train.checks` refuses them. A
parameter that receives a gradient outside any watched layer call makes ``clip_and_accumulate``
raise rather than silently miss it.
"""

from dpfy.train.grads.engine import ClipResult, GradEngine, LossReduction, NoiseStart
from dpfy.train.grads.make import EngineChoice, fast_blocker, make_engine
from dpfy.train.grads.registry import (
    LayerRule,
    find_rule,
    register_rule,
    registered_layers,
    registered_names,
)

__all__ = [
    "ClipResult",
    "EngineChoice",
    "GradEngine",
    "LayerRule",
    "LossReduction",
    "NoiseStart",
    "fast_blocker",
    "find_rule",
    "make_engine",
    "register_rule",
    "registered_layers",
    "registered_names",
]
