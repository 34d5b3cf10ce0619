"""What a fine-tuning run trains on, built once: the public weights, the data, the trainable part.

:func:`prepare` loads the public pretrained encoder and its tokenizer, tokenises Rotten Tomatoes,
freezes what the mode does not train and, for ``last-N`` and ``head``, computes the frozen lower
layers' output once (:mod:`dpfy.train.feature_cache`). :meth:`Prepared.reset` puts the trainable
values back to their public starting point, so a private run and its non-private baseline (or
the benchmark's runs at several ε) start from the same initialisation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn
from torch.utils.data import TensorDataset

from dpfy.data.text_datasets import TextDataset, rotten_tomatoes
from dpfy.jobs.config import public_seed
from dpfy.jobs.finetune_config import FinetuneConfig
from dpfy.report.run_parts import PublicInput
from dpfy.train.feature_cache import CachedTop, cache_features
from dpfy.train.finetune_modes import TrainableMode, apply_mode, encoder_layers, parse_mode
from dpfy.train.pretrained import (
    PretrainedSource,
    SequenceClassifier,
    load_encoder,
    load_tokenizer,
    pretrained_source,
)

__all__ = ["Prepared", "prepare", "public_inputs"]

#: Progress callback: (what is running, examples done, examples in all).
OnProgress = Callable[[str, int, int], None]


@dataclass
class Prepared:
    """The run's public starting point and data: the classifier, what trains, what it sees."""

    source: PretrainedSource
    data: TextDataset
    mode: TrainableMode
    classifier: SequenceClassifier
    trainable: nn.Module  # the classifier itself, or its top over cached features
    train: TensorDataset  # rows the trainable part takes (tokens, or cached features)
    test: TensorDataset
    initial: dict[str, torch.Tensor]
    cached_layers: int | None = None

    def reset(self) -> None:
        """Every trainable value back to its public starting point (Parameters kept)."""
        with torch.no_grad():
            for name, parameter in self.trainable.named_parameters():
                if name in self.initial:
                    parameter.copy_(self.initial[name])

    @property
    def model_name(self) -> str:
        """How the report names the model: weights, mode and head."""
        return f"{self.source.name} ({self.mode.label} fine-tuning, linear head)"


def public_inputs(prepared: Prepared) -> tuple[PublicInput, ...]:
    """The public things the run used, for the report card: the weights and the tokenizer."""
    source = prepared.source
    return (
        PublicInput("pretrained weights", source.name, source.origin, source.version),
        PublicInput("tokenizer", f"{source.name} WordPiece vocabulary", source.origin,
                    source.version),
    )  # fmt: skip


def _cached(
    classifier: SequenceClassifier,
    frozen: int,
    data: TextDataset,
    on_progress: OnProgress | None,
) -> tuple[TensorDataset, TensorDataset]:
    """Both splits through the frozen bottom, reporting progress as examples are done."""
    total = len(data.train) + len(data.test)
    done = 0

    def advance(count: int) -> None:
        nonlocal done
        done += count
        if on_progress is not None:
            on_progress("caching public features", done, total)

    return (
        cache_features(classifier, frozen, data.train, on_batch=advance),
        cache_features(classifier, frozen, data.test, on_batch=advance),
    )


T = TypeVar("T")


def _check_positions(source: PretrainedSource, max_length: int) -> None:
    """``--max-length`` within the model's positions, and its config.json readable JSON (read
    bounded: a FIFO or device is one line), before anything is tokenised."""
    from dpfy._safe_io import read_json

    path = Path(source.path) / "config.json"
    if not path.exists():
        return  # a bundled model without one: the loader words what is missing
    document = read_json(path, "model config")
    if not isinstance(document, dict):
        raise ValueError(f"model config {path} is not a JSON object; pass an intact model")
    positions = document.get("max_position_embeddings")
    if isinstance(positions, int) and not isinstance(positions, bool) and max_length > positions:
        raise ValueError(
            f"--max-length {max_length} exceeds the {positions} positions {source.name} was "
            f"pretrained with ({path}); pass --max-length {positions} or less"
        )


def _loaded(load: Callable[[], T], source: PretrainedSource, what: str) -> T:
    """Load the model's tokenizer or weights; a truncated or malformed file is one line."""
    try:
        return load()
    except ValueError as err:
        if "fine-tuning needs" in str(err):
            raise
        reason = " ".join(str(err).split())[:200]
    except Exception as err:  # transformers, safetensors, tokenizers and json all raise their own
        reason = f"{type(err).__name__}: {' '.join(str(err).split())[:200]}"
    raise ValueError(
        f"cannot load the {what} of {source.name} from {source.path} ({reason}); pass an intact "
        "Hugging Face model directory (config.json, the weights and the tokenizer files)"
    )


def prepare(config: FinetuneConfig, on_progress: OnProgress | None = None) -> Prepared:
    """Load, tokenise, freeze and (for last-N and head) cache: everything before training."""
    source = pretrained_source(config.model, config.model_dir)
    _check_positions(source, config.max_length)
    data = rotten_tomatoes(
        _loaded(lambda: load_tokenizer(source), source, "tokenizer"),
        tokenizer_name=source.name,
        max_length=config.max_length,
        data_dir=config.data_dir,
        limit=config.limit,
    )
    torch.manual_seed(public_seed(config.seed))  # head and adapters: public randomness
    encoder = _loaded(lambda: load_encoder(source), source, "weights")
    classifier = SequenceClassifier(encoder, data.num_classes)
    return prepare_classifier(classifier, source, data, config, on_progress)


def prepare_classifier(
    classifier: SequenceClassifier,
    source: PretrainedSource,
    data: TextDataset,
    config: FinetuneConfig,
    on_progress: OnProgress | None = None,
) -> Prepared:
    """Freeze ``classifier`` for the configured mode and cache what stays frozen."""
    mode = parse_mode(config.mode, config.lora_rank)
    apply_mode(classifier, mode)
    caches = mode.kind in ("head", "last")
    frozen = mode.cached_layers(len(encoder_layers(classifier))) if caches else None
    trainable: nn.Module = classifier
    train, test = data.train, data.test
    if frozen is not None:
        train, test = _cached(classifier, frozen, data, on_progress)
        trainable = CachedTop(classifier, frozen)
    initial = {
        name: p.detach().clone() for name, p in trainable.named_parameters() if p.requires_grad
    }
    return Prepared(source, data, mode, classifier, trainable, train, test, initial, frozen)
