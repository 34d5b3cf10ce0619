"""What one example contributes depends on that example alone: checked by behaviour, not type.

Every row of the audit's table — user code that couples examples through the collate path, the
model or the loss, each accepted before with "no pitfalls" — must refuse the step before anything
is applied, naming the source and the fix. Per-example code (dropout included) must pass.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import dpfy
from dpfy import CheckSchedule, ExamplesCoupled

N, D, K = 64, 6, 3


def _data(seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(N, D, generator=g), torch.randint(0, K, (N,), generator=g))


def _private(model: nn.Module, data: Dataset | DataLoader, **kwargs):
    torch.manual_seed(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    return dpfy.make_private(
        model,
        optimizer,
        data,
        batch_size=32,
        steps=4,
        noise_multiplier=1.0,
        delta=1e-5,
        max_grad_norm=1.0,
        seed=0,
        **kwargs,
    )


def _one_step(private, loss_fn) -> None:
    """The README's plain loop, one step (skipping empty or one-example batches)."""
    for batch in private.loader:
        xb, yb = batch
        private.optimizer.zero_grad()
        loss_fn(private.model(xb), yb).backward()
        private.optimizer.step()
        if len(xb) > 1:
            return
    raise AssertionError("no batch of two or more examples was drawn")


def _refused(private, loss_fn, match: str) -> None:
    before = copy.deepcopy(private.model.state_dict())
    steps = private.ledger.steps
    with pytest.raises(ExamplesCoupled, match=match):
        _one_step(private, loss_fn)
    after = private.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "the refused step changed it"
    assert private.ledger.steps == steps, "the refused step was recorded"


def _mlp(*middle: nn.Module) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, 8), *middle, nn.Tanh(), nn.Linear(8, K))


# -- the model ----------------------------------------------------------------------------------
class HandBatchNorm(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return (h - h.mean(0)) / h.std(0)


class Centre(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h - h.mean(0)


class FirstRowContext(nn.Module):
    """A context layer on an activation slice ``h[:1]`` (every example sees example 0)."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + h[:1]


class MeanContext(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + 0.1 * torch.tanh(h.mean(0, keepdim=True))


class InputContext(nn.Module):
    """A model whose context comes from the input's first row: ``xb[:1].clone()``."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(D, 8)
        self.context = nn.Linear(D, 8)
        self.head = nn.Linear(8, K)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x) + self.context(x[:1].clone())))


class InputMixup(nn.Module):
    """Mixup of the inputs inside the model: every example becomes a mix with another one."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(0.7 * x + 0.3 * x.roll(1, 0))


def _ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y)


@pytest.mark.parametrize(
    ("make", "name"),
    [
        (lambda: _mlp(HandBatchNorm()), "1"),
        (lambda: _mlp(Centre()), "1"),
        (lambda: _mlp(FirstRowContext()), "1"),
        (lambda: _mlp(MeanContext()), "1"),
        (InputContext, "model"),
        (InputMixup, "model"),
    ],
    ids=["hand-batch-norm", "centre", "activation-slice", "mean-context", "input-slice", "mixup"],
)
@pytest.mark.parametrize("engine", ["fast", "vmap"])
def test_a_model_that_mixes_examples_is_refused_naming_it(make, name, engine) -> None:
    private = _private(make(), _data(), engine=engine)
    _refused(private, _ce, "the model")


def test_the_refusal_names_the_module_and_the_fix() -> None:
    private = _private(_mlp(HandBatchNorm()), _data())
    with pytest.raises(ExamplesCoupled) as err:
        _one_step(private, _ce)
    text = str(err.value)
    assert "'1' (HandBatchNorm)" in text
    assert "GroupNorm" in text and "LayerNorm" in text


def test_dropout_and_per_example_norms_pass() -> None:
    model = _mlp(nn.Dropout(0.5), nn.LayerNorm(8))
    private = _private(model, _data())
    for _ in range(3):
        _one_step(private, _ce)
    assert private.optimizer.behaviour.summary()["model"]["status"] == "passed"


# -- the loss -----------------------------------------------------------------------------------
def _info_nce(z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    z = F.normalize(z, dim=1)
    logits = z @ z.roll(1, 0).T / 0.5
    return F.cross_entropy(logits, torch.arange(len(z)))


def _mixup_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    perm = torch.arange(len(y)).roll(1)
    return 0.7 * F.cross_entropy(out, y) + 0.3 * F.cross_entropy(out, y[perm])


def _batch_label_smoothing(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    mix = F.one_hot(y, K).float().mean(0)  # smoothing towards the batch's label mix
    target = 0.8 * F.one_hot(y, K).float() + 0.2 * mix
    return -(target * out.log_softmax(1)).sum(1).mean()


def _ignore_index_mean(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    y = torch.where(y == 0, torch.full_like(y, -100), y)  # class 0 ignored: mean over the rest
    return F.cross_entropy(out, y, ignore_index=-100)


@pytest.mark.parametrize(
    "criterion",
    [
        nn.CrossEntropyLoss(weight=torch.tensor([1.0, 5.0, 0.2])),
        _info_nce,
        _mixup_loss,
        _ignore_index_mean,
        _batch_label_smoothing,
    ],
    ids=["class-weights", "info-nce", "mixup", "ignore-index-mean", "batch-label-smoothing"],
)
def test_a_loss_that_couples_examples_is_refused(criterion) -> None:
    private = _private(_mlp(), _data(), criterion=criterion)
    _refused(private, private.criterion, "the loss")


def test_a_token_loss_over_the_whole_batch_with_padding_is_refused() -> None:
    vocab, length = 7, 5
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(1, vocab, (N, length), generator=g)
    lengths = torch.randint(1, length + 1, (N,), generator=g)
    labels = tokens.clone()
    labels[torch.arange(length) >= lengths[:, None]] = -100  # padding

    def token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.view(-1, vocab), target.view(-1))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(vocab, 8), nn.Linear(8, vocab))
    private = _private(model, TensorDataset(tokens, labels), criterion=token_loss)
    _refused(private, private.criterion, "the loss")


def test_a_per_example_loss_passes_and_the_card_says_the_loss_was_checked() -> None:
    private = _private(_mlp(), _data(), criterion=nn.CrossEntropyLoss(label_smoothing=0.1))
    _one_step(private, private.criterion)
    summary = private.optimizer.behaviour.summary()
    assert summary["loss"]["status"] == "passed" and summary["loss"]["probes"] >= 1


def test_without_a_criterion_the_loss_check_is_stated_as_not_run() -> None:
    private = _private(_mlp(), _data())
    _one_step(private, _ce)
    summary = private.optimizer.behaviour.summary()
    assert summary["loss"]["status"] == "not run"
    assert "criterion=" in summary["loss"]["detail"]
    assert summary["model"]["status"] == "passed"
    assert summary["collate"]["status"] == "passed"


# -- the collate path ---------------------------------------------------------------------------
def _standardising_collate(samples):
    x = torch.stack([s[0] for s in samples])
    y = torch.stack([s[1] for s in samples])
    if len(x) > 1:
        x = (x - x.mean(0)) / (x.std(0) + 1e-6)
    return x, y


def test_a_collate_fn_with_batch_statistics_is_refused() -> None:
    loader = DataLoader(_data(), batch_size=32, collate_fn=_standardising_collate)
    private = _private(_mlp(), loader)
    _refused(private, _ce, "collate_fn")


class _Augmented(Dataset):
    """Random augmentation per fetch: no false alarm (the probe re-collates what was fetched)."""

    def __init__(self) -> None:
        self.base = _data()

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int):
        x, y = self.base[i]
        return x + 0.1 * torch.randn_like(x), y


def _random_masking_collate(samples):
    x, y = default_collate_pairs(samples)
    return x * (torch.rand_like(x) > 0.2), y


def default_collate_pairs(samples):
    return torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples])


def test_random_augmentation_and_random_collate_raise_no_false_alarm() -> None:
    private = _private(_mlp(), DataLoader(_Augmented(), batch_size=32))
    _one_step(private, _ce)
    private = _private(
        _mlp(), DataLoader(_data(), batch_size=32, collate_fn=_random_masking_collate)
    )
    _one_step(private, _ce)
    summary = private.optimizer.behaviour.summary()["collate"]
    assert summary["status"] == "not run" and "random" in summary["detail"]


def test_the_schedule_probes_the_first_steps_then_every_nth() -> None:
    schedule = CheckSchedule(first=2, every=3)
    assert [s for s in range(10) if schedule.due(s)] == [0, 1, 3, 6, 9]
    assert not any(CheckSchedule(first=0, every=None).due(s) for s in range(10))
    with pytest.raises(ValueError, match="every"):
        CheckSchedule(first=1, every=0)


def test_checks_turned_off_are_stated_and_a_coupled_model_then_passes_unseen() -> None:
    private = _private(_mlp(Centre()), _data(), behaviour_checks=CheckSchedule(first=0, every=None))
    _one_step(private, _ce)  # nothing checked: the card must say so
    summary = private.optimizer.behaviour.summary()
    assert {v["status"] for k, v in summary.items() if k != "state"} == {"not run"}
    assert "turned off" in summary["model"]["detail"]


# -- writes outside the private step ------------------------------------------------------------
class DataWrites(nn.Module):
    """Batch statistics written through ``.data``, invisible to autograd's version counter."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.lin = nn.Linear(D, K)
        self.register_buffer("running", torch.zeros(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "mul-add":
            self.running.data.mul_(0.9).add_(0.1 * x.detach().mean(0))
        elif self.how == "assign":
            self.running.data = x.detach().mean(0)
        elif self.how == "param":
            self.lin.bias.data.add_(0.01 * x.detach().mean())
        return self.lin(x)


@pytest.mark.parametrize("how", ["mul-add", "assign", "param"])
def test_a_forward_that_writes_through_data_is_refused(how) -> None:
    private = _private(DataWrites(how), _data())
    with pytest.raises(dpfy.StateChanged, match="outside the private step"):
        _one_step(private, _ce)
    assert private.ledger.steps == 0


def test_a_buffer_written_by_the_loop_between_steps_is_refused() -> None:
    private = _private(DataWrites("none"), _data())
    _one_step(private, _ce)
    x, _ = _data()[:]
    private.model.running.copy_(x.mean(0))  # the loop writes a batch statistic
    with pytest.raises(dpfy.StateChanged, match="running"):
        _one_step(private, _ce)


def test_a_buffer_declared_public_may_change() -> None:
    private = _private(DataWrites("mul-add"), _data(), public_buffers=["running"])
    _one_step(private, _ce)
    _one_step(private, _ce)
    assert private.optimizer.behaviour.summary()["state"]["status"] == "passed"


def test_an_unknown_public_buffer_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="no buffer 'nope'"):
        _private(_mlp(), _data(), public_buffers=["nope"])


# -- what the probes must not mistake for coupling, and what they state they did not see --------
class MeanLossBeside(nn.Module):
    """Returns per-example logits beside the batch's mean loss (as Hugging Face heads do)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _mlp()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.body(x)
        return {"loss": F.cross_entropy(logits, y), "logits": logits}


def test_a_batch_mean_loss_beside_per_example_outputs_is_not_a_coupling() -> None:
    private = _private(MeanLossBeside(), _data())
    for x, y in private.loader:
        private.optimizer.zero_grad()
        private.model(x, y)["loss"].backward()
        private.optimizer.step()
        if len(x) > 1:
            break
    assert private.optimizer.behaviour.summary()["model"]["status"] == "passed"


def _pad(samples, left: bool):
    width = max(len(s[0]) for s in samples)
    rows = []
    for tokens, _ in samples:
        pad = torch.zeros(width - len(tokens), dtype=tokens.dtype)
        rows.append(torch.cat([pad, tokens] if left else [tokens, pad]))
    return torch.stack(rows), torch.stack([s[1] for s in samples])


class _Ragged(Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        return torch.arange(1, 2 + i % 5), torch.tensor(i % K)


@pytest.mark.parametrize("left", [False, True], ids=["right", "left"])
def test_a_padding_collate_is_not_a_coupling(left) -> None:
    loader = DataLoader(_Ragged(), batch_size=32, collate_fn=lambda s: _pad(s, left))
    private = _private(_mlp(), loader, behaviour_checks=CheckSchedule(first=1, every=None))
    batch = next(iter(private.loader))
    assert len(batch[0]) > 1 and batch[0].shape[1] > 1
    assert private.loader.provenance.current.collate_probe == ("passed", "")


def test_a_loss_computed_around_private_criterion_is_stated_as_unchecked() -> None:
    private = _private(_mlp(), _data(), criterion=nn.CrossEntropyLoss())
    _one_step(private, _ce)  # the loop ignores private.criterion
    detail = private.optimizer.behaviour.summary()["loss"]["detail"]
    assert "private.criterion was not called" in detail


def test_a_coupled_model_is_refused_with_virtual_batches_and_per_user() -> None:
    private = _private(_mlp(Centre()), _data(), max_physical_batch_size=8)
    with pytest.raises(ExamplesCoupled, match="'1' \\(Centre\\)"):
        for x, y in private.loader:
            private.optimizer.zero_grad()
            _ce(private.model(x), y).backward()
            private.optimizer.step()
    users = torch.arange(N) % 16
    torch.manual_seed(0)
    model = _mlp(Centre())
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    private = dpfy.make_private(
        model, optimizer, _data(), batch_size=8, steps=3, noise_multiplier=1.0, delta=1e-5,
        max_grad_norm=1.0, user_ids=users,
    )  # fmt: skip
    with pytest.raises(ExamplesCoupled, match="the model"):
        for x, y in private.loader:
            private.optimizer.zero_grad()
            _ce(private.model(x), y).backward()
            private.optimizer.step()


# -- what the card says -------------------------------------------------------------------------
def _card(private, tmp_path) -> tuple[dict, str]:
    private.report(tmp_path, dataset="synthetic", overwrite=True)
    data = json.loads((tmp_path / "report.json").read_text())
    return data, (tmp_path / "report.md").read_text()


def test_the_card_says_which_checks_ran_and_warns_of_the_unchecked_loss(tmp_path) -> None:
    private = _private(_mlp(), _data())
    _one_step(private, _ce)
    data, md = _card(private, tmp_path)
    section = data["behaviour_checks"]
    assert section["checks"]["model"]["status"] == "passed"
    assert section["checks"]["loss"]["status"] == "not run" and section["gaps"] == ["loss"]
    assert "Behaviour checks of the run's own code" in md
    codes = {p["code"]: p["severity"] for p in data["pitfalls"]}
    assert codes.get("behaviour-checks-incomplete") == "warning"


def test_a_refused_coupling_is_an_error_on_the_card_without_the_private_values(tmp_path) -> None:
    private = _private(_mlp(Centre()), _data(), criterion=nn.CrossEntropyLoss())
    with pytest.raises(ExamplesCoupled) as err:
        _one_step(private, private.criterion)
    data, md = _card(private, tmp_path)
    model = data["behaviour_checks"]["checks"]["model"]
    assert model["status"] == "refused" and model["detail"] == "examples coupled in '1' (Centre)"
    assert "moved by" in str(err.value) and "moved by" not in md  # values stay off the card
    codes = {p["code"]: p["severity"] for p in data["pitfalls"]}
    assert codes.get("examples-coupled") == "error"


@pytest.mark.parametrize(
    ("reduction", "criterion"),
    [("sum", nn.CrossEntropyLoss()), ("mean", nn.CrossEntropyLoss(reduction="sum"))],
    ids=["mean-loss-told-sum", "sum-loss-told-mean"],
)
def test_a_loss_reduced_the_other_way_is_named_as_such(reduction, criterion) -> None:
    private = _private(_mlp(), _data(), criterion=criterion, loss_reduction=reduction)
    with pytest.raises(
        ExamplesCoupled, match=f"but make_private was given loss_reduction='{reduction}'"
    ):
        _one_step(private, private.criterion)


def test_a_coupling_in_bfloat16_is_still_seen() -> None:
    from dpfy.data.row_compare import first_difference

    h = torch.randn(8, 4).bfloat16()
    coupled = h - 0.5 * h.mean(0)  # ~7 % of the scale: 256 ulps of bfloat16 would hide it
    assert first_difference(h, h.clone()) is None
    assert first_difference(h, coupled) is not None
