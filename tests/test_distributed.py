"""Distributed DP-SGD (2 CPU ranks, gloo) against one process: same update, noise, ledger.

One spawn of two processes runs every multi-rank scenario in order (start-up takes seconds on a
2-core machine) and writes what it saw to files; the tests below compare that with one-process
runs on the same union batches. The failure scenario comes last because it breaks the group.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from scipy import stats
from torch import nn
from torch.utils.data import TensorDataset

import dpfy
from dpfy.data.loader import rest_of_run
from dpfy.data.sharding import ShardedPoissonSampler
from dpfy.train.distributed import (
    PeerFailure,
    RankMismatch,
    RanksOutOfStep,
    SingleProcess,
    derive_seed,
    replicas_for,
)
from dpfy.train.ledger import PrivacyLedger
from dpfy.train.optim import NonFiniteGradientError
from dpfy.train.step_record import StepRecord

WORLD = 2
LR, CLIP, SIGMA = 0.5, 0.5, 1.0
NOISE = {"sigma": 1.3, "clip": 0.7, "batch": 40, "lr": 0.5, "size": 8000}
CONFIGS = {  # name: (engine, max_physical_batch_size, expected batch size, steps)
    "fast": ("fast", None, 24, 3),
    "vmap-virtual": ("vmap", 3, 3, 4),
}


def dataset(n: int = 120, d: int = 5, classes: int = 3) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=generator)
    return TensorDataset(x, torch.randint(0, classes, (n,), generator=generator))


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3))


class ZeroGradientModel(nn.Module):
    """Every per-example gradient is exactly zero: an update is pure noise."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(size // 2, 2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * 0.0


def private_run(config: str, **overrides: Any) -> dpfy.PrivateTraining:
    engine, physical, batch, steps = CONFIGS[config]
    model = overrides.pop("model") if "model" in overrides else mlp()
    arguments: dict[str, Any] = dict(
        batch_size=batch, steps=steps, noise_multiplier=SIGMA, delta=1e-5,
        max_grad_norm=CLIP, seed=7, engine=engine, max_physical_batch_size=physical,
    )  # fmt: skip
    arguments.update(overrides)
    data = arguments.pop("data", dataset())
    private = dpfy.make_private(
        model, torch.optim.SGD(model.parameters(), lr=LR), data, **arguments
    )
    private.optimizer.noise = NoNoise()  # test hook: the clipped sums, exactly
    return private


class NoNoise:
    """A noise source that adds nothing, to compare clipped sums exactly (tests only)."""

    def normal(self, like: torch.Tensor, std: float) -> torch.Tensor:
        return torch.zeros_like(like)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore: the zeros have no stream."""

    def reseed(self, step: int) -> None:
        """Nothing to start afresh at a resume: the zeros have no stream."""


def step(private: dpfy.PrivateTraining, x: torch.Tensor, y: torch.Tensor) -> None:
    private.optimizer.zero_grad()
    nn.functional.cross_entropy(private.model(x), y).backward()
    private.optimizer.step()


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


# ------------------------------------------------------------------------- the two ranks


def _train_and_record(config: str) -> dict[str, Any]:
    """Train on this rank; return every logical batch (for the union) and the result."""
    private = private_run(config)
    batches: list[tuple[torch.Tensor, torch.Tensor]] = []
    xs, ys = [], []
    for x, y in rest_of_run(private.loader):
        xs.append(x)
        ys.append(y)
        step(private, x, y)
        if private.optimizer.boundary.closes_batch:
            batches.append((torch.cat(xs), torch.cat(ys)))
            xs, ys = [], []
    private.replicas.verify_ledger(private.ledger)
    return {
        "batches": batches,
        "params": flat(private.model),
        "epsilon": private.epsilon(),
        "steps": private.ledger.steps,
        "private": private,
    }


def _noise_update() -> torch.Tensor:
    model = ZeroGradientModel(NOISE["size"])
    data = TensorDataset(torch.randn(400, NOISE["size"] // 2), torch.zeros(400))
    private = dpfy.make_private(
        model, torch.optim.SGD(model.parameters(), lr=NOISE["lr"]), data,
        batch_size=NOISE["batch"], steps=1, noise_multiplier=NOISE["sigma"], delta=1e-5,
        max_grad_norm=NOISE["clip"], seed=3,
    )  # fmt: skip
    before = flat(model)
    for x, _ in rest_of_run(private.loader):
        private.optimizer.zero_grad()
        private.model(x).sum().backward()
        private.optimizer.step()
    return flat(model) - before


def _refusals(rank: int) -> dict[str, str]:
    """Start-up disagreements: each must be refused with a message."""
    messages = {}
    cases = {
        "dataset_size": {"data": dataset(121 if rank == 1 else 120)},
        "sampling_rate": {"batch_size": 25 if rank == 1 else 24},
    }
    model = mlp()
    for name, overrides in cases.items():
        try:
            private_run("fast", model=model, **overrides)
            messages[name] = "not refused"
        except RankMismatch as err:
            messages[name] = str(err)
    return messages  # a DDP-wrapped model is accepted now (tests/test_fsdp.py)


def _out_of_step(rank: int) -> dict[str, str]:
    """Rank 1 catches a non-finite gradient and retries: both ranks must stop, not drift.

    (Moving on to the next batch instead is refused on that rank alone, as a skipped batch.)
    """
    messages = {}
    private = private_run("fast")
    x, y = next(iter(private.loader))
    if rank == 1:
        with contextlib.suppress(NonFiniteGradientError):  # the user's loop swallows it
            step(private, torch.full_like(x, float("nan")), y)
    try:
        step(private, x, y)
        messages["step"] = "not refused"
    except RanksOutOfStep as err:
        messages["step"] = str(err)
    messages["ledger_steps"] = str(private.ledger.steps)
    ledger = PrivacyLedger(1e-5)
    if rank == 1:
        ledger.record(StepRecord(private.loader.sampling_record, 1.0))
    try:
        private.replicas.verify_ledger(ledger)
        messages["ledger"] = "not refused"
    except RanksOutOfStep as err:
        messages["ledger"] = str(err)
    return messages


def _rank_failure(rank: int, out: Path) -> dict[str, Any]:
    """Rank 1 dies in the middle of step 2; rank 0 must stop with PeerFailure, ledger intact."""
    private = private_run("fast")
    batches = iter(private.loader)
    x, y = next(batches)
    step(private, x, y)
    private.save(out / "before-failure.pt")
    saved_epsilon = private.epsilon()
    x, y = next(batches)
    if rank == 1:
        nn.functional.cross_entropy(private.model(x), y).backward()
        return {"role": "died"}  # the process exits before optimizer.step()
    started = time.perf_counter()
    try:
        step(private, x, y)
        error = "no error"
    except PeerFailure as err:
        error = str(err)
    return {
        "error": error,
        "seconds": time.perf_counter() - started,
        "ledger_steps": private.ledger.steps,
        "saved_epsilon": saved_epsilon,
    }


def _worker(rank: int, init_file: str, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
        timeout=datetime.timedelta(seconds=30),
    )  # fmt: skip
    outdir = Path(out)
    results: dict[str, Any] = {}
    for config in CONFIGS:
        run = _train_and_record(config)
        private = run.pop("private")
        if config == "fast":
            path = private.save(outdir / "checkpoint.pt")
            results["checkpoint_seen_by_rank"] = path.exists()
            resumed = private_run(config)
            resumed.load(path)
            results["resumed_params_equal"] = bool(torch.equal(flat(resumed.model), run["params"]))
            results["resumed_epsilon"] = resumed.epsilon()
            results["resumed_sampler_rank"] = resumed.loader.dp_sampler.rank
        results[config] = run
    results["noise_update"] = _noise_update()
    results["refusals"] = _refusals(rank)
    results["out_of_step"] = _out_of_step(rank)
    results["failure"] = _rank_failure(rank, outdir)
    torch.save(results, outdir / f"rank{rank}.pt")
    # The failure scenario left the process group broken; tearing it down at interpreter exit can
    # abort inside gloo (a worker thread still joinable). Everything is written: leave at once.
    os._exit(0)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Run both ranks once; return what each saw."""
    out = tmp_path_factory.mktemp("distributed")
    mp.spawn(_worker, args=(str(out / "rendezvous"), str(out)), nprocs=WORLD, join=True)
    results = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    for result in results:
        result["dir"] = out
    return results


# ------------------------------------------------------------------------- the comparisons


def replay_union(ranks: list[dict[str, Any]], config: str) -> dpfy.PrivateTraining:
    """One process (no process group here), same settings, fed each step's union batch."""
    single = private_run(config)
    for step_index in range(ranks[0][config]["steps"]):
        x = torch.cat([r[config]["batches"][step_index][0] for r in ranks])
        y = torch.cat([r[config]["batches"][step_index][1] for r in ranks])
        single.loader.provenance.publish(len(x))  # the ranks' union is the step's Poisson batch
        step(single, x, y)
    return single


@pytest.mark.parametrize("config", list(CONFIGS))
def test_noiseless_update_equals_one_process_on_the_union_batch(ranks, config):
    """Same clipped sums, all-reduced and ÷ global B: identical to one process fed the union."""
    local = [r[config] for r in ranks]
    single = replay_union(ranks, config)
    torch.testing.assert_close(local[0]["params"], local[1]["params"], rtol=0, atol=0)
    torch.testing.assert_close(local[0]["params"], flat(single.model), rtol=1e-5, atol=1e-6)
    assert not torch.equal(local[0]["params"], flat(mlp()))  # the model did move


def test_the_union_is_a_disjoint_poisson_sample_with_empty_local_batches_as_steps(ranks):
    """Local batches never share an example; an empty local batch still takes part in a step."""
    for config in CONFIGS:
        for step_index in range(ranks[0][config]["steps"]):
            rows = [r[config]["batches"][step_index][0] for r in ranks]
            mine = {tuple(v.tolist()) for v in rows[0]}
            assert mine.isdisjoint({tuple(v.tolist()) for v in rows[1]})
    sizes = [len(r["vmap-virtual"]["batches"][i][0]) for r in ranks for i in range(4)]
    assert 0 in sizes  # the tiny-q configuration had an empty local batch (seeded)
    assert all(r["vmap-virtual"]["steps"] == 4 for r in ranks)


def test_ledger_epsilon_is_identical_on_every_rank_and_to_one_process(ranks):
    for config in CONFIGS:
        single = replay_union(ranks, config)
        assert ranks[0][config]["steps"] == ranks[1][config]["steps"] == single.ledger.steps
        assert ranks[0][config]["epsilon"] == ranks[1][config]["epsilon"] == single.epsilon()


def test_update_noise_variance_equals_one_process(ranks):
    """Zero gradients: each coordinate moves by lr·N(0, σ²C²)/B in total — shares, not W× noise."""
    first, second = (r["noise_update"].double().numpy() for r in ranks)
    np.testing.assert_array_equal(first, second)  # every rank applies the same update
    expected_var = (NOISE["lr"] * NOISE["sigma"] * NOISE["clip"] / NOISE["batch"]) ** 2
    statistic = float(np.sum(first**2) / expected_var)
    lo, hi = stats.chi2.ppf([1e-4, 1 - 1e-4], first.size)
    assert lo < statistic < hi  # W× or 1/W× the variance would be far outside
    assert stats.normaltest(first).pvalue > 1e-4


def test_checkpoint_written_once_by_rank_0_resumes_every_rank(ranks):
    for rank, result in enumerate(ranks):
        assert result["checkpoint_seen_by_rank"]
        assert result["resumed_params_equal"]
        assert result["resumed_epsilon"] == result["fast"]["epsilon"]
        assert result["resumed_sampler_rank"] == rank  # each rank got its own sampler state
    state = torch.load(ranks[0]["dir"] / "checkpoint.pt", weights_only=True)
    assert state["loader"]["world_size"] == WORLD
    assert "noise" not in state  # every rank draws fresh noise when it resumes
    with pytest.raises(ValueError, match="distributed run of 2 ranks"):
        private_run("fast").load(ranks[0]["dir"] / "checkpoint.pt")  # one process: refused


def test_ranks_that_disagree_at_start_are_refused(ranks):
    for result in ranks:
        refusals = result["refusals"]
        assert "dataset_size (rank 0: 120, rank 1: 121)" in refusals["dataset_size"]
        assert "sampling_rate (rank 0: 0.2, rank 1: 0.208" in refusals["sampling_rate"]


def test_a_rank_that_skips_a_step_stops_every_rank_before_ledgers_diverge(ranks):
    for result in ranks:
        messages = result["out_of_step"]
        assert "every rank to take every step" in messages["step"]
        assert messages["ledger_steps"] == "0"  # nothing was applied or accounted
        assert "ledgers of rank 0 and rank 1 differ" in messages["ledger"]


def test_a_rank_failing_mid_step_stops_the_others_with_a_clear_error(ranks):
    failure = ranks[0]["failure"]
    assert "another rank stopped" in failure["error"]
    assert failure["ledger_steps"] == 1  # the failed step was not accounted or applied
    state = torch.load(ranks[0]["dir"] / "before-failure.pt", weights_only=True)
    ledger = PrivacyLedger.from_state_dict(state["ledger"])
    assert ledger.steps == 1
    assert ledger.epsilon() == failure["saved_epsilon"]


def _hanging_peer(rank: int, init_file: str, out: str) -> None:
    """Rank 1 stays alive but stops stepping: rank 0 must give up after the group's timeout."""
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
        timeout=datetime.timedelta(seconds=HANG_TIMEOUT),
    )  # fmt: skip
    private = private_run("fast")
    dist.barrier()  # both ranks ready: the clock below measures the timeout only
    if rank == 1:
        time.sleep(HANG_TIMEOUT + 3)  # alive, connected, silent
        return
    x, y = next(iter(private.loader))
    started = time.perf_counter()
    try:
        step(private, x, y)
        message = "no error"
    except PeerFailure as err:
        message = str(err)
    seconds = time.perf_counter() - started
    torch.save({"message": message, "seconds": seconds}, Path(out) / "hang.pt")


HANG_TIMEOUT = 3


@pytest.mark.slow
def test_a_silent_rank_is_given_up_after_the_process_group_timeout(tmp_path):
    mp.spawn(
        _hanging_peer, args=(str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=WORLD, join=True
    )
    result = torch.load(tmp_path / "hang.pt", weights_only=True)
    assert "another rank stopped" in result["message"]
    assert HANG_TIMEOUT - 0.5 < result["seconds"] < HANG_TIMEOUT + 10


@pytest.mark.slow
def test_torchrun_dpfy_train_writes_one_run_from_rank_0(tmp_path):
    """`torchrun --nproc-per-node 2 -m dpfy train`: both ranks train, rank 0 writes and prints."""
    out = tmp_path / "run"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "dpfy", "train", "--epochs", "1", "--out", str(out),
    ]  # fmt: skip
    done = subprocess.run(
        command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert (out / "report.json").exists() and (out / "model.pt").exists()
    assert done.stdout.count("test accuracy (DP)") == 1  # rank 0 alone prints the summary
    history = json.loads((out / "history.json").read_text())["rows"]
    assert history[-1]["epsilon"] <= 3.0
    report = json.loads((out / "report.json").read_text())
    assert "Training ran in 2 processes" in report["dp_setting"]["statement"]


# ------------------------------------------------------------------------- one process


def test_shards_partition_the_dataset_and_each_index_is_kept_at_the_global_rate():
    n, q, steps = 50, 0.2, 4000
    samplers = [
        ShardedPoissonSampler(
            n, q, steps, r, 3, torch.Generator().manual_seed(derive_seed(1, r, "sampling"))
        )
        for r in range(3)
    ]
    shards = [set(s.shard.tolist()) for s in samplers]
    assert set().union(*shards) == set(range(n)) and sum(map(len, shards)) == n
    assert all(s.record.sampling_rate == q and s.record.dataset_size == n for s in samplers)
    assert sum(s.expected_local_batch_size for s in samplers) == pytest.approx(q * n)
    counts = np.zeros(n)
    for sampler in samplers:
        for batch in sampler:
            counts[batch] += 1
    expected = q * steps
    statistic = float(np.sum((counts - expected) ** 2 / (expected * (1 - q))))
    assert statistic < stats.chi2.ppf(1 - 1e-4, n)  # every index at rate q, across all shards


def test_a_rank_beyond_the_last_example_has_an_empty_shard_and_still_steps():
    sampler = ShardedPoissonSampler(3, 0.5, 2, 5, 8, torch.Generator().manual_seed(0))
    assert sampler.shard.numel() == 0 and sampler.expected_local_batch_size == 0
    assert list(sampler) == [[], []]  # empty local batches: this rank adds zeros and its share
    assert sampler.record.dataset_size == 3 and sampler.record.sampling_rate == 0.5


def test_rank_seeds_are_distinct_and_one_process_keeps_its_seeds():
    seeds = {derive_seed(0, r, p) for r in range(4) for p in ("sampling", "noise")}
    assert len(seeds) == 8
    assert derive_seed(1, 0, "noise") != derive_seed(0, 1, "noise")
    assert 0 <= derive_seed(-1, 0, "noise") < 2**63  # torch accepts negative seeds too
    assert (SingleProcess().sampling_seed(5), SingleProcess().noise_seed(5)) == (5, 6)
    with pytest.raises(ValueError, match="purpose"):
        derive_seed(0, 0, "dropout")


def test_distributed_true_without_a_process_group_is_refused():
    with pytest.raises(ValueError, match="init_process_group"):
        private_run("fast", distributed=True)
    assert isinstance(replicas_for(None, mlp()), SingleProcess)
    with pytest.raises(ValueError, match="None, True or False"):
        replicas_for("yes", mlp())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "route",
    [{"user_ids": torch.arange(120) % 10}, {"algorithm": "dp-ftrl"}],
    ids=["user-level", "dp-ftrl"],
)
def test_one_process_routes_refuse_a_running_process_group(monkeypatch, route):
    # Under torchrun these would silently train one private model per rank: W unaccounted runs.
    import dpfy.train.builder

    group = object.__new__(
        dpfy.train.builder.ProcessGroupReplicas
    )  # stands for a live 2-rank group
    monkeypatch.setattr(dpfy.train.builder, "current_replicas", lambda: group)
    model = mlp()
    kwargs = {"batch_size": 10, "delta": 1e-5, "max_grad_norm": 1.0, "steps": 2}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="one process only"):
        dpfy.make_private(model, optimizer, dataset(), noise_multiplier=1.0, **kwargs, **route)
    with pytest.raises(ValueError, match="one process only"):  # explicit, even with no group
        monkeypatch.undo()
        dpfy.make_private(
            model, optimizer, dataset(), noise_multiplier=1.0, distributed=True, **kwargs, **route
        )
    private = dpfy.make_private(  # distributed=False: the user asks for a run per rank
        model, optimizer, dataset(), noise_multiplier=1.0, distributed=False, **kwargs, **route
    )
    assert private.plan.steps == 2
