"""The datasets a tuning run can use: the bundled ones, and fine-tuning features of a public model.

Tuning the head of a pretrained encoder is tuning logistic regression on the features the frozen
public encoder computes from the private text (``dpfy finetune --mode head`` trains exactly that),
so ``dpfy tune --dataset rotten-tomatoes --model logreg`` tunes a fine-tuning run the guide's way
(§5.4.2): on a split declared public, or with the trials accounted. The features are a fixed
function of one record each, so DP-SGD on the head covers them; the report names the weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dpfy.data.datasets import LoadedDataset, load_dataset
from dpfy.data.preprocessing import Preprocessing
from dpfy.report.run_parts import PublicInput
from dpfy.tune.names import TUNING_DATASET_NAMES

__all__ = ["FEATURE_DATASETS", "TUNING_DATASET_NAMES", "TuningDataset", "load_tuning_dataset"]


@dataclass(frozen=True)
class TuningDataset:
    """A dataset to tune on, and the public things its features came from (for the report)."""

    data: LoadedDataset
    public_inputs: tuple[PublicInput, ...] = ()


def _rotten_tomatoes(data_dir: Path | None, limit: int | None) -> TuningDataset:
    """Rotten Tomatoes as the pooled features of bundled MiniLM (the finetune job's head mode)."""
    from dpfy.jobs.finetune_config import FinetuneConfig
    from dpfy.jobs.finetune_setup import prepare, public_inputs

    prepared = prepare(FinetuneConfig(mode="head", data_dir=data_dir, limit=limit))
    text = prepared.data
    steps = (
        *text.preprocessing.steps,
        f"each snippet's mean-pooled token states from the frozen public encoder "
        f"{prepared.source.name} (a fixed function of that snippet alone)",
    )
    data = LoadedDataset(
        name=f"{text.name} ({prepared.source.name} features)",
        train=prepared.train,
        test=prepared.test,
        num_classes=text.num_classes,
        input_shape=tuple(prepared.train.tensors[0].shape[1:]),
        source=text.source,
        preprocessing=Preprocessing(
            steps=steps,
            fitted_on_private_data=text.preprocessing.fitted_on_private_data,
            declared_public=text.preprocessing.declared_public,
        ),
        split=text.split,
        class_names=text.class_names,
    )
    return TuningDataset(data, public_inputs(prepared))


FEATURE_DATASETS: dict[str, Callable[[Path | None, int | None], TuningDataset]] = {
    "rotten-tomatoes": _rotten_tomatoes,
}


def load_tuning_dataset(name: str, data_dir: Path | None, limit: int | None) -> TuningDataset:
    """A bundled dataset, or a feature dataset of a public pretrained model, by name."""
    if name in FEATURE_DATASETS:
        return FEATURE_DATASETS[name](data_dir, limit)
    return TuningDataset(load_dataset(name, data_dir=data_dir, limit=limit))
