"""A Flower strategy that gives any Flower deployment dpfy's user-level DP-FedAvg guarantee.

Flower (``flwr`` ≥ 1.42, message API: ``flwr.serverapp.strategy.Strategy``) moves models
between a ServerApp and ClientApps; :class:`DPFedAvgStrategy` supplies the privacy part on the
server, exactly as the in-process trainer does (guide alg. 2, §4.4):

* **sampling** — in ``configure_train`` every connected node is selected independently with
  probability q = B_c / N_users, drawn by dpfy's own random source (Poisson; Flower's samplers
  draw a fixed number of nodes, which the accountant would not describe). The round is accounted
  in the :class:`~dpfy.train.ledger.PrivacyLedger` as the same event as a DP-SGD step at (q, σ);
* **clipping** — each reply's model change (client arrays − global arrays, trainable keys only)
  is clipped to L2 norm C;
* **noise** — N(0, σ²C²) once per coordinate on the sum, divided by the expected B_c;
* **server optimizer** — SGD at η_s, momentum or Adam, as post-processing;
* **budget** — ``start`` runs only as many rounds as the budget allows, and ``configure_train``
  samples nobody once one more round would exceed it (the refused round is not accounted).

A reply that carries an error, misses tensors, has a wrong shape or a NaN/inf value is dropped,
logged, and still accounted as sampled: its contribution counts as zero, which the analysis
allows (a user's clipped change may be any vector of norm ≤ C). Nodes that never reply count the
same way. What is trusted: the server (it sees every client's update in the clear and adds the
noise — central DP with a trusted aggregator, guide §3.1) and the declared user population.

Client-side federated evaluation returns un-noised metrics of private data; it is off unless an
``evaluate_strategy`` is given, and its metrics are outside the DP guarantee.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from torch import nn

from dpfy._validate import check_count, check_positive
from dpfy.data.randomness import RandomSource, make_source
from dpfy.data.sampling import sampling_rate_for
from dpfy.federated.aggregate import (
    ClippedSum,
    MalformedUpdate,
    ServerUpdate,
    make_server_optimizer,
)
from dpfy.federated.fedavg import check_ledger, check_seeding
from dpfy.plan.sampling import SamplingKind, SamplingRecord
from dpfy.train.builder import warn_if_delta_too_large
from dpfy.train.ledger import BudgetExhausted, PrivacyLedger
from dpfy.train.noise.source import NoiseSource, SecureNoise, TorchNoise
from dpfy.train.private_aggregation import PrivateAggregation
from dpfy.train.step_record import StepRecord

__all__ = ["DPFedAvgStrategy"]

log = logging.getLogger("dpfy.federated.flower")


class _Round:
    """The round in flight: who was sampled and the global model they were sent."""

    def __init__(self, number: int, sampled: Sequence[int]) -> None:
        self.number = number
        self.sampled = set(sampled)
        self.replied: set[int] = set()


class DPFedAvgStrategy(Strategy):
    """Flower strategy: Poisson-sampled clients, clipped updates, calibrated noise, a ledger.

    ``num_users`` is the declared population N_users and ``clients_per_round`` the expected B_c:
    q = B_c / N_users and the noisy sum is always divided by B_c. ``trainable_keys`` names the
    arrays that are trained (default: every array); other arrays are passed on unchanged and any
    client change to them is ignored. ``seed`` makes sampling and noise reproducible (tests,
    simulations); without it both are seeded from the OS, and ``secure=True`` draws both from the
    OS CSPRNG.
    """

    def __init__(
        self,
        *,
        num_users: int,
        clients_per_round: int,
        noise_multiplier: float,
        clip_norm: float,
        ledger: PrivacyLedger,
        server_lr: float = 1.0,
        server_optimizer: str = "sgd",
        trainable_keys: Sequence[str] | None = None,
        seed: int | None = None,
        secure: bool = False,
        noise: NoiseSource | None = None,
        evaluate_strategy: Strategy | None = None,
        arrayrecord_key: str = "arrays",
        configrecord_key: str = "config",
    ) -> None:
        self.num_users = check_count("num_users", num_users, minimum=1)
        self.clients_per_round = check_count("clients_per_round", clients_per_round, minimum=1)
        if self.clients_per_round > self.num_users:
            raise ValueError(
                f"clients_per_round {clients_per_round} exceeds the {num_users} users; lower "
                "clients_per_round to at most the number of users"
            )
        self.noise_multiplier = check_positive("noise_multiplier", noise_multiplier)
        self.clip_norm = check_positive("clip_norm", clip_norm)
        self.server_lr = check_positive("server_lr", server_lr)
        self.server_optimizer = server_optimizer
        make_server_optimizer(server_optimizer, [nn.Parameter(torch.zeros(1))], server_lr)
        self.ledger = check_ledger(ledger)
        warn_if_delta_too_large(ledger.delta, self.num_users, "user")
        self.trainable_keys = None if trainable_keys is None else tuple(trainable_keys)
        self.sampling = SamplingRecord(
            SamplingKind.POISSON,
            sampling_rate_for(num_users, clients_per_round),
            num_users,
            unit="user",
        )
        self.record = StepRecord(self.sampling, self.noise_multiplier)
        check_seeding(seed, secure)
        seeded = seed is not None
        generator = torch.Generator().manual_seed(seed) if seeded else None
        self._source: RandomSource = make_source(generator, secure)
        if noise is None:
            noise = SecureNoise() if secure else TorchNoise(None if seed is None else seed + 1)
        self.noise = noise
        self.evaluate_strategy = evaluate_strategy
        self.arrayrecord_key, self.configrecord_key = arrayrecord_key, configrecord_key
        self.exhausted: BudgetExhausted | None = None
        self._server: ServerUpdate | None = None
        self._keys: tuple[str, ...] = ()
        self._frozen: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._order: tuple[str, ...] = ()
        self._round: _Round | None = None
        self._warned_population = False

    @property
    def sampling_rate(self) -> float:
        """q = B_c / N_users, each node's chance of joining a round."""
        return self.sampling.sampling_rate

    # -- Strategy API --------------------------------------------------------------------------
    def summary(self) -> None:
        """Log the privacy settings."""
        log.info(
            "DPFedAvgStrategy: Poisson client sampling q=%.6g (B_c=%d of N=%d users), clip C=%g, "
            "σ=%.6g, server %s lr=%g, target ε=%s at δ=%g",
            self.sampling_rate,
            self.clients_per_round,
            self.num_users,
            self.clip_norm,
            self.noise_multiplier,
            self.server_optimizer,
            self.server_lr,
            self.ledger.target_epsilon,
            self.ledger.delta,
        )

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        """Flower's round loop, cut to the rounds the budget still allows (maybe zero)."""
        num_rounds = check_count("num_rounds", num_rounds)
        if self.ledger.target_epsilon is not None:
            allowed = self.ledger.remaining_steps(self.record)
            if allowed < num_rounds:
                log.warning(
                    "the privacy budget allows %d more round(s) of the %d asked for; running %d",
                    allowed,
                    num_rounds,
                    allowed,
                )
                num_rounds = allowed
        return super().start(grid, initial_arrays, num_rounds, *args, **kwargs)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Poisson-sample the nodes for this round (none once the budget is spent)."""
        self._sync_global(arrays)
        try:
            self.ledger.check_step(self.record)
        except BudgetExhausted as err:
            self.exhausted, self._round = err, None
            log.warning("round %d not run: %s", server_round, err)
            return []
        nodes = sorted(grid.get_node_ids())
        self._check_population(len(nodes))
        chosen = self._source.bernoulli_indices(len(nodes), self.sampling_rate).tolist()
        sampled = [nodes[i] for i in chosen]
        self._round = _Round(server_round, sampled)
        log.info("round %d: sampled %d of %d nodes", server_round, len(sampled), len(nodes))
        config["server-round"] = server_round
        content = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
        return [Message(content, dst_node_id=n, message_type=MessageType.TRAIN) for n in sampled]

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Clip, sum, noise, ÷ B_c, server step, account; no round in flight → (None, None)."""
        current = self._round
        if current is None or current.number != server_round:
            log.warning("round %d: no sampled round to aggregate; nothing changed", server_round)
            return None, None
        self._round = None
        like = self._global_trainable()
        aggregation = PrivateAggregation.gaussian(
            frozenset(like),
            self.noise,
            self.noise_multiplier,
            self.clip_norm,
            self.clients_per_round,
        )
        total = ClippedSum(like, self.clip_norm, aggregation)
        for reply in replies:
            self._add_reply(total, current, reply)
        missing = len(current.sampled - current.replied)
        if missing:
            log.warning(
                "round %d: %d sampled node(s) did not reply (counted as zero)",
                server_round,
                missing,
            )
        update = total.noisy_mean()
        assert self._server is not None  # set by configure_train's _sync_global
        self._server.apply(update)
        self.ledger.record(self.record)
        metrics = MetricRecord(
            {
                "dp-sampled": len(current.sampled),
                "dp-accepted": total.accepted,
                "dp-dropped": len(current.sampled) - total.accepted,  # bad replies + silent
                "dp-epsilon": float(self.ledger.epsilon()),
            }
        )
        return self._global_arrays(), metrics

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Federated evaluation only through ``evaluate_strategy`` (its metrics are not private)."""
        if self.evaluate_strategy is None:
            return []
        return self.evaluate_strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Delegated to ``evaluate_strategy`` when one is given."""
        if self.evaluate_strategy is None:
            return None
        return self.evaluate_strategy.aggregate_evaluate(server_round, replies)

    def _check_population(self, connected: int) -> None:
        """Warn once when the nodes connected differ from the declared population.

        The guarantee holds either way — each node joins with probability q and the divisor is
        the fixed B_c — but the average is then scaled for a population of a different size.
        """
        if connected != self.num_users and not self._warned_population:
            self._warned_population = True
            log.warning(
                "%d nodes are connected but num_users=%d was declared: each node still joins "
                "with q=%.6g and the sum is divided by B_c=%d, so the average is rescaled",
                connected,
                self.num_users,
                self.sampling_rate,
                self.clients_per_round,
            )

    # -- the global model ----------------------------------------------------------------------
    def _sync_global(self, arrays: ArrayRecord) -> None:
        """Adopt the global arrays; the server optimizer is built once and keeps its state."""
        state = arrays.to_torch_state_dict()
        keys = tuple(state) if self.trainable_keys is None else self.trainable_keys
        unknown = [k for k in keys if k not in state]
        if unknown:
            raise ValueError(f"trainable_keys {unknown} are not among the model's arrays")
        if self._server is not None and keys == self._keys:
            with torch.no_grad():
                for key, param in self._server.params.items():
                    param.copy_(state[key])
        else:
            integer = [k for k in keys if not state[k].is_floating_point()]
            if integer:
                raise ValueError(
                    f"arrays {integer} are not floating point and cannot be trained; leave them "
                    "out of trainable_keys"
                )
            params = {k: nn.Parameter(state[k].clone()) for k in keys}
            optimizer = make_server_optimizer(
                self.server_optimizer, params.values(), self.server_lr
            )
            self._server, self._keys = ServerUpdate(params, optimizer), keys
        self._frozen = OrderedDict((k, v) for k, v in state.items() if k not in keys)
        self._order = tuple(state)

    def _global_trainable(self) -> dict[str, torch.Tensor]:
        """The current global values of the trained arrays."""
        assert self._server is not None
        return {k: p.detach() for k, p in self._server.params.items()}

    def _global_arrays(self) -> ArrayRecord:
        """The global model as an ArrayRecord, arrays in their original order."""
        assert self._server is not None
        trained = {k: p.detach() for k, p in self._server.params.items()}
        merged = OrderedDict((k, trained.get(k, self._frozen.get(k))) for k in self._order)
        return ArrayRecord(merged)

    # -- replies -------------------------------------------------------------------------------
    def _add_reply(self, total: ClippedSum, current: _Round, reply: Message) -> bool:
        """Add one reply's clipped change; False (logged) if it was dropped."""
        node = reply.metadata.src_node_id
        if node not in current.sampled or node in current.replied:
            log.warning("round %d: unexpected reply from node %s ignored", current.number, node)
            return False
        current.replied.add(node)
        try:
            if reply.has_error():
                raise MalformedUpdate(f"the client reported an error: {reply.error.reason}")
            total.add(self._change(reply))
            return True
        except MalformedUpdate as err:
            log.warning(
                "round %d: update from node %s dropped (accounted as sampled, counted as zero): %s",
                current.number,
                node,
                err,
            )
            return False

    def _change(self, reply: Message) -> dict[str, torch.Tensor]:
        """The reply's trained arrays minus the global ones (MalformedUpdate if unusable)."""
        records = reply.content.array_records if reply.has_content() else {}
        if self.arrayrecord_key not in records:
            raise MalformedUpdate(f"the reply has no ArrayRecord {self.arrayrecord_key!r}")
        try:
            state = records[self.arrayrecord_key].to_torch_state_dict()
        except Exception as err:  # any decoding failure makes the reply unusable
            raise MalformedUpdate(f"the reply's arrays cannot be decoded ({err})") from None
        missing = [k for k in self._keys if k not in state]
        if missing:
            raise MalformedUpdate(f"the reply lacks the arrays {missing}")
        current = self._global_trainable()
        change = {}
        for key in self._keys:
            value = state[key]
            if value.shape != current[key].shape or not value.is_floating_point():
                raise MalformedUpdate(
                    f"array {key!r} has shape {tuple(value.shape)} and dtype {value.dtype}; "
                    f"expected floating point of shape {tuple(current[key].shape)}"
                )
            change[key] = value.to(current[key].dtype) - current[key]
        return change
