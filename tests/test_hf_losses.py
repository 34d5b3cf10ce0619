"""Hugging Face heads' built-in losses under DP-SGD: each example's gradient is its own.

A head called with ``labels=`` averages its loss over the batch's target tokens; with padding
(labels set to -100) an example's gradient would then depend on the other examples' lengths,
and the clipped sum's sensitivity would exceed C. While an engine is attached, each known head's
loss is the per-example token mean, so the engines' clipped sum must equal the one from each
example's own backward pass — padded, C above every norm (nothing clipped, where the coupling
shows) and C between the norms. Unknown heads that compute a loss are refused.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor, nn

pytest.importorskip("transformers")

from transformers import (
    BertForMaskedLM,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
    GPT2LMHeadModel,
)

import dpfy
from dpfy.report import RunFacts
from dpfy.train.grads import make_engine
from dpfy.train.sequence_loss import per_example_token_losses, per_example_token_mean
from test_hf_models import (
    CLASSES,
    RTOL,
    VOCAB,
    bert_config,
    engine_sum,
    gpt2_config,
    reference,
    relative_error,
)

T = 8


def padded_tokens(per_token_classes: int | None = None) -> dict[str, Tensor]:
    """Four sequences of 8 tokens with 2, 5, 8 and 7 targets (the rest -100, as padding)."""
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(1, VOCAB, (4, T), generator=generator)
    labels = (
        ids.clone()
        if per_token_classes is None
        else torch.randint(0, per_token_classes, (4, T), generator=generator)
    )
    for row, length in enumerate((2, 5, 8, 7)):
        labels[row, length:] = -100
    return {"input_ids": ids, "labels": labels}


HEADS = {
    "gpt2-lm": (lambda: GPT2LMHeadModel(gpt2_config()), padded_tokens),
    "bert-mlm": (lambda: BertForMaskedLM(bert_config()), padded_tokens),
    "bert-token-cls": (
        lambda: BertForTokenClassification(bert_config(num_labels=CLASSES)),
        lambda: padded_tokens(CLASSES),
    ),
}


def built(name: str) -> tuple[nn.Module, dict[str, Tensor]]:
    torch.manual_seed(0)
    make, batch = HEADS[name]
    return make().eval(), batch()


@pytest.mark.parametrize("kind", ["fast", "vmap"])
@pytest.mark.parametrize("name", sorted(HEADS))
def test_a_padded_token_loss_gives_each_example_its_own_gradient(name, kind):
    model, batch = built(name)
    _, free = reference(model, batch, math.inf)
    for clip in (2 * float(free.max()), float(free.median())):  # nothing clipped; some clipped
        expected, norms = reference(model, batch, clip)
        got, got_norms = engine_sum(model, batch, clip, kind)
        assert relative_error(got, expected) <= RTOL, (name, kind, clip)
        torch.testing.assert_close(got_norms.double(), norms, rtol=RTOL, atol=0)


def test_a_sequence_classifier_with_an_ignored_label_counts_it_as_a_zero_loss_example():
    torch.manual_seed(0)
    model = BertForSequenceClassification(bert_config(num_labels=CLASSES)).eval()
    ids = torch.randint(1, VOCAB, (4, 6), generator=torch.Generator().manual_seed(5))
    batch = {"input_ids": ids, "labels": torch.tensor([0, -100, 2, 1])}
    _, free = reference(model, {**batch, "labels": torch.tensor([0, 1, 2, 1])}, math.inf)
    clip = 2 * float(free.max())
    # The loop's example 1 alone has no target: its gradient is zero, the others' are their own.
    kept = {k: v[[0, 2, 3]] for k, v in batch.items()}
    expected, _ = reference(model, kept, clip)
    got, norms = engine_sum(model, batch, clip, "fast")
    assert float(norms[1]) == 0.0
    assert relative_error(got, expected) <= RTOL


def test_the_tuple_output_of_return_dict_false_is_guarded_too():
    model, batch = built("gpt2-lm")
    engine = make_engine(model, "fast")
    try:
        loss = model(**batch, return_dict=False)[0]
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"]).logits
        expected = per_example_token_mean(logits, batch["labels"], shift=True)
        torch.testing.assert_close(loss, expected)
    finally:
        engine.detach()


def test_detaching_the_engine_gives_the_head_its_own_loss_back():
    model, batch = built("gpt2-lm")
    own = float(model(**batch).loss.detach())
    engine = make_engine(model, "fast")
    guarded = float(model(**batch).loss.detach())
    engine.detach()
    assert guarded != pytest.approx(own)  # padded: the batch token mean differs
    assert float(model(**batch).loss.detach()) == own


def test_a_head_whose_loss_dpfy_does_not_know_is_refused():
    torch.manual_seed(0)
    model = BertForQuestionAnswering(bert_config())
    engine = make_engine(model, "fast")
    try:
        ids = torch.randint(1, VOCAB, (2, 6))
        with pytest.raises(ValueError, match="BertForQuestionAnswering computed its own loss"):
            model(input_ids=ids, start_positions=torch.tensor([1, 9]), end_positions=ids[:, 0])
        assert model(input_ids=ids).start_logits.shape == (2, 6)  # no loss: fine
    finally:
        engine.detach()


def test_a_loss_divided_by_the_whole_batch_token_count_is_refused():
    model, batch = built("gpt2-lm")
    engine = make_engine(model, "fast")
    try:
        with pytest.raises(ValueError, match="num_items_in_batch"):
            model(**batch, num_items_in_batch=torch.tensor(22))
    finally:
        engine.detach()


def test_per_example_token_losses_average_each_sequence_over_its_own_targets():
    logits = torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 7, (3, 5), generator=torch.Generator().manual_seed(1))
    labels[0, 2:] = -100
    labels[2] = -100  # no target at all
    losses = per_example_token_losses(logits, labels)
    row0 = nn.functional.cross_entropy(logits[0, :2], labels[0, :2])
    row1 = nn.functional.cross_entropy(logits[1], labels[1])
    torch.testing.assert_close(losses, torch.stack([row0, row1, torch.tensor(0.0)]))
    shifted = per_example_token_losses(logits, labels, shift=True)
    torch.testing.assert_close(
        shifted[1], nn.functional.cross_entropy(logits[1, :-1], labels[1, 1:])
    )
    with pytest.raises(ValueError, match=r"logits must be \(batch, tokens, classes\)"):
        per_example_token_losses(logits[0], labels[0])


def test_the_report_of_a_guarded_causal_lm_states_the_per_token_normalisation(tmp_path):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(gpt2_config())
    ids = torch.randint(1, VOCAB, (64, T), generator=torch.Generator().manual_seed(2))
    private = dpfy.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), torch.utils.data.TensorDataset(ids),
        batch_size=16, delta=1e-5, max_grad_norm=1.0, steps=2, noise_multiplier=1.0, seed=0,
    )  # fmt: skip
    for (x,) in dpfy.rest_of_run(private.loader):
        if len(x):
            model(input_ids=x, labels=x).loss.backward()
        private.optimizer.step()
        private.optimizer.zero_grad()
    facts = RunFacts.load(private.report(tmp_path, plots=False)["facts"])
    assert facts.training.sequence_task
    assert facts.training.loss_normalisation == "per-token-mean"
