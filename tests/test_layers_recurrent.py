"""nn.RNN / nn.GRU / nn.LSTM: exact against a per-example loop, or refused with one message."""

from __future__ import annotations

import pytest
import torch
from tests.layer_reference import assert_exact
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from dpfy.train.grads import make_engine


@pytest.fixture(autouse=True, scope="module")
def _float64_by_default():
    """Compare in float64 here, without changing the default for other test modules."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


class Recurrent(nn.Module):
    """A recurrent layer whose output sequence and final state both reach the loss."""

    def __init__(
        self,
        cls: type[nn.RNNBase],
        *,
        batch_first: bool,
        layers: int = 1,
        bidirectional: bool = False,
        model_batch_first: bool | None = None,
        **options: object,
    ) -> None:
        super().__init__()
        self.rnn = cls(
            3,
            4,
            num_layers=layers,
            bidirectional=bidirectional,
            batch_first=batch_first,
            **options,
        )
        out = options.get("proj_size") or 4
        self.head = nn.Linear(out * (2 if bidirectional else 1), 2)
        # The model's own input layout (may differ from the layer's: it then transposes).
        self.model_batch_first = batch_first if model_batch_first is None else model_batch_first

    def forward(self, x: Tensor, state: object = None) -> Tensor:
        layer_first = self.rnn.batch_first
        if self.model_batch_first != layer_first:
            x = x.transpose(0, 1)
        out, hidden = self.rnn(x, state)
        h_n = hidden[0] if isinstance(hidden, tuple) else hidden  # (layers·dirs, B, H)
        pooled = out.mean(1 if layer_first else 0)  # (B, features)
        return self.head(pooled).square().sum(1) + 0.3 * h_n.square().sum((0, 2))


def _batch(model: Recurrent, n: int, steps: int) -> Tensor:
    shape = (n, steps, 3) if model.model_batch_first else (steps, n, 3)
    return torch.randn(shape)


def _example(x: Tensor, i: int, batch_first: bool) -> Tensor:
    return x[i : i + 1] if batch_first else x[:, i : i + 1]


CLASSES = [nn.RNN, nn.GRU, nn.LSTM]


ENGINES = ["fast", "vmap"]


@pytest.mark.parametrize("kind", ENGINES)
@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize(("layers", "bidirectional"), [(1, False), (2, True)])
def test_recurrent_layer_matches_a_per_example_loop(kind, cls, batch_first, layers, bidirectional):
    torch.manual_seed(0)
    model = Recurrent(cls, batch_first=batch_first, layers=layers, bidirectional=bidirectional)
    x = _batch(model, 5, 4)
    assert_exact(
        model,
        lambda i: model(_example(x, i, batch_first)).sum(),
        lambda: model(x),
        5,
        kind=kind,
        reduction="mean" if batch_first else "sum",
        batch_first=batch_first,
    )


@pytest.mark.parametrize("nonlinearity", ["tanh", "relu"])
def test_rnn_without_biases_matches_the_loop_on_both_engines(nonlinearity):
    torch.manual_seed(5)
    model = Recurrent(nn.RNN, batch_first=True, layers=2, bias=False, nonlinearity=nonlinearity)
    x = _batch(model, 4, 3)
    for kind in ENGINES:
        assert_exact(model, lambda i: model(x[i : i + 1]).sum(), lambda: model(x), 4, kind=kind)


@pytest.mark.parametrize("kind", ENGINES)
@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_layer_layout_of_its_own_is_read_from_the_layer_not_the_model(kind, cls):
    # A batch-first model holding a sequence-first recurrent layer (it transposes).
    torch.manual_seed(1)
    model = Recurrent(cls, batch_first=False, layers=2, model_batch_first=True)
    x = _batch(model, 4, 3)
    assert_exact(model, lambda i: model(x[i : i + 1]).sum(), lambda: model(x), 4, kind=kind)


@pytest.mark.parametrize("kind", ENGINES)
@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_initial_state_given_by_the_caller_is_each_examples_own(kind, cls):
    torch.manual_seed(2)
    model = Recurrent(cls, batch_first=True, layers=2, bidirectional=True)
    x = _batch(model, 4, 3)
    h0 = torch.randn(4, 4, 4)
    c0 = torch.randn(4, 4, 4)

    def state(rows: slice) -> object:
        return (h0[:, rows], c0[:, rows]) if cls is nn.LSTM else h0[:, rows]

    assert_exact(
        model,
        lambda i: model(x[i : i + 1], state(slice(i, i + 1))).sum(),
        lambda: model(x, state(slice(None))),
        4,
        kind=kind,
    )


def test_lstm_with_projection_and_microbatches_matches_the_loop():
    torch.manual_seed(3)
    model = Recurrent(nn.LSTM, batch_first=True, layers=2, bidirectional=True, proj_size=2)
    x = _batch(model, 6, 3)
    assert_exact(model, lambda i: model(x[i : i + 1]).sum(), lambda: model(x), 6, microbatch=2)


@pytest.mark.parametrize("kind", ENGINES)
def test_microbatches_and_frozen_parameters_of_a_gru_match_the_loop(kind):
    torch.manual_seed(7)
    model = Recurrent(nn.GRU, batch_first=False, layers=2, bidirectional=True)
    model.rnn.bias_hh_l1_reverse.requires_grad_(False)
    model.rnn.weight_ih_l0.requires_grad_(False)
    x = _batch(model, 6, 3)
    assert_exact(
        model,
        lambda i: model(x[:, i : i + 1]).sum(),
        lambda: model(x),
        6,
        kind=kind,
        microbatch=3,
        batch_first=False,
    )


class Packed(nn.Module):
    """Padded sequences of different lengths, packed for the recurrent layer."""

    def __init__(self, cls: type[nn.RNNBase], batch_first: bool, enforce_sorted: bool) -> None:
        super().__init__()
        self.rnn = cls(3, 4, num_layers=2, bidirectional=True, batch_first=batch_first)
        self.head = nn.Linear(8, 2)
        self.enforce_sorted = enforce_sorted

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:  # x: (B, T, 3), padded
        seq = x if self.rnn.batch_first else x.transpose(0, 1)
        packed = pack_padded_sequence(
            seq, lengths, batch_first=self.rnn.batch_first, enforce_sorted=self.enforce_sorted
        )
        out, hidden = self.rnn(packed)
        h_n = hidden[0] if isinstance(hidden, tuple) else hidden
        padded, _ = pad_packed_sequence(out, batch_first=True)  # zeros past each length
        pooled = padded.sum(1) / lengths[:, None]
        return self.head(pooled).square().sum(1) + 0.3 * h_n.square().sum((0, 2))


@pytest.mark.parametrize("kind", ENGINES)
@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("batch_first", [True, False])
def test_packed_sequences_match_a_per_example_loop(kind, cls, batch_first):
    torch.manual_seed(4)
    lengths = torch.tensor([3, 5, 1, 5, 2]) if batch_first else torch.tensor([5, 5, 3, 2, 1])
    model = Packed(cls, batch_first, enforce_sorted=not batch_first)
    x = torch.randn(5, 5, 3)
    assert_exact(
        model,
        lambda i: model(x[i : i + 1, : lengths[i]], lengths[i : i + 1]).sum(),
        lambda: model(x, lengths),
        5,
        kind=kind,
        reduction="mean",
    )


@pytest.mark.parametrize("kind", ENGINES)
def test_dropout_between_stacked_layers_in_training_is_refused_by_name(kind):
    model = Recurrent(nn.GRU, batch_first=True, layers=2, dropout=0.3)
    engine = make_engine(model, kind)
    model(torch.randn(3, 4, 3)).sum().backward()
    with pytest.raises(ValueError, match=r"GRU\(dropout=0.3\).*dropout=0"):
        engine.clip_and_accumulate(1.0, "sum")
    assert engine.num_examples == 0 and not engine.summed_grads()["rnn.weight_ih_l0"].any()
    engine.detach()
    model.eval()  # in evaluation mode the layer draws no dropout: nothing to refuse
    x = torch.randn(3, 4, 3)
    assert_exact(model, lambda i: model(x[i : i + 1]).sum(), lambda: model(x), 3, kind=kind)


class PackedIntoLinear(nn.Module):
    """A layer without a rule for packed sequences, handed one."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Unpacking()

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
        return self.inner(pack_padded_sequence(x, lengths, batch_first=True)).sum(1)


class Unpacking(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3))

    def forward(self, packed: object) -> Tensor:
        padded, _ = pad_packed_sequence(packed, batch_first=True)
        return (padded * self.weight).sum(1)


def test_packed_sequence_into_a_layer_that_cannot_split_it_is_refused_naming_the_type():
    model = PackedIntoLinear()
    engine = make_engine(model, "vmap")
    model(torch.randn(3, 4, 3), torch.tensor([4, 2, 1])).sum().backward()
    with pytest.raises(ValueError, match=r"'inner' \(Unpacking\) takes a PackedSequence"):
        engine.clip_and_accumulate(1.0, "sum")
    engine.detach()


def test_auto_runs_recurrent_layers_on_their_fast_rule():
    engine = make_engine(Recurrent(nn.GRU, batch_first=True, layers=2, bidirectional=True))
    assert engine.kind == "fast" and engine.fallback_reason is None
    engine.detach()


def test_auto_names_the_lstm_projection_that_forced_vmap():
    engine = make_engine(Recurrent(nn.LSTM, batch_first=True, proj_size=2))
    assert engine.kind == "vmap"
    assert engine.fallback_reason == (
        "layer 'rnn' (LSTM): proj_size > 0 is not covered by the fast rule"
    )
    engine.detach()


def test_packed_batches_on_the_fast_engine_are_replayed_and_named():
    torch.manual_seed(6)
    model = Packed(nn.GRU, True, enforce_sorted=False)
    engine = make_engine(model, "fast")
    model(torch.randn(3, 4, 3), torch.tensor([4, 2, 3])).sum().backward()
    engine.clip_and_accumulate(1.0, "sum")
    assert engine.replayed_layers == {"rnn"}
    engine.detach()
