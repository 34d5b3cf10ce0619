"""The compiled private step (``private.compiled_step()``): exact against per-example references
and the hooked step, the same noise and ledger, and every path into it refused before anything
changed when it is not the loader's batch whole and unchanged."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import dpfy
from dpfy.data.provenance import BatchRefused
from dpfy.train.optim import NonFiniteGradientError

N, B, M = 256, 32, 80
CLIP = 0.5


class ZeroNoise:
    """A source that draws zeros: what is left is the clipped sum alone."""

    def normal(self, like: torch.Tensor, std: float) -> torch.Tensor:
        return torch.zeros_like(like)


def _data(n: int = N, features: int = 6) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(
        torch.randn(n, features, generator=g), torch.randint(0, 3, (n,), generator=g)
    )


def _mlp(features: int = 6) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(features, 8), nn.Tanh(), nn.Linear(8, 3))


def _run(model=None, data=None, *, sampler="truncated-poisson", lr=0.1, zero_noise=False, **kw):
    model = model if model is not None else _mlp()
    options = dict(
        batch_size=B, delta=1e-5, max_grad_norm=CLIP, epochs=2, noise_multiplier=1.0,
        sampler=sampler, criterion=nn.CrossEntropyLoss(), seed=3,
    )  # fmt: skip
    if sampler == "truncated-poisson":
        options["max_batch_size"] = M
    options.update(kw)
    private = dpfy.make_private(
        model, torch.optim.SGD(model.parameters(), lr=lr), data or _data(), **options
    )
    if zero_noise:
        private.optimizer.noise = ZeroNoise()
    return private


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _reference_update(private, x, y, real: int, make=_mlp) -> list[torch.Tensor]:
    """Σ over example rows of clip_C(∇ℓ(example alone)) / B, each computed on its own, on a
    hook-free copy of the run's model."""
    model = make()
    model.load_state_dict(private.model.state_dict())
    divisor = private.plan.divisor
    total = [torch.zeros_like(p) for p in model.parameters()]
    for i in range(real):
        model.zero_grad()
        nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        grads = [p.grad.detach().clone() for p in model.parameters()]
        norm = math.sqrt(sum(float(g.square().sum()) for g in grads))
        factor = min(1.0, CLIP / norm) if norm > 0 else 1.0
        for t, g in zip(total, grads, strict=True):
            t.add_(g * factor / divisor)
    model.zero_grad()
    return total


# ---------------------------------------------------------------------------------------------
# Exact: per-example reference, padding, the hooked step, compiled = eager
# ---------------------------------------------------------------------------------------------
def test_gradient_is_the_clipped_per_example_sum_over_examples_only():
    private = _run(zero_noise=True, lr=0.0)
    step = private.compiled_step(compile=False)
    x, y = next(iter(private.loader))
    padding = private.loader.provenance.current.padding
    assert padding is not None and padding.rows == M
    reference = _reference_update(private, x, y, padding.real)
    step(x, y)
    for p, want in zip(private.model.parameters(), reference, strict=True):
        torch.testing.assert_close(p.grad, want, rtol=1e-5, atol=1e-7)


def test_padding_rows_contribute_nothing_whatever_they_hold():
    """dataset[0] (what padding rows copy) given a huge gradient changes nothing in the sum."""
    data = _data()
    data.tensors[0][0] = 1e4  # an example whose gradient would dominate any sum it entered
    private = _run(data=data, zero_noise=True, lr=0.0)
    step = private.compiled_step(compile=False)
    padded = 0
    for _, (x, y) in zip(range(4), private.loader, strict=False):
        padding = private.loader.provenance.current.padding
        padded += padding.padded
        reference = _reference_update(private, x, y, padding.real)
        step(x, y)
        for p, want in zip(private.model.parameters(), reference, strict=True):
            torch.testing.assert_close(p.grad, want, rtol=1e-5, atol=1e-7)
    assert padded > 0


def test_same_update_noise_and_ledger_as_the_hooked_step():
    """Seeded alike, three compiled steps and three hooked steps end at the same parameters
    (zero noise) and spend the same ε."""
    hooked, compiled = _run(zero_noise=True), _run(zero_noise=True)
    criterion = nn.CrossEntropyLoss()
    for _, (x, y) in zip(range(3), hooked.loader, strict=False):
        hooked.optimizer.zero_grad()
        criterion(hooked.model(x), y).backward()
        hooked.optimizer.step()
    step = compiled.compiled_step(compile=False)
    for _, (x, y) in zip(range(3), compiled.loader, strict=False):
        step(x, y)
    for a, b in zip(hooked.model.parameters(), compiled.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert compiled.ledger.steps == hooked.ledger.steps == 3
    assert compiled.epsilon() == pytest.approx(hooked.epsilon(), rel=1e-12)


def test_noise_has_std_sigma_c_over_the_expected_batch_size():
    torch.manual_seed(0)
    model = nn.Linear(200, 50)
    data = TensorDataset(torch.zeros(N, 200), torch.zeros(N, 50))
    private = dpfy.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.0), data, batch_size=B, delta=1e-5,
        max_grad_norm=CLIP, epochs=1, noise_multiplier=2.0, sampler="truncated-poisson",
        max_batch_size=M, criterion=nn.MSELoss(), seed=0,
    )  # fmt: skip
    step = private.compiled_step(compile=False)
    x, y = next(iter(private.loader))
    step(x, y)  # zero inputs and targets: every gradient is the noise alone
    noise = model.weight.grad.flatten()
    expected = 2.0 * CLIP / private.plan.divisor
    # 10 000 draws: the sample std is within 4 % of σC/B with overwhelming probability
    assert float(noise.std()) == pytest.approx(expected, rel=0.04)
    assert abs(float(noise.mean())) < 4 * expected / math.sqrt(noise.numel())


def test_compiled_equals_eager_to_float_tolerance():
    """torch.compile (the aot_eager backend: traced, not code-generated) and eager, seeded alike."""
    results = []
    for options in (None, {"backend": "aot_eager"}):
        private = _run()
        step = private.compiled_step(compile=options is not None, compile_options=options)
        for _, (x, y) in zip(range(3), private.loader, strict=False):
            step(x, y)
        results.append(_params(private.model))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_inductor_compiled_equals_eager_to_float_tolerance():
    """The CPU inductor backend (what compile=True runs), seeded alike with the eager step."""
    results = []
    for compile in (False, True):
        private = _run()
        step = private.compiled_step(compile=compile)
        for _, (x, y) in zip(range(3), private.loader, strict=False):
            step(x, y)
        results.append(_params(private.model))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_each_example_is_computed_alone_so_batch_statistics_cannot_couple_them():
    """A hand-written normalisation over the batch (h - h.mean(0)) is coupling under the hooked
    step; here the model sees one row at a time, so the update is the per-example reference
    and the card says why the model was not probed."""

    class Centred(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            return self.b(torch.tanh(h - h.mean(0, keepdim=True) + 0.1 * h))

    private = _run(model=Centred(), zero_noise=True, lr=0.0)
    step = private.compiled_step(compile=False)
    x, y = next(iter(private.loader))
    real = private.loader.provenance.current.padding.real
    reference = _reference_update(private, x, y, real, Centred)
    step(x, y)
    for p, want in zip(private.model.parameters(), reference, strict=True):
        torch.testing.assert_close(p.grad, want, rtol=1e-5, atol=1e-7)
    model_check = private.optimizer.behaviour.summary()["model"]
    assert "compiled step" in model_check["detail"]


def test_returns_the_mean_loss_of_the_examples():
    private = _run(lr=0.0)
    step = private.compiled_step(compile=False)
    x, y = next(iter(private.loader))
    real = private.loader.provenance.current.padding.real
    with torch.no_grad():
        want = nn.functional.cross_entropy(private.model(x[:real]), y[:real])
    assert float(step(x, y)) == pytest.approx(float(want), rel=1e-5)


def test_an_all_padding_batch_is_a_noise_only_step_that_is_accounted():
    private = _run(lr=0.0)
    step = private.compiled_step(compile=False)
    x, y = next(iter(private.loader))
    provenance = private.loader.provenance
    provenance.current = type(provenance.current)(
        provenance.current.number, 0, padding=type(provenance.current.padding)(M, 0)
    )
    loss = step(x, y)
    assert float(loss) == 0.0
    assert private.ledger.steps == 1
    assert all(float(p.grad.abs().sum()) > 0 for p in private.model.parameters())  # noise


# ---------------------------------------------------------------------------------------------
# Refused before anything changed
# ---------------------------------------------------------------------------------------------
def _unchanged(private, before, steps: int = 0) -> None:
    for a, b in zip(private.model.parameters(), before, strict=True):
        assert torch.equal(a.detach(), b)
    assert private.ledger.steps == steps


@pytest.mark.parametrize(
    "feed",
    [
        pytest.param(lambda x, y: (x.clone(), y), id="a copy of the batch"),
        pytest.param(lambda x, y: (x[:-1], y[:-1]), id="a slice"),
        pytest.param(lambda x, y: (torch.randn_like(x), y), id="a batch made by hand"),
        pytest.param(lambda x, y: (x.flip(0), y.flip(0)), id="rows reordered"),
    ],
)
def test_tensors_that_are_not_the_loaders_batch_are_refused(feed):
    private = _run()
    step = private.compiled_step(compile=False)
    x, y = next(iter(private.loader))
    before = _params(private.model)
    with pytest.raises(BatchRefused, match="not the private loader's last batch"):
        step(*feed(x, y))
    _unchanged(private, before)
    step(x, y)  # the batch itself is still accepted: nothing was consumed
    assert private.ledger.steps == 1


def test_a_batch_written_in_place_after_it_was_handed_out_is_refused():
    private = _run()
    step = private.compiled_step(compile=False)
    x, y = next(iter(private.loader))
    x[1] = x[2]  # one example duplicated over another: same tensor, same shape
    before = _params(private.model)
    with pytest.raises(BatchRefused, match="written in place"):
        step(x, y)
    _unchanged(private, before)


def test_a_batch_stepped_on_twice_and_a_skipped_batch_are_refused():
    private = _run()
    step = private.compiled_step(compile=False)
    batches = iter(private.loader)
    x, y = next(batches)
    step(x, y)
    before = _params(private.model)
    with pytest.raises(BatchRefused, match="already used"):
        step(x, y)
    _unchanged(private, before, steps=1)
    next(batches)  # drawn, never stepped on
    x, y = next(batches)
    with pytest.raises(BatchRefused, match="skipped"):
        step(x, y)
    _unchanged(private, before, steps=1)


def test_mixing_a_backward_pass_into_a_compiled_step_is_refused():
    private = _run()
    step = private.compiled_step(compile=False)
    x, y = next(iter(private.loader))
    nn.functional.cross_entropy(private.model(x), y).backward()
    before = _params(private.model)
    with pytest.raises(BatchRefused, match="one step may not take both"):
        step(x, y)
    _unchanged(private, before)


def test_a_parameter_unfrozen_after_make_private_is_refused():
    model = _mlp()
    model[0].weight.requires_grad_(False)
    private = _run(model=model)
    step = private.compiled_step(compile=False)
    model[0].weight.requires_grad_(True)
    x, y = next(iter(private.loader))
    before = _params(private.model)
    with pytest.raises(BatchRefused, match="frozen"):
        step(x, y)
    _unchanged(private, before)


def test_a_model_that_writes_its_buffers_is_refused_with_the_fix():
    class Running(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.fc = nn.Linear(6, 3)
            self.register_buffer("seen", torch.zeros(6))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.seen.add_(x.sum(0).detach())
            return self.fc(x)

    private = _run(model=Running())
    step = private.compiled_step(compile=False)
    x, y = next(iter(private.loader))
    before = _params(private.model)
    with pytest.raises(ValueError, match=r"writes into the model.s parameters or\s+buffers"):
        step(x, y)
    _unchanged(private, before)
    assert float(private.model.seen.abs().sum()) == 0.0


def test_a_non_finite_gradient_on_a_padding_row_is_refused():
    data = _data()
    data.tensors[0][0] = float("nan")  # dataset[0]: what padding rows copy
    private = _run(data=data)
    step = private.compiled_step(compile=False)
    x, y = next(iter(private.loader))
    assert private.loader.provenance.current.padding.padded > 0  # M = 80 rows, B = 32 expected
    before = _params(private.model)
    with pytest.raises(NonFiniteGradientError, match="not applied"):
        step(x, y)
    _unchanged(private, before)


def test_budget_guard_refuses_a_step_past_the_target_before_anything_changes():
    private = _run(target_epsilon=1.0, noise_multiplier=None, epochs=1)
    step = private.compiled_step(compile=False)
    private.ledger.target_epsilon = 1e-6  # as if the budget had been spent
    x, y = next(iter(private.loader))
    before = _params(private.model)
    with pytest.raises(dpfy.BudgetExhausted):
        step(x, y)
    _unchanged(private, before)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"sampler": "poisson"}, "same number of rows"),
        ({"microbatch_size": 4, "sampler": "poisson"}, "clips per microbatch"),
        ({"max_physical_batch_size": 16}, "drop max_physical_batch_size"),
    ],
)
def test_runs_it_cannot_take_exactly_are_refused_when_it_is_made(options, message):
    private = _run(**options)
    with pytest.raises(ValueError, match=message):
        private.compiled_step(compile=True)


def test_without_a_criterion_it_asks_for_one():
    model = _mlp()
    private = dpfy.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), _data(), batch_size=B, delta=1e-5,
        max_grad_norm=CLIP, epochs=1, noise_multiplier=1.0, sampler="truncated-poisson",
        max_batch_size=M,
    )  # fmt: skip
    with pytest.raises(ValueError, match="needs the loss"):
        private.compiled_step()
    assert private.compiled_step(nn.CrossEntropyLoss(), compile=False) is not None


def test_a_checkpoint_resumes_a_compiled_run(tmp_path):
    private = _run()
    step = private.compiled_step(compile=False)
    batches = iter(private.loader)
    for _ in range(2):
        step(*next(batches))
    path = private.save(tmp_path / "run.pt")
    resumed = _run()
    resumed.load(path)
    again = resumed.compiled_step(compile=False)
    x, y = next(iter(resumed.loader))
    again(x, y)
    assert resumed.ledger.steps == 3


def test_a_model_changed_outside_the_step_is_refused():
    private = _run()
    step = private.compiled_step(compile=False)
    batches = iter(private.loader)
    step(*next(batches))
    with torch.no_grad():
        private.model[0].weight.add_(1.0)  # an update the ledger never saw
    changed = _params(private.model)
    with pytest.raises(BatchRefused, match="changed outside"):
        step(*next(batches))
    _unchanged(private, changed, steps=1)


def _standardising_collate(samples):
    x = torch.stack([s[0] for s in samples])
    y = torch.stack([s[1] for s in samples])
    if len(x) > 1:
        x = (x - x.mean(0)) / (x.std(0) + 1e-6)
    return x, y


def test_a_collate_fn_with_batch_statistics_is_still_refused():
    """Each example computed alone covers the model and loss, not what collate_fn did before."""
    loader = torch.utils.data.DataLoader(_data(), batch_size=B, collate_fn=_standardising_collate)
    private = _run(data=loader, sampler="poisson")
    step = private.compiled_step(compile=False)
    x, y = next(iter(private.loader))
    before = _params(private.model)
    with pytest.raises(BatchRefused, match="collate_fn"):
        step(x, y)
    _unchanged(private, before)


def test_poisson_batches_of_every_size_run_eagerly_and_spend_what_the_hooked_step_spends():
    hooked, eager = _run(sampler="poisson"), _run(sampler="poisson")
    criterion = nn.CrossEntropyLoss()
    for x, y in hooked.loader:
        hooked.optimizer.zero_grad()
        criterion(hooked.model(x), y).backward()
        hooked.optimizer.step()
    step = eager.compiled_step(compile=False)
    sizes = set()
    for x, y in eager.loader:
        sizes.add(len(y))
        step(x, y)
    assert len(sizes) > 1
    assert eager.ledger.steps == hooked.ledger.steps
    assert eager.epsilon() == pytest.approx(hooked.epsilon(), rel=1e-12)


# ---------------------------------------------------------------------------------------------
# Review findings: each one a rule
# ---------------------------------------------------------------------------------------------
def test_a_forward_that_keeps_a_tensor_on_the_model_is_refused():
    """A hook saving ``module.last = output`` would hand one step's examples to the next
    step's rows (under vmap the saved tensor is a batched one), unclipped and unaccounted."""

    class Remembering(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3)
            self.last: torch.Tensor | None = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            if self.last is not None:
                h = h + self.last
            self.last = h.detach()
            return self.b(h)

    private = _run(model=Remembering())
    step = private.compiled_step(compile=False)
    x, y = next(iter(private.loader))
    before = _params(private.model)
    with pytest.raises(dpfy.ExamplesCoupled, match="'last'"):
        step(x, y)
    _unchanged(private, before)


def test_half_precision_clips_to_c_exactly():
    """Under bf16 autocast, every clipped row still weighs at most C: the norms, clip factors
    and sums are formed in float32 (identical rows: the sum's norm is exactly examples·C/B)."""
    data = TensorDataset(torch.full((N, 6), 3.0), torch.zeros(N, dtype=torch.long))
    private = _run(data=data, zero_noise=True, lr=0.0)
    step = private.compiled_step(compile=False)
    x, y = next(iter(private.loader))
    real = private.loader.provenance.current.padding.real
    with torch.autocast("cpu", dtype=torch.bfloat16):
        step(x, y)
    norm = math.sqrt(sum(float(p.grad.double().square().sum()) for p in private.model.parameters()))
    assert norm <= real * CLIP / private.plan.divisor * (1 + 1e-6)
    assert norm >= real * CLIP / private.plan.divisor * (1 - 1e-3)  # every row was clipped
    assert all(p.grad.dtype == torch.float32 for p in private.model.parameters())


class _Encoding(dict):
    """A tokenizer's BatchEncoding stand-in: a Mapping batch of named tensors."""


def _encoded(samples):
    return _Encoding(x=torch.stack([s[0] for s in samples]), y=torch.stack([s[1] for s in samples]))


def test_a_mapping_batch_is_held_and_accepted():
    loader = torch.utils.data.DataLoader(_data(), batch_size=B, collate_fn=_encoded)
    private = _run(data=loader)
    step = private.compiled_step(compile=False)
    batch = next(iter(private.loader))
    step(batch["x"], batch["y"])
    assert private.ledger.steps == 1


def test_a_transformer_layer_runs_and_matches_the_hooked_step():
    """nn.TransformerEncoderLayer's attention is substituted by dpfy: its parameters live one
    level deeper than their original names, and the step finds them by identity."""

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.embed = nn.Linear(2, 8)
            self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
            self.head = nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.layer(self.embed(x.view(-1, 3, 2))).mean(1))

    runs = [_run(model=Tiny(), zero_noise=True) for _ in range(2)]
    x, y = next(iter(runs[0].loader))
    runs[0].optimizer.zero_grad()
    nn.functional.cross_entropy(runs[0].model(x), y).backward()
    runs[0].optimizer.step()
    step = runs[1].compiled_step(compile=False)
    step(*next(iter(runs[1].loader)))
    for a, b in zip(runs[0].model.parameters(), runs[1].model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_class_weights_under_mean_are_refused_since_they_would_cancel():
    private = _run()
    with pytest.raises(ValueError, match="reduction='sum'"):
        private.compiled_step(nn.CrossEntropyLoss(weight=torch.tensor([1.0, 10.0, 0.1])))
    weighted = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 10.0, 0.1]), reduction="sum")
    assert private.compiled_step(weighted, compile=False) is not None


def test_a_gradient_hook_added_after_make_private_is_refused():
    private = _run()
    step = private.compiled_step(compile=False)
    private.model[0].weight.register_hook(lambda g: g * 0)
    x, y = next(iter(private.loader))
    before = _params(private.model)
    with pytest.raises(ValueError, match="hook"):
        step(x, y)
    _unchanged(private, before)


def test_correlated_noise_runs_have_static_shapes_and_may_compile():
    private = _run(algorithm="dp-ftrl", sampler=None, epochs=1)
    assert private.compiled_step(compile=True) is not None  # compiles at its first step


def test_a_large_per_example_gradient_is_named_once(monkeypatch):
    """Past LARGE_PER_EXAMPLE elements the step says the hooked step is likely faster, once."""
    from dpfy.train import compiled_step

    monkeypatch.setattr(compiled_step, "LARGE_PER_EXAMPLE", 100)
    private = _run()
    step = private.compiled_step(compile=False)
    batches = iter(private.loader)
    with pytest.warns(UserWarning, match="hooked step .* is likely faster"):
        step(*next(batches))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(*next(batches))
