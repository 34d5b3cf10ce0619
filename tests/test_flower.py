"""The Flower adapter, driven through Flower's own Strategy API and message types.

A fake in-process Grid answers each training message with a scripted client reply built the way
a ClientApp builds one (``Message(content, reply_to=msg)``), so configure → send → aggregate runs
through flwr's real ``Strategy.start`` loop. The end-to-end run through Flower's simulation
engine (Ray) is marked slow.
"""

from __future__ import annotations

import logging
import math
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable

import pytest
import torch

flwr = pytest.importorskip("flwr")

from flwr.app import (  # noqa: E402
    ArrayRecord,
    ConfigRecord,
    Error,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import Grid  # noqa: E402

from dpfy.federated.flower import DPFedAvgStrategy  # noqa: E402
from dpfy.plan.accounting import PldAccountant, dpsgd_event  # noqa: E402
from dpfy.train.ledger import PrivacyLedger  # noqa: E402

DELTA = 1e-5
Client = Callable[[int, Message], Message]


@pytest.fixture(autouse=True)
def task_identity():
    """What a ServerApp process sets before its strategy builds messages (run, node, task ids)."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


class PatternNoise:
    """Deterministic noise: std times a fixed pattern."""

    @staticmethod
    def pattern(like: torch.Tensor) -> torch.Tensor:
        return torch.linspace(-1.0, 1.0, like.numel(), dtype=like.dtype).reshape(like.shape)

    def normal(self, like: torch.Tensor, std: float) -> torch.Tensor:
        return std * self.pattern(like)


class FakeGrid(Grid):
    """An in-process Grid: every message is answered at once by ``client(node_id, message)``."""

    def __init__(self, nodes: Iterable[int], client: Client) -> None:
        self.nodes = list(nodes)
        self.client = client
        self.sent: list[list[int]] = []

    def set_run(self, run):  # pragma: no cover - not used in process
        self._run = run

    @property
    def run(self):  # pragma: no cover
        return self._run

    def create_message(self, *args, **kwargs):  # pragma: no cover
        raise NotImplementedError

    def get_node_ids(self) -> Iterable[int]:
        return list(self.nodes)

    def push_messages(self, messages):  # pragma: no cover
        raise NotImplementedError

    def pull_messages(self, message_ids):  # pragma: no cover
        raise NotImplementedError

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        self.sent.append([m.metadata.dst_node_id for m in messages])
        return [self.client(m.metadata.dst_node_id, m) for m in messages]


def initial_arrays() -> ArrayRecord:
    return ArrayRecord(OrderedDict(w=torch.zeros(2, 3), b=torch.zeros(2), steps=torch.zeros(1)))


def reply_with(message: Message, state: dict[str, torch.Tensor]) -> Message:
    content = RecordDict(
        {"arrays": ArrayRecord(OrderedDict(state)), "metrics": MetricRecord({"num-examples": 1})}
    )
    return Message(content, reply_to=message)


def shifted(message: Message, shift: dict[str, float]) -> Message:
    """An honest client: the global arrays plus a constant per array."""
    state = message.content.array_records["arrays"].to_torch_state_dict()
    return reply_with(message, {k: v + shift.get(k, 0.0) for k, v in state.items()})


def strategy(**kwargs) -> DPFedAvgStrategy:
    settings = dict(
        num_users=5,
        clients_per_round=5,
        noise_multiplier=0.5,
        clip_norm=1.0,
        ledger=PrivacyLedger(DELTA),
        trainable_keys=["w", "b"],
        seed=0,
    )
    settings.update(kwargs)
    return DPFedAvgStrategy(**settings)


def test_one_round_clips_noises_divides_and_drops_bad_replies(caplog):
    sigma, clip, bc, eta_s = 0.5, 1.0, 5, 0.5

    def client(node: int, message: Message) -> Message:
        if node == 1:  # honest, long change: clipped
            return shifted(message, {"w": 2.0, "b": 2.0})
        if node == 2:  # honest, short change; tries to move the untrained array too
            return shifted(message, {"w": 0.1, "steps": 7.0})
        if node == 3:  # non-finite
            return shifted(message, {"w": float("nan")})
        if node == 4:  # malformed: wrong shape
            state = message.content.array_records["arrays"].to_torch_state_dict()
            return reply_with(message, {**state, "w": torch.zeros(3, 2)})
        return Message(Error(code=0, reason="client crashed"), reply_to=message)

    dp = strategy(noise=PatternNoise(), server_lr=eta_s)
    grid = FakeGrid([1, 2, 3, 4, 5], client)
    start = initial_arrays()
    messages = list(dp.configure_train(1, start, ConfigRecord(), grid))
    assert sorted(m.metadata.dst_node_id for m in messages) == [1, 2, 3, 4, 5]  # q = 1
    with caplog.at_level(logging.WARNING, logger="dpfy.federated.flower"):
        arrays, metrics = dp.aggregate_train(1, grid.send_and_receive(messages))
    state = arrays.to_torch_state_dict()

    long_norm = math.sqrt(2.0**2 * 6 + 2.0**2 * 2)
    summed = {
        "w": torch.full((2, 3), 2.0 * clip / long_norm + 0.1),
        "b": torch.full((2,), 2.0 * clip / long_norm),
    }
    for key in ("w", "b"):
        noisy_mean = (summed[key] + sigma * clip * PatternNoise.pattern(summed[key])) / bc
        assert torch.allclose(state[key], eta_s * noisy_mean, atol=1e-6)
    assert torch.equal(state["steps"], torch.zeros(1))  # not trained: left as it was
    assert list(state) == ["w", "b", "steps"]
    assert metrics["dp-sampled"] == 5 and metrics["dp-accepted"] == 2
    assert metrics["dp-dropped"] == 3
    for node in (3, 4, 5):
        assert f"node {node} dropped" in caplog.text
    assert dp.ledger.steps == 1  # the dropped nodes were sampled: the round is accounted


def test_clients_are_poisson_sampled_at_q_and_every_round_is_accounted():
    nodes, bc, rounds = list(range(100, 140)), 8, 60
    dp = strategy(num_users=40, clients_per_round=bc)
    grid = FakeGrid(nodes, lambda node, m: shifted(m, {"w": 0.01}))
    arrays = initial_arrays()
    counts = dict.fromkeys(nodes, 0)
    sizes = []
    for round_ in range(1, rounds + 1):
        replies = grid.send_and_receive(dp.configure_train(round_, arrays, ConfigRecord(), grid))
        for reply in replies:
            counts[reply.metadata.src_node_id] += 1
        sizes.append(len(replies))
        arrays, _ = dp.aggregate_train(round_, replies)
    q = bc / 40
    total = sum(counts.values())
    assert abs(total - q * 40 * rounds) < 4 * math.sqrt(40 * rounds * q * (1 - q))
    assert len(set(sizes)) > 3  # Poisson: the number of clients varies from round to round
    assert dp.ledger.steps == rounds
    oracle = PldAccountant().compose(dpsgd_event(q, 0.5, rounds)).epsilon(DELTA)
    assert dp.ledger.epsilon() == pytest.approx(oracle, rel=1e-9)


def test_start_runs_only_the_rounds_the_budget_allows():
    sigma, q = 0.8, 0.5
    target = PldAccountant().compose(dpsgd_event(q, sigma, 2)).epsilon(DELTA) * 1.0001
    dp = strategy(
        num_users=4,
        clients_per_round=2,
        noise_multiplier=sigma,
        ledger=PrivacyLedger(DELTA, target_epsilon=target),
    )
    grid = FakeGrid([1, 2, 3, 4], lambda node, m: shifted(m, {"w": 0.1}))
    evaluated = []

    def evaluate(round_: int, arrays: ArrayRecord) -> MetricRecord:
        evaluated.append(round_)
        return MetricRecord({"round": round_})

    result = dp.start(grid, initial_arrays(), num_rounds=5, evaluate_fn=evaluate)
    assert dp.ledger.steps == 2
    assert sorted(result.train_metrics_clientapp) == [1, 2]
    assert evaluated == [0, 1, 2]
    # Called directly past the budget, the strategy samples nobody and changes nothing.
    assert list(dp.configure_train(3, result.arrays, ConfigRecord(), grid)) == []
    assert dp.exhausted is not None
    assert dp.aggregate_train(3, []) == (None, None)
    assert dp.ledger.steps == 2 and dp.ledger.epsilon() <= target


def test_a_round_with_no_reply_is_noise_only_and_accounted():
    dp = strategy(num_users=3, clients_per_round=3, noise=PatternNoise())
    grid = FakeGrid([1, 2, 3], lambda node, m: shifted(m, {"w": 1.0}))
    list(dp.configure_train(1, initial_arrays(), ConfigRecord(), grid))
    arrays, metrics = dp.aggregate_train(1, [])  # every sampled node timed out
    state = arrays.to_torch_state_dict()
    assert torch.allclose(state["w"], 0.5 * PatternNoise.pattern(state["w"]) / 3)
    assert metrics["dp-dropped"] == 3 and dp.ledger.steps == 1


def test_unsolicited_replies_are_ignored_and_a_population_mismatch_is_logged(caplog):
    dp = strategy(num_users=5, clients_per_round=5, noise=PatternNoise())
    grid = FakeGrid([1, 2, 3], lambda node, m: shifted(m, {"w": 1.0}))
    with caplog.at_level(logging.WARNING, logger="dpfy.federated.flower"):
        messages = list(dp.configure_train(1, initial_arrays(), ConfigRecord(), grid))
        honest = grid.send_and_receive(messages)
        never_sent = Message(RecordDict(), dst_node_id=99, message_type="train")
        impostor = reply_with(never_sent, {"w": torch.full((2, 3), 9.0), "b": torch.zeros(2)})
        forged = reply_with(messages[0], {"w": torch.full((2, 3), 50.0)})
        arrays, metrics = dp.aggregate_train(1, [*honest, impostor, forged])
    assert "3 nodes are connected but num_users=5" in caplog.text
    assert "unexpected reply from node 99" in caplog.text
    assert "unexpected reply from node 1" in caplog.text  # its second reply
    assert metrics["dp-accepted"] == 3
    assert metrics["dp-dropped"] == 0  # ignored replies are not dropped sampled users
    noise = 0.5 * PatternNoise.pattern(torch.zeros(2, 3))
    expected = (3 * torch.full((2, 3), 1.0 / math.sqrt(6)) + noise) / 5  # each clipped to C = 1
    assert torch.allclose(arrays.to_torch_state_dict()["w"], expected, atol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"clients_per_round": 9}, "clients_per_round 9 exceeds the 5 users"),
        ({"num_users": 0}, "num_users"),
        ({"clip_norm": 0.0}, "clip_norm"),
        ({"server_optimizer": "rmsprop-ish"}, "server optimizer"),
    ],
)
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        strategy(**kwargs)


def test_delta_not_below_one_over_declared_users_warns():
    with pytest.warns(UserWarning, match=r"1/N_users = 0\.2"):
        strategy(ledger=PrivacyLedger(0.5))


def test_unknown_trainable_keys_are_refused():
    dp = strategy(trainable_keys=["w", "nope"])
    grid = FakeGrid([1], lambda node, m: shifted(m, {}))
    with pytest.raises(ValueError, match="nope"):
        list(dp.configure_train(1, initial_arrays(), ConfigRecord(), grid))


# -- end to end through Flower's simulation engine ----------------------------------------------
def _client_train(msg: Message, context) -> Message:
    """A ClientApp that runs two SGD steps of a linear model on its own synthetic data."""
    node = int(context.node_config.get("partition-id", 0))
    generator = torch.Generator().manual_seed(node)
    x = torch.randn(16, 3, generator=generator)
    y = (x[:, 0] > 0).long()
    model = torch.nn.Linear(3, 2)
    model.load_state_dict(msg.content.array_records["arrays"].to_torch_state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(2):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    content = RecordDict(
        {
            "arrays": ArrayRecord(model.state_dict()),
            "metrics": MetricRecord({"num-examples": len(x)}),
        }
    )
    return Message(content, reply_to=msg)


@pytest.mark.slow
def test_end_to_end_through_flowers_simulation_engine():
    pytest.importorskip("ray", reason="Flower's simulation engine: pip install -e '.[flower]'")
    from flwr.clientapp import ClientApp
    from flwr.serverapp import ServerApp
    from flwr.simulation import run_simulation

    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    rounds, users = 3, 6
    dp = strategy(num_users=users, clients_per_round=3, trainable_keys=None, seed=1)
    outcome = {}

    client_app = ClientApp()
    client_app.train()(_client_train)
    server_app = ServerApp()

    @server_app.main()
    def main(grid, context) -> None:
        torch.manual_seed(0)
        start = ArrayRecord(torch.nn.Linear(3, 2).state_dict())
        outcome["initial"] = start.to_torch_state_dict()
        outcome["result"] = dp.start(grid, start, num_rounds=rounds)

    run_simulation(
        server_app=server_app,
        client_app=client_app,
        num_supernodes=users,
        backend_config={"client_resources": {"num_cpus": 1}, "init_args": {"num_cpus": 2}},
    )
    assert dp.ledger.steps == rounds
    final = outcome["result"].arrays.to_torch_state_dict()
    assert not torch.equal(final["weight"], outcome["initial"]["weight"])
    assert all(torch.isfinite(v).all() for v in final.values())
    sampled = [m["dp-sampled"] for m in outcome["result"].train_metrics_clientapp.values()]
    assert len(sampled) == rounds
