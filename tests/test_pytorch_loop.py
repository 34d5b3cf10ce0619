"""The loop a PyTorch user writes: one pass is one epoch, a DataLoader is accepted, a report is one
call, and the README's snippet runs as written."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpfy
from dpfy.data.loader import DPDataLoader, PlanComplete, rest_of_run

README = Path(__file__).resolve().parents[1] / "README.md"


def data(n: int = 100, features: int = 5) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(n, features, generator=g), torch.randint(0, 3, (n,), generator=g)
    )


def run(train, **options) -> dpfy.PrivateTraining:
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    settings = {"delta": 1e-5, "max_grad_norm": 1.0, "noise_multiplier": 1.0, "seed": 3}
    return dpfy.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), train, **{**settings, **options}
    )


def step_on(private: dpfy.PrivateTraining, x: torch.Tensor, y: torch.Tensor) -> None:
    private.optimizer.zero_grad()
    nn.functional.cross_entropy(private.model(x), y).backward()
    private.optimizer.step()


def epoch_of(private: dpfy.PrivateTraining) -> int:
    """Train one pass over the private loader; its number of steps."""
    steps = 0
    for x, y in private.loader:
        step_on(private, x, y)
        steps += 1
    return steps


def test_one_pass_over_the_private_loader_is_one_epoch():
    private = run(data(100), batch_size=10, epochs=4)
    assert len(private.loader) == 10 and private.loader.epochs == 4
    per_pass = []
    for _epoch in range(4):  # the usual loop: no BudgetExhausted in epoch 2
        count = 0
        for x, y in private.loader:
            step_on(private, x, y)
            count += 1
        per_pass.append(count)
    assert per_pass == [10, 10, 10, 10]
    assert private.ledger.steps == private.plan.steps == 40


def test_e_passes_hold_the_plans_steps_when_n_over_b_is_fractional():
    private = run(data(100), batch_size=16, epochs=3)  # N/B = 6.25: ⌈3 · 6.25⌉ = 19 steps
    lengths = [epoch_of(private) for _ in range(private.loader.epochs)]
    assert private.loader.epochs == 3 and private.plan.steps == 19
    assert lengths == [math.ceil(k * 6.25) - math.ceil((k - 1) * 6.25) for k in (1, 2, 3)]
    assert private.ledger.steps == 19


def test_a_pass_beyond_the_plan_is_refused_before_anything_is_drawn():
    private = run(data(100), batch_size=10, epochs=1)
    for x, y in private.loader:
        step_on(private, x, y)
    position = private.loader.dp_sampler.position
    with pytest.raises(PlanComplete, match="all 10 planned steps"):
        next(iter(private.loader))
    assert private.loader.dp_sampler.position == position and private.ledger.steps == 10
    assert issubclass(dpfy.PlanComplete, RuntimeError)


def test_rest_of_run_iterates_every_planned_step_in_one_loop():
    private = run(data(100), batch_size=10, epochs=2.5)
    for x, y in rest_of_run(private.loader):
        step_on(private, x, y)
    assert private.ledger.steps == private.plan.steps == 25
    with pytest.raises(ValueError, match="unbounded"):
        next(rest_of_run(DPDataLoader(data(), 10)))


def test_an_unbounded_loader_keeps_drawing_one_epoch_per_pass():
    loader = DPDataLoader(data(100), 10, generator=torch.Generator().manual_seed(1))
    assert loader.epochs is None and loader.total_steps is None
    assert [sum(1 for _ in loader) for _ in range(3)] == [10, 10, 10]
    assert loader.steps_taken == 30


def test_a_pass_left_early_goes_on_with_the_batches_workers_drew_ahead():
    ids = TensorDataset(torch.arange(40))
    whole = DPDataLoader(ids, 4, steps=20, generator=torch.Generator().manual_seed(5))
    reference = [b[0].tolist() for b in rest_of_run(whole)]
    loader = DPDataLoader(
        ids, 4, steps=20, generator=torch.Generator().manual_seed(5), num_workers=2,
        prefetch_factor=2,
    )  # fmt: skip
    seen = []
    for (batch,) in loader:
        seen.append(batch.tolist())
        if len(seen) == 3:
            break  # the workers have drawn more than 3 batches by now
    assert loader.dp_sampler.position > 3 and loader.epoch == 0
    seen += [b[0].tolist() for b in rest_of_run(loader)]
    assert seen == reference


def test_a_resumed_loader_continues_its_interrupted_epoch():
    first = DPDataLoader(data(100), 10, epochs=3, generator=torch.Generator().manual_seed(2))
    batches = iter(first)
    for _ in range(14 - 10):
        next(batches)
    for _ in rest_of_run(first):  # epoch 0 left after 4 batches; the rest of the run
        break
    state = first.state_dict()
    second = DPDataLoader(data(100), 10, epochs=3, generator=torch.Generator().manual_seed(9))
    second.load_state_dict(state)
    assert (second.epoch, second.steps_taken) == (first.epoch, first.steps_taken) == (0, 5)
    assert len(second) == 5 and sum(1 for _ in rest_of_run(second)) == 25


def test_user_level_epochs_are_users_over_b_steps():
    users = torch.arange(100) % 30  # 30 users
    private = run(data(100), batch_size=4, epochs=2, user_ids=users)  # 30 / 4 = 7.5 per epoch
    lengths = [epoch_of(private) for _ in range(private.loader.epochs)]
    assert lengths == [8, 7] and private.ledger.steps == private.plan.steps == 15


# -- a torch DataLoader where the dataset goes ----------------------------------------------------
def pad_collate(samples):
    x = torch.stack([s[0] for s in samples])
    return x, torch.stack([s[1] for s in samples])


def test_a_torch_dataloader_brings_its_dataset_batch_size_and_loading_options():
    generator = torch.Generator().manual_seed(11)
    user_loader = DataLoader(
        data(100), batch_size=20, shuffle=True, drop_last=True, collate_fn=pad_collate,
        num_workers=1, generator=generator,
    )  # fmt: skip
    private = run(user_loader, epochs=1)
    loader = private.loader
    assert private.plan.expected_batch_size == 20 and private.plan.dataset_size == 100
    assert loader.sampling_record.kind.value == "poisson" and loader.sampling_rate == 0.2
    assert loader.num_workers == 1 and loader.collate_fn.inner.collate_fn is pad_collate
    assert loader.generator is generator  # seeds the workers; the sampler has its own
    for x, y in loader:
        step_on(private, x, y)
    assert private.ledger.steps == 5


def test_a_batch_size_the_dataloader_contradicts_is_refused():
    with pytest.raises(ValueError, match="batch_size=32 and the DataLoader's batch_size=20"):
        run(DataLoader(data(100), batch_size=20), batch_size=32, epochs=1)
    assert run(DataLoader(data(100), batch_size=20), batch_size=20, epochs=1).plan.steps == 5


def test_a_dataloader_without_a_batch_size_needs_one():
    sampler = torch.utils.data.BatchSampler(range(100), 10, drop_last=False)
    with pytest.raises(ValueError, match="pass batch_size="):
        run(DataLoader(data(100), batch_sampler=sampler), epochs=1)
    assert run(DataLoader(data(100), batch_sampler=sampler), batch_size=10, epochs=1)


def test_a_dataset_without_batch_size_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="batch_size is required"):
        run(data(100), epochs=1)


def test_a_private_loader_is_not_wrapped_again():
    private = run(data(100), batch_size=10, epochs=1)
    with pytest.raises(ValueError, match="already a private loader"):
        run(private.loader, epochs=1)


def test_loading_options_set_twice_differently_are_refused():
    user_loader = DataLoader(data(100), batch_size=10, num_workers=1)
    with pytest.raises(ValueError, match="num_workers"):
        run(user_loader, epochs=1, loader_options={"num_workers": 2})


# -- the report of the user's own loop ------------------------------------------------------------
def test_private_report_writes_the_card_of_the_users_own_loop(tmp_path):
    private = run(data(100), batch_size=10, epochs=2)
    history = []
    for epoch in range(private.loader.epochs):
        for x, y in private.loader:
            step_on(private, x, y)
        row = {"step": private.ledger.steps, "loss": 1.0 / (epoch + 1)}
        history.append({**row, "epsilon": private.epsilon()})
    written = private.report(tmp_path / "run", dataset="toy", accuracy=0.5, history=history)
    assert {"facts", "markdown", "json"} <= set(written)
    facts = json.loads((tmp_path / "run" / "facts.json").read_text())
    assert facts["training"]["steps_taken"] == 20 and facts["dataset"]["name"] == "toy"
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report  # rendered from the same facts
    text = (tmp_path / "run" / "report.md").read_text()
    assert "toy" in text and f"{private.epsilon():.3f}"[:4] in text


def test_private_report_never_overwrites_a_report_silently(tmp_path):
    private = run(data(100), batch_size=10, epochs=1)
    private.report(tmp_path)
    before = (tmp_path / "facts.json").read_bytes()
    with pytest.raises(ValueError, match="already holds a report"):
        private.report(tmp_path)
    assert (tmp_path / "facts.json").read_bytes() == before
    private.report(tmp_path, overwrite=True, model="linear")
    assert json.loads((tmp_path / "facts.json").read_text())["model"]["name"] == "linear"


def readme_loop_snippet() -> str:
    text = README.read_text()
    start = text.index("```python\n", text.index("## Train: DP-SGD on any PyTorch model"))
    start += len("```python\n")
    return text[start : text.index("```\n", start)]


def test_the_readmes_loop_runs_as_written(tmp_path):
    snippet = readme_loop_snippet()
    assert re.search(r"for epoch in range\(private\.loader\.epochs\)", snippet)
    (tmp_path / "snippet.py").write_text(snippet)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "snippet.py"], cwd=tmp_path, capture_output=True, text=True,
        timeout=600, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 10 and lines[-1].startswith("epoch 10: ε = ")
    assert float(lines[-1].split("= ")[1]) <= 3.0
    assert (tmp_path / "runs" / "readme" / "report.md").is_file()
