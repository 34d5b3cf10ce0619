"""Noise drawn ahead on a worker thread: used once, right variance, checkpoint-exact, off-thread."""

from __future__ import annotations

import contextlib
import itertools
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch
from scipy import stats
from torch import nn
from torch.utils.data import TensorDataset

import dpfy
from dpfy.grads.registry import Into, row_blocks
from dpfy.grads.rules._bilinear import product_into
from dpfy.noise import TorchNoise
from dpfy.noise_ahead import FIRST_BLOCKS_HERE, HEAD_BLOCKS, NoiseAhead


def params() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(300, 40), "b": torch.zeros(40)}


def test_each_take_is_a_fresh_draw_with_the_stated_variance():
    ahead = NoiseAhead(TorchNoise(seed=0))
    draws = []
    for _ in range(5):
        ahead.prepare(params(), 2.0)
        draws.append(torch.cat([t.flatten() for t in ahead.take(params(), 2.0).values()]))
    for i in range(5):  # never the same buffer twice, and no draw repeats another
        assert not any(torch.equal(draws[i], draws[j]) for j in range(i))
    values = torch.cat(draws).double()
    statistic = float((values**2).sum() / 4.0)
    low, high = stats.chi2.ppf([1e-6, 1 - 1e-6], values.numel())
    assert low < statistic < high


def test_take_without_prepare_draws_on_the_spot_and_continues_the_same_stream():
    ahead, plain = NoiseAhead(TorchNoise(seed=3)), TorchNoise(seed=3)
    ahead.prepare(params(), 1.0)
    first = ahead.take(params(), 1.0)
    second = ahead.take(params(), 1.0)  # nothing prepared: drawn now
    expected = [plain.normal(t, 1.0) for _ in range(2) for t in params().values()]
    got = [*first.values(), *second.values()]
    for mine, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


def test_a_draw_for_other_shapes_is_dropped_not_used():
    ahead = NoiseAhead(TorchNoise(seed=1))
    ahead.prepare(params(), 1.0)
    changed = {"w": torch.zeros(300, 40, dtype=torch.float64), "b": torch.zeros(40)}
    taken = ahead.take(changed, 1.0)
    assert taken["w"].dtype == torch.float64
    dropped = NoiseAhead(TorchNoise(seed=1)).take(params(), 1.0)  # what the dropped draw held
    assert not torch.equal(taken["b"], dropped["b"])
    assert not torch.equal(taken["w"].float(), dropped["w"])


def test_checkpoint_with_a_waiting_draw_resumes_the_same_stream():
    ahead = NoiseAhead(TorchNoise(seed=5))
    ahead.take(params(), 1.0)
    ahead.prepare(params(), 1.0)  # drawn, not yet used, when the checkpoint is taken
    state = ahead.state_dict()
    expected = ahead.take(params(), 1.0)
    resumed = NoiseAhead(TorchNoise(seed=99))
    resumed.load_state_dict(state)
    for name, value in resumed.take(params(), 1.0).items():
        assert torch.equal(value, expected[name])


def test_the_draw_runs_on_a_worker_thread_and_its_errors_reach_the_caller():
    class Recording:
        def __init__(self, fail: bool = False) -> None:
            self.threads: list[str] = []
            self.fail = fail

        def normal(self, like: torch.Tensor, std: float) -> torch.Tensor:
            self.threads.append(threading.current_thread().name)
            if self.fail:
                raise MemoryError("no room for noise")
            return torch.zeros(like.shape)

    source = Recording()
    ahead = NoiseAhead(source)
    ahead.prepare(params(), 1.0)
    ahead.take(params(), 1.0)
    assert source.threads == ["dpfy-noise", "dpfy-noise"]
    failing = NoiseAhead(Recording(fail=True))
    failing.prepare(params(), 1.0)
    with pytest.raises(MemoryError, match="no room"):
        failing.take(params(), 1.0)


def test_private_step_starts_from_the_noise_and_adds_the_clipped_sum():
    class Constant:
        def normal(self, like: torch.Tensor, std: float) -> torch.Tensor:
            return torch.full(like.shape, std)

    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    data = TensorDataset(torch.zeros(40, 3), torch.zeros(40, dtype=torch.long))
    private = dpfy.make_private(
        model, torch.optim.SGD(model.parameters(), lr=1.0), data, batch_size=10, steps=1,
        noise_multiplier=2.0, delta=1e-5, max_grad_norm=1.0, seed=0,
    )  # fmt: skip
    private.optimizer.noise = Constant()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = next(iter(private.loader))
    private.optimizer.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    private.optimizer.step()
    # x = 0, y = 0: every example's weight gradient is 0 and its bias gradient softmax(b) - e₀
    per_example = torch.softmax(before["bias"], 0) - torch.tensor([1.0, 0.0])
    clipped_sum = len(x) * per_example * min(1.0, 1.0 / float(per_example.norm()))
    torch.testing.assert_close(model.weight.detach(), before["weight"] - 2.0 / 10)
    torch.testing.assert_close(model.bias.detach(), before["bias"] - (clipped_sum + 2.0) / 10)


def seeded_run(
    width: int = 8, inputs: int = 5, physical: int | None = None
) -> dpfy.PrivateTraining:
    """A small seeded private run; ``inputs`` × ``width`` is the first layer (the one filled last).

    ``physical``: the physical batch size (virtual batching), if any.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(inputs, width), nn.ReLU(), nn.Linear(width, 3))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(100, inputs, generator=g), torch.randint(0, 3, (100,), generator=g)
    return dpfy.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), TensorDataset(x, y), batch_size=10,
        steps=8, noise_multiplier=1.0, delta=1e-5, max_grad_norm=1.0, seed=11,
        max_physical_batch_size=physical,
    )  # fmt: skip


def train(private: dpfy.PrivateTraining, stop_after: int | None = None) -> None:
    """The usual loop, with zero_grad() at its end: a draw is waiting between steps."""
    private.optimizer.zero_grad()
    for taken, (x, y) in enumerate(private.loader, start=1):
        nn.functional.cross_entropy(private.model(x), y).backward()
        private.optimizer.step()
        private.optimizer.zero_grad()  # starts the next batch's draw
        if taken == stop_after:
            return


def weights(private: dpfy.PrivateTraining) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in private.model.parameters()])


def test_seeded_run_saved_with_a_draw_waiting_resumes_exactly(tmp_path):
    """zero_grad() at the end of the loop: a draw is waiting whenever the run is saved."""
    whole = seeded_run()
    train(whole)
    first = seeded_run()
    train(first, stop_after=3)
    path = first.save(tmp_path / "checkpoint.pt")
    resumed = seeded_run()
    resumed.load(path)
    train(resumed)
    assert resumed.ledger.steps == whole.ledger.steps == 8
    torch.testing.assert_close(weights(resumed), weights(whole), rtol=0, atol=0)


def test_a_seeded_run_trains_the_same_whatever_the_torch_threads():
    """Noise drawn on the worker (one thread) or on the training thread (two): same run.

    The first layer (5 → 4000, summed last) is filled in two blocks of rows while its product
    is added, so the tail fill, its hand-over and the drawn-ahead buffers are all compared.
    """
    on_worker = seeded_run(width=4000)
    train(on_worker)
    with torch_threads(2):
        here = seeded_run(width=4000)
        train(here)
    assert len(row_blocks(4000, 5)) > 1
    torch.testing.assert_close(weights(here), weights(on_worker), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows,row_size", [(1, 1), (10, 1), (512, 784), (10_000, 256), (33, 1000)])
def test_row_blocks_cover_every_row_once_in_order(rows, row_size):
    blocks = row_blocks(rows, row_size)
    assert blocks[0][0] == 0 and blocks[-1][1] == rows
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in itertools.pairwise(blocks))
    assert blocks[-1][0] < blocks[-1][1]


def test_filling_and_adding_draw_the_same_noise():
    """One physical batch fills the last layer's sum; several add into it: same noise."""
    total = torch.arange(512 * 40, dtype=torch.float32).reshape(512, 40)
    filled, added = torch.empty(512, 40), total.clone()
    first, second = NoiseAhead(TorchNoise(seed=8)), NoiseAhead(TorchNoise(seed=8))
    first.fill(filled, 1.5)
    first.wait_later()
    second.add_later(added, 1.5)
    second.wait_later()
    torch.testing.assert_close(added - total, filled, rtol=0, atol=1e-3)
    assert float(filled.std()) == pytest.approx(1.5, rel=0.05)


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Run with ``count`` torch threads (the suite runs with one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def noise_sequence(source: TorchNoise | SlowConstant) -> list[torch.Tensor]:
    """What one run of prepare/take, fill and add_later hands out, in order."""
    ahead, out = NoiseAhead(source), []
    for _ in range(2):
        ahead.prepare(params(), 2.0)
        out.extend(ahead.take(params(), 2.0).values())
        tail, total = torch.empty(600, 300), torch.zeros(300, 300)
        ahead.fill(tail, 2.0)
        ahead.add_later(total, 2.0)
        ahead.wait_later()
        out += [tail, total]
    return out


def test_noise_is_drawn_here_when_torch_threads_use_every_core():
    """With several torch threads nothing runs on the worker, and the noise is the same."""
    names: list[str] = []

    class Recording(TorchNoise):
        def fill_(self, out: torch.Tensor, std: float) -> torch.Tensor:
            names.append(threading.current_thread().name)
            return super().fill_(out, std)

    concurrent = noise_sequence(Recording(seed=4))
    assert "dpfy-noise" in names  # (a fill's first blocks are drawn here while it wakes)
    names.clear()
    with torch_threads(2):
        here = noise_sequence(Recording(seed=4))
    assert set(names) == {threading.current_thread().name}
    assert len(here) == len(concurrent)
    assert all(torch.equal(a, b) for a, b in zip(here, concurrent, strict=True))


class SlowConstant:
    """Noise std everywhere, drawn slowly: a sum added before the fill ends would be lost."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def normal(self, like: torch.Tensor, std: float) -> torch.Tensor:
        time.sleep(self.delay)
        return torch.full(like.shape, std)


def test_a_fill_drawn_here_says_it_is_complete():
    """No idle core: the fill is drawn before ``fill`` returns, and rules need not wait by rows."""
    with torch_threads(2):
        out = torch.full((4000, 50), float("nan"))
        assert NoiseAhead(TorchNoise(seed=1)).fill(out, 1.0) is None
        assert bool(torch.isfinite(out).all())
    ahead = NoiseAhead(TorchNoise(seed=1))
    ready = ahead.fill(torch.empty(40000, 50), 1.0)  # one thread: the worker fills the rest
    assert len(row_blocks(40000, 50)) > FIRST_BLOCKS_HERE
    assert ready is not None
    ahead.wait_later()


def test_a_sum_opened_from_noise_early_waits_for_its_fill():
    """The embedding is summed last; its noise fills while the layer before sums (look-ahead)."""

    def update(engine: str) -> torch.Tensor:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(50, 8), nn.Flatten(), nn.Linear(8 * 3, 4))
        g = torch.Generator().manual_seed(1)
        x = torch.randint(0, 50, (60, 3), generator=g)
        data = TensorDataset(x, torch.randint(0, 4, (60,), generator=g))
        private = dpfy.make_private(
            model, torch.optim.SGD(model.parameters(), lr=1.0), data, batch_size=20, steps=1,
            noise_multiplier=1.0, delta=1e-5, max_grad_norm=1.0, seed=3, engine=engine,
        )  # fmt: skip
        tail = {"fast": {"0.weight"}, "vmap": set()}[engine]
        assert private.engine.noise_tail() == tail
        private.optimizer.noise = SlowConstant(0.2)  # the fill ends long after the sums
        before = model[0].weight.detach().clone()
        x, y = next(iter(private.loader))
        private.optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        private.optimizer.step()
        return model[0].weight.detach() - before

    # vmap draws all noise ahead: the same noise, summed after it is complete
    torch.testing.assert_close(update("fast"), update("vmap"))


def test_the_interpreter_exits_cleanly_with_a_draw_still_queued():
    code = (
        "import torch\n"
        "from dpfy.noise import TorchNoise\n"
        "from dpfy.noise_ahead import NoiseAhead\n"
        "ahead = NoiseAhead(TorchNoise(seed=0))\n"
        "ahead.prepare({'w': torch.zeros(2000, 2000)}, 1.0)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Fatal" not in done.stderr


def test_a_head_is_the_start_of_the_fill_and_is_used_once():
    """prepare_head draws a fill's first blocks early: fill and add_later put the same noise in."""
    shape = (4096, 64)  # row_blocks: 256, 256, 512, 1024, 2048 rows: more blocks than the head
    assert len(row_blocks(*shape)) > HEAD_BLOCKS
    plain = torch.empty(shape)
    NoiseAhead(TorchNoise(seed=2)).fill(plain, 1.0)

    ahead = NoiseAhead(TorchNoise(seed=2))
    ahead.prepare_head("w", plain, 1.0)
    filled = torch.empty(shape)
    ready = ahead.fill(filled, 1.0, name="w")
    assert ready is not None and ready(1) >= row_blocks(*shape)[HEAD_BLOCKS - 1][1]  # head is in
    ahead.wait_later()
    torch.testing.assert_close(filled, plain, rtol=0, atol=0)

    ahead = NoiseAhead(TorchNoise(seed=2))
    ahead.prepare_head("w", plain, 1.0)
    total = torch.ones(shape)
    ahead.add_later(total, 1.0, name="w")
    ahead.wait_later()
    torch.testing.assert_close(total - 1, plain, rtol=0, atol=1e-6)

    ahead = NoiseAhead(TorchNoise(seed=2))
    ahead.prepare_head("w", plain, 1.0)
    ahead.take(params(), 1.0)  # a new step: the head not put in is dropped, never used
    again = torch.empty(shape)
    ahead.fill(again, 1.0, name="w")
    ahead.wait_later()
    first_rows = row_blocks(*shape)[HEAD_BLOCKS - 1][1]
    assert not torch.equal(again[:first_rows], plain[:first_rows])


def test_no_head_while_torch_threads_use_every_core():
    """No idle core: prepare_head draws nothing, and the fill draws the same rows itself."""
    with torch_threads(2):
        ahead = NoiseAhead(TorchNoise(seed=2))
        ahead.prepare_head("w", torch.empty(4096, 64), 1.0)
        assert ahead.state_dict()["generator"].equal(TorchNoise(seed=2).state_dict()["generator"])


@pytest.mark.parametrize("physical", [None, 4])
def test_a_run_with_a_head_trains_the_same_whatever_the_torch_threads(physical, monkeypatch):
    """Head drawn on the worker as the layer before is summed (one thread) or none (two): same run.

    With ``physical`` most logical batches span several physical batches: the first layer's sum
    is formed before the last one and its noise added at the end (``add_later``), without a head.
    """
    heads: list[int] = []
    put_head = NoiseAhead._put_head

    def spy(self: NoiseAhead, *args: object, **kwargs: object) -> int:
        rows = put_head(self, *args, **kwargs)
        heads.append(rows)
        return rows

    monkeypatch.setattr(NoiseAhead, "_put_head", spy)
    on_worker = seeded_run(width=4096, inputs=64, physical=physical)  # 5 row blocks: a head
    assert on_worker.optimizer._head is not None
    assert on_worker.optimizer._head.name == "0.weight"
    train(on_worker)
    if physical is None:
        assert any(rows > 0 for rows in heads)  # the head was drawn and put in
    with torch_threads(2):
        here = seeded_run(width=4096, inputs=64, physical=physical)
        train(here)
    torch.testing.assert_close(weights(here), weights(on_worker), rtol=1e-5, atol=1e-6)


def test_a_product_takes_every_row_filled_so_far_in_one_piece():
    """Rows filled beyond the block waited for go into the same product (fewer, larger ones)."""
    assert [stop for _, stop in row_blocks(2048, 64)] == [256, 512, 1024, 2048]
    left, right = (
        torch.randn(2048, 10, dtype=torch.float64),
        torch.randn(10, 64, dtype=torch.float64),
    )
    out = torch.randn(2048, 64, dtype=torch.float64)
    start, asked = out.clone(), []

    def ready(rows: int) -> int:
        asked.append(rows)
        return 900 if rows <= 900 else 2048

    product_into(left, right, Into(out, ready))
    torch.testing.assert_close(out, start + left @ right)
    assert asked == [256, 1024]  # rows 0-900 in one product, then 900-2048


def test_a_head_that_does_not_fit_its_tensor_is_dropped():
    """A parameter reshaped since the head was drawn: its rows are never used, all are drawn."""
    ahead = NoiseAhead(TorchNoise(seed=6))
    ahead.prepare_head("w", torch.empty(4096, 64), 1.0)
    head = ahead._head
    assert head is not None
    out = torch.full((4096, 32), float("nan"))
    ahead.fill(out, 1.0, name="w")
    ahead.wait_later()
    assert ahead._head is None and bool(torch.isfinite(out).all())
    rows = head.rows.shape[0]
    assert not torch.equal(out[:rows], head.rows[:, :32])


def test_a_head_is_capped_in_values():
    """``max_values`` keeps the head to the blocks that fit; below one block there is none."""
    like = torch.empty(4096, 64)  # blocks end at rows 256, 512, 1024, 2048, 4096
    ahead = NoiseAhead(TorchNoise(seed=2))
    ahead.prepare_head("w", like, 1.0, max_values=600 * 64)
    assert ahead._head is not None and ahead._head.rows.shape == (512, 64)
    ahead.prepare_head("w", like, 1.0, max_values=100 * 64)
    assert ahead._head is None


def test_the_head_starts_as_the_product_of_the_layer_before_the_tail_begins(monkeypatch):
    """Not among the norms or short kernels: the worker wakes while a product runs (module doc).

    The engine sums layers last to first; the head of the first layer's noise is started once,
    inside the last layer's product (its slot announces it), before the first layer is filled.
    """
    from dpfy.grads import fast
    from dpfy.grads.rules import linear

    events: list[str] = []

    def spy(owner: object, name: str, label: Callable[..., str]) -> None:
        original = getattr(owner, name)

        def wrapper(*args: object, **kwargs: object) -> object:
            events.append(label(*args, **kwargs))
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapper)

    spy(fast.FastEngine, "_unit_sq_norms", lambda *_: "norms")
    spy(linear, "product_into", lambda left, *_: f"product {left.shape[0]}")
    spy(NoiseAhead, "prepare_head", lambda _, name, *rest: f"head {name}")
    spy(NoiseAhead, "fill", lambda _, out, std, name=None: f"fill {name}")
    private = seeded_run(width=4096, inputs=64)
    x, y = torch.randn(10, 64), torch.randint(0, 3, (10,))
    private.loader.provenance.publish(len(x))  # a batch of the right size, as the loader would
    private.optimizer.zero_grad()
    nn.functional.cross_entropy(private.model(x), y).backward()
    private.optimizer.step()
    assert events == [
        "norms", "product 3", "head 0.weight", "fill 0.weight", "fill 0.bias", "product 4096"
    ]  # fmt: skip


def test_an_announced_slot_calls_back_once_before_its_rows_are_first_asked_for():
    """Into.announced: the callback runs at the first wait, once; rows come from the slot."""
    calls: list[int] = []
    plain = Into(torch.zeros(6, 2)).announced(lambda: calls.append(1))
    assert calls == []
    assert plain.ready is not None and plain.ready(2) == 6  # a ready slot: every row, at once
    plain.wait_all()
    assert calls == [1]

    asked: list[int] = []
    filling = Into(torch.zeros(6, 2), lambda rows: asked.append(rows) or rows + 1)
    announced = filling.announced(lambda: calls.append(2))
    assert announced.ready is not None and announced.ready(3) == 4  # the slot's own answer
    announced.wait_all()
    assert calls == [1, 2] and asked == [3, 6]
