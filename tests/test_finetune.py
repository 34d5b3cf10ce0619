"""DP fine-tuning on a tiny BERT built from a config, with text generated in the test.

Nothing is downloaded: the tokenizer is a WordPiece vocabulary written to a temporary file, the
encoder a two-layer BERT of width 16, and the "Rotten Tomatoes" file a csv.bz2 of made-up
snippets in the real file's columns.
"""

from __future__ import annotations

import bz2
import csv
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from transformers import BertConfig, BertModel, BertTokenizerFast

from dpfy.data.text_datasets import RT_FILE, rotten_tomatoes, stratified_split
from dpfy.jobs.finetune_config import FinetuneConfig
from dpfy.jobs.finetune_setup import prepare_classifier
from dpfy.train.feature_cache import CachedTop, cache_features
from dpfy.train.finetune_modes import apply_mode, parse_mode
from dpfy.train.grads import make_engine
from dpfy.train.lora import is_adapter
from dpfy.train.pretrained import PretrainedSource, SequenceClassifier

WORDS = ["good", "great", "fine", "fun", "bad", "dull", "awful", "slow", "the", "film", "a"]
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def tiny_tokenizer(folder: Path) -> BertTokenizerFast:
    """A WordPiece tokenizer over a dozen words, from a vocabulary file written here."""
    vocab = folder / "vocab.txt"
    vocab.write_text("\n".join(SPECIAL + WORDS) + "\n")
    return BertTokenizerFast(vocab_file=str(vocab))


def tiny_classifier(seed: int = 0, dropout: float = 0.0) -> SequenceClassifier:
    """A two-layer BERT of width 16 with a two-class head (dropout off unless asked)."""
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=len(SPECIAL) + len(WORDS), hidden_size=16, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=24, max_position_embeddings=32,
        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
    )  # fmt: skip
    return SequenceClassifier(BertModel(config, add_pooling_layer=False), 2, dropout=dropout)


def write_snippets(path: Path, rows: int, seed: int = 0) -> Path:
    """A csv.bz2 in the real file's columns: fresh and rotten snippets, and plot rows to drop."""
    rng = np.random.default_rng(seed)
    with bz2.open(path, "wt", encoding="utf-8", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["category", "text", "movie_name", "has_plot_and_reviews"])
        for i in range(rows):
            fresh = i % 5 < 3
            words = rng.choice(WORDS[:4] if fresh else WORDS[4:8], size=rng.integers(2, 9))
            writer.writerow(["fresh" if fresh else "rotten", " ".join(words), "m", "False"])
            if i % 50 == 0:
                writer.writerow(["plot", "a long plot summary", "m", "True"])
    return path


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> BertTokenizerFast:
    return tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def snippets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_snippets(tmp_path_factory.mktemp("rt") / RT_FILE, 2100)


def test_rotten_tomatoes_keeps_fresh_and_rotten_in_a_fixed_2000_example_test_split(
    tokenizer: BertTokenizerFast, snippets: Path
) -> None:
    data = rotten_tomatoes(tokenizer, tokenizer_name="tiny", max_length=12, data_dir=snippets)
    again = rotten_tomatoes(tokenizer, tokenizer_name="tiny", max_length=12, data_dir=snippets)
    assert (len(data.train), len(data.test)) == (100, 2000)  # plot rows dropped
    ids, mask, labels = data.test.tensors
    assert ids.shape == mask.shape == (2000, 12)
    assert torch.equal(ids, again.test.tensors[0])  # the same split every run
    assert abs(float(labels.float().mean()) - 0.6) < 0.01  # stratified: 3 of 5 are fresh
    assert not data.preprocessing.fitted_on_private_data
    assert not data.preprocessing.is_pitfall


def test_a_missing_data_file_is_one_error_naming_the_fix(
    tokenizer: BertTokenizerFast, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match="--data-dir"):
        rotten_tomatoes(tokenizer, tokenizer_name="tiny", data_dir=tmp_path)


def test_stratified_split_takes_each_class_in_proportion() -> None:
    labels = np.array([0] * 700 + [1] * 300)
    train, test = stratified_split(labels, 100, seed=3)
    assert len(test) == 100 and len(train) == 900 and not set(train) & set(test)
    assert np.bincount(labels[test]).tolist() == [70, 30]


@pytest.mark.parametrize(
    ("mode", "trained"),
    [
        ("head", {"head.weight", "head.bias"}),
        ("last-1", {"head.weight", "head.bias", "encoder.encoder.layer.1.output.dense.weight"}),
        ("full", {"encoder.embeddings.word_embeddings.weight", "head.weight"}),
    ],
)
def test_each_mode_trains_only_its_part(mode: str, trained: set[str]) -> None:
    model = tiny_classifier()
    apply_mode(model, parse_mode(mode))
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained <= names
    if mode != "full":
        assert not any(n.startswith("encoder.encoder.layer.0.") for n in names)
        assert not any("embeddings" in n for n in names)


def test_lora_starts_at_the_pretrained_model_and_trains_only_adapters_and_head() -> None:
    model = tiny_classifier().eval()
    ids = torch.randint(5, 16, (3, 7))
    mask = torch.ones_like(ids)
    before = model(ids, mask)
    apply_mode(model, parse_mode("lora", rank=2))
    assert torch.allclose(model(ids, mask), before, atol=1e-6)  # B starts at zero
    adapters = [m for m in model.modules() if is_adapter(m)]
    assert len(adapters) == 4  # query and value of two layers
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert names and all("lora_" in n or n.startswith("head.") for n in names)


@pytest.mark.parametrize("mode", ["head", "last-1"])
def test_the_cached_top_computes_what_the_whole_classifier_computes(mode: str) -> None:
    model = tiny_classifier().eval()
    apply_mode(model, parse_mode(mode))
    frozen = parse_mode(mode).cached_layers(2)
    ids = torch.randint(5, 16, (4, 9))
    mask = torch.ones_like(ids)
    mask[0, 4:] = 0
    rows = torch.utils.data.TensorDataset(ids, mask, torch.zeros(4, dtype=torch.long))
    cached = cache_features(model, frozen, rows)
    top = CachedTop(model, frozen).eval()
    *inputs, _ = cached.tensors
    torch.testing.assert_close(top(*inputs), model(ids, mask), atol=1e-5, rtol=1e-5)
    assert {id(p) for p in top.parameters()} <= {id(p) for p in model.parameters()}


@pytest.mark.parametrize("mode", ["lora", "full", "last-1"])
def test_the_fast_engine_clips_the_classifier_as_the_vmap_reference_does(mode: str) -> None:
    model = tiny_classifier().eval()
    apply_mode(model, parse_mode(mode, rank=2))
    if mode == "last-1":
        ids = torch.randint(5, 16, (5, 8))
        rows = torch.utils.data.TensorDataset(ids, torch.ones_like(ids), torch.zeros(5).long())
        feats, mask, _ = cache_features(model, 1, rows).tensors
        model, inputs = CachedTop(model, 1).eval(), (feats, mask)
    else:
        ids = torch.randint(5, 16, (5, 8))
        inputs = (ids, torch.ones_like(ids))
    labels = torch.tensor([0, 1, 1, 0, 1])
    results = {}
    for kind in ("fast", "vmap"):
        engine = make_engine(model, kind)
        nn.functional.cross_entropy(model(*inputs), labels).backward()
        clip = engine.clip_and_accumulate(max_grad_norm=0.05)
        results[kind] = (clip.norms, engine.summed_grads())
        engine.detach()
    torch.testing.assert_close(results["fast"][0], results["vmap"][0], rtol=1e-4, atol=1e-6)
    for name, summed in results["vmap"][1].items():
        torch.testing.assert_close(results["fast"][1][name], summed, rtol=1e-4, atol=1e-6)


def test_prepared_reset_restores_the_public_starting_point(
    tokenizer: BertTokenizerFast, snippets: Path
) -> None:
    data = rotten_tomatoes(tokenizer, tokenizer_name="tiny", max_length=10, data_dir=snippets)
    source = PretrainedSource("tiny", Path("."), "built in the test", "0")
    prepared = prepare_classifier(tiny_classifier(), source, data, FinetuneConfig(mode="head"))
    start = prepared.trainable.head.weight.detach().clone()
    with torch.no_grad():
        prepared.trainable.head.weight.add_(1.0)
    prepared.reset()
    assert torch.equal(prepared.trainable.head.weight, start)
    assert prepared.train.tensors[0].shape == (100, 16)  # pooled features, cached once
    assert math.isclose(prepared.test.tensors[0].shape[0], 2000)


def test_an_unknown_mode_is_one_error_listing_the_modes() -> None:
    with pytest.raises(ValueError, match="lora, last-N"):
        parse_mode("last")
    with pytest.raises(ValueError, match="more layers than the encoder has"):
        apply_mode(tiny_classifier(), parse_mode("last-3"))


def test_a_model_directory_without_a_config_is_refused_naming_what_it_needs(
    tmp_path: Path,
) -> None:
    from dpfy.train.pretrained import pretrained_source

    with pytest.raises(ValueError, match=r"holds no config\.json"):
        pretrained_source(model_dir=tmp_path)
    with pytest.raises(ValueError, match="unknown pretrained model 'gpt9'"):
        pretrained_source("gpt9")
