"""Opacus's spellings, answered with dpfy's: errors for the names an Opacus user types first.

Someone coming from Opacus writes ``model, optimizer, loader = engine.make_private(module=…,
data_loader=…, target_delta=…)`` and reads ``optimizer.noise_multiplier`` or
``accountant.get_epsilon(delta)``. Python's own errors for these ("unexpected keyword
argument", "cannot unpack non-iterable", AttributeError) say what is wrong, not what to write;
these tables say what to write. docs/coming-from-opacus.md is the longer mapping.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = [
    "MAKE_PRIVATE_KEYWORDS",
    "OPTIMIZER_ATTRIBUTES",
    "RUN_ATTRIBUTES",
    "UNPACKING",
    "attribute_error",
    "refuse_opacus_keywords",
]

#: Opacus's ``make_private`` / ``make_private_with_epsilon`` keywords → dpfy's spelling.
MAKE_PRIVATE_KEYWORDS = {
    "module": "the model, the first argument: make_private(model, optimizer, data, …)",
    "data_loader": (
        "the data, the third argument (a Dataset or a DataLoader): make_private(model, "
        "optimizer, train_loader, …)"
    ),
    "target_delta": "delta=",
    "poisson_sampling": (
        "sampler='poisson' (the default) or sampler='shuffle' (then the report flags the "
        "Poisson assumption as not met)"
    ),
    "grad_sample_mode": "engine='auto' | 'fast' | 'vmap'",
    "clipping": (
        "nothing: dpfy clips each example's whole gradient to max_grad_norm (flat clipping); "
        "microbatch_size= clips microbatch averages"
    ),
    "noise_generator": "seed= (experiments only) or secure_noise=True",
    "secure_mode": "secure_noise=True",
    "expected_batch_size": "batch_size= (the expected batch size B)",
}

#: Attributes of Opacus's DPOptimizer → where dpfy keeps them (``private`` is make_private's
#: result).
OPTIMIZER_ATTRIBUTES = {
    "noise_multiplier": "private.noise_multiplier (σ; also private.plan.noise_multiplier)",
    "max_grad_norm": "private.plan.max_grad_norm",
    "expected_batch_size": "private.plan.expected_batch_size",
    "accumulated_iterations": "private.ledger.steps (the steps taken)",
    "get_epsilon": "private.epsilon(delta)",
}

#: Attributes of Opacus's PrivacyEngine / accountant → dpfy's.
RUN_ATTRIBUTES = {
    "get_epsilon": "private.epsilon(delta) (δ defaults to the run's)",
    "accountant": "private.ledger (private.epsilon(delta) gives ε)",
    "make_private": "dpfy.make_private(model, optimizer, data, …), a function",
    "make_private_with_epsilon": "dpfy.make_private(…, target_epsilon=…, epochs=…)",
    "data_loader": "private.loader",
    "module": "private.model",
}

#: Said when make_private's result is unpacked like Opacus's tuple.
UNPACKING = (
    "make_private returns one PrivateTraining object, not Opacus's (model, optimizer, "
    "data_loader) tuple: write private = make_private(…), then use private.model, "
    "private.optimizer and `for x, y in private.loader:`"
)

F = TypeVar("F", bound=Callable[..., Any])


def refuse_opacus_keywords(function: F) -> F:
    """Refuse Opacus's keywords to ``function`` with dpfy's spelling, before Python's binding
    error ("missing 1 required positional argument") hides what was meant."""

    @functools.wraps(function)
    def checked(*args: Any, **kwargs: Any) -> Any:
        known = [name for name in kwargs if name in MAKE_PRIVATE_KEYWORDS]
        if known:
            spelled = "; ".join(f"{name}= is {MAKE_PRIVATE_KEYWORDS[name]}" for name in known)
            raise TypeError(
                f"{function.__name__}() takes no {', '.join(f'{n}=' for n in known)} (Opacus's "
                f"spelling): in dpfy, {spelled}"
            )
        return function(*args, **kwargs)

    return checked  # type: ignore[return-value]


def attribute_error(owner: str, name: str, table: dict[str, str]) -> AttributeError:
    """The AttributeError for ``owner.name``: naming dpfy's spelling when Opacus has the name."""
    if name in table:
        return AttributeError(
            f"'{owner}' has no attribute '{name}' (Opacus's name); in dpfy use {table[name]}"
        )
    return AttributeError(f"'{owner}' object has no attribute '{name}'")
