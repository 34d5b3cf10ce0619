"""``make_private``: one call turns a model, optimizer and dataset into a private training run.

It checks the model (DESIGN rule 8), derives q = B/N from the dataset, calibrates σ for a target
ε (or takes σ), builds the Poisson loader, the per-example gradient engine, the ledger with its
budget guard and the private optimizer, and returns them together as one
:class:`PrivateTraining` — always the same kind of object, whatever the options.
"""

from __future__ import annotations

import copy
import inspect
import math
import os
import secrets
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from dpfy._validate import check_count, check_delta, check_positive
from dpfy.data.loader import DPDataLoader, checked_loader_options, dataset_size_of
from dpfy.data.sampling import check_batch_size
from dpfy.plan.accounting.calibrate import smallest_noise_multiplier
from dpfy.plan.accounting.events import DpEvent, NeighbouringRelation, SelfComposedEvent
from dpfy.plan.privacy_plan import PrivacyPlan
from dpfy.plan.sampling import SamplingKind, SamplingRecord
from dpfy.train.checkpoints import seal, unseal
from dpfy.train.checks import check_model
from dpfy.train.distributed import (
    ProcessGroupReplicas,
    SingleProcess,
    current_replicas,
    replicas_for,
    trainable_shapes,
)
from dpfy.train.grads import EngineChoice, GradEngine, LossReduction, make_engine
from dpfy.train.ledger import TRAINING, PrivacyLedger
from dpfy.train.noise.source import NoiseSource, SecureNoise, TorchNoise
from dpfy.train.optim import BatchBoundary, DPOptimizer, NoiseSettings
from dpfy.train.virtual import VirtualBatchLoader

#: The ledger label of steps taken after a checkpoint that the run then went back to.
REWOUND = "rewound steps"


class PrivateTraining:
    """A private training run: model, DP optimizer, DP loader, ledger and engine together."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: DPOptimizer,
        loader: DPDataLoader | VirtualBatchLoader,
        ledger: PrivacyLedger,
        engine: GradEngine,
        plan: PrivacyPlan,
        noise: NoiseSource,
        replicas: SingleProcess | ProcessGroupReplicas | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.loader = loader
        self.ledger = ledger
        self.engine = engine
        self.plan = plan
        self.noise = noise
        self.replicas = replicas if replicas is not None else SingleProcess()
        if ledger.run_id is None:  # one identity for all ranks, drawn by the writer
            ledger.run_id = self.replicas.on_writer(lambda: secrets.token_hex(8))

    @property
    def noise_multiplier(self) -> float:
        """σ: noise std divided by the clip norm (decoupled, DESIGN rule 5)."""
        return self.plan.noise_multiplier

    def epsilon(self, delta: float | None = None) -> float:
        """ε spent so far at ``delta`` (the run's δ by default), training and tuning included."""
        return self.ledger.epsilon(delta)

    @property
    def run_id(self) -> str:
        """This run's identity, kept by its ledger: a resumed run continues the same one."""
        assert self.ledger.run_id is not None
        return self.ledger.run_id

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs: model, optimizer, ledger, sampler and noise RNG.

        Sealed with a content digest (:mod:`dpfy.train.checkpoints`). Distributed: collective (call
        it
        on every rank); holds every rank's sampler and noise.
        """
        return seal(
            {
                "plan": asdict(self.plan),
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "ledger": self.ledger.state_dict(),
                "loader": self.replicas.gather(self.loader.state_dict()),
                "noise": self.replicas.gather(self.noise.state_dict()),
                "run": self.run_id,
            }
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`; all or nothing — on any error nothing has changed.

        Refused: a checkpoint whose content changed since it was written, or whose ledger does
        not belong with its sampler state (another run's, an earlier one, an emptied one). Going
        back to an earlier checkpoint of this same run keeps what was spent since: those steps
        are carried in the ledger as :data:`REWOUND` releases, so ε never goes down.
        """
        state = unseal(state)
        mine = self.replicas.mine(state["loader"])  # another number of ranks: refused by name
        saved = state["plan"]
        if saved != asdict(self.plan):
            raise ValueError(
                "the checkpoint was made with different privacy settings "
                f"({saved}) than this run ({asdict(self.plan)}); resume with the same "
                "make_private arguments. Nothing was loaded."
            )
        ledger = PrivacyLedger.from_state_dict(state["ledger"])  # validates before any change
        _check_binding(ledger, state["run"], mine)
        backup = {
            "model": copy.deepcopy(self.model.state_dict()),
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "loader": self.loader.state_dict(),
            "noise": self.noise.state_dict(),
        }
        try:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.loader.load_state_dict(mine)
            self.noise.load_state_dict(self.replicas.mine(state["noise"]))
        except Exception as err:
            self.model.load_state_dict(backup["model"])
            self.optimizer.load_state_dict(backup["optimizer"])
            self.loader.load_state_dict(backup["loader"])
            self.noise.load_state_dict(backup["noise"])
            raise ValueError(
                f"the checkpoint does not fit this run ({err}); nothing was loaded"
            ) from None
        rewound = self.ledger.spent_beyond(ledger) if ledger.run_id == self.run_id else {}
        self.ledger.load_state_dict(ledger.state_dict())
        for (label, event), count in rewound.items():
            self.ledger.record_event(
                event, label=REWOUND if label == TRAINING else label, count=count
            )

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write a checkpoint atomically: a crash mid-write never destroys the previous one.

        Distributed: call it on every rank; only rank 0 writes, the others wait until it has.
        """
        target = Path(path)
        state = self.state_dict()
        if not self.replicas.is_writer:
            self.replicas.barrier()
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
        os.close(handle)
        try:
            torch.save(state, temporary)
            os.replace(temporary, target)
        finally:
            if os.path.exists(temporary):
                os.unlink(temporary)
        self.replicas.barrier()
        return target

    def load(self, path: str | os.PathLike[str]) -> None:
        """Resume from a checkpoint file; a corrupt file is refused with nothing changed."""
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise ValueError(f"checkpoint {path} does not exist") from None
        except Exception as err:
            raise ValueError(
                f"checkpoint {path} is corrupt or not a dpfy checkpoint ({type(err).__name__}); "
                "nothing was loaded — resume from an earlier checkpoint"
            ) from None
        self.load_state_dict(state)

    def detach(self) -> nn.Module:
        """Remove dpfy's hooks; returns the model (the optimizer can no longer step)."""
        self.engine.detach()
        return self.model

    def __repr__(self) -> str:
        """The run's privacy settings at a glance."""
        s = self.plan
        return (
            f"PrivateTraining(N={s.dataset_size}, B={s.expected_batch_size}, "
            f"q={s.sampling_rate:.4g}, σ={s.noise_multiplier:.4g}, C={s.max_grad_norm:g}, "
            f"steps={s.steps}, δ={s.delta:g}, engine={self.engine.kind})"
        )


def make_private(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    train_dataset: Dataset,
    *,
    batch_size: int,
    delta: float,
    max_grad_norm: float,
    epochs: float | None = None,
    steps: int | None = None,
    target_epsilon: float | None = None,
    noise_multiplier: float | None = None,
    loss_reduction: LossReduction = "mean",
    engine: EngineChoice = "auto",
    accountant: str = "pld",
    sampler: SamplingKind | str | None = None,
    microbatch_size: int | None = None,
    max_physical_batch_size: int | None = None,
    secure_noise: bool = False,
    seed: int | None = None,
    batch_first: bool = True,
    loader_options: dict[str, Any] | None = None,
    distributed: bool | None = None,
    user_ids: torch.Tensor | None = None,
    max_examples_per_user: int | None = None,
    algorithm: str = "dp-sgd",
) -> PrivateTraining:
    """Make ``model`` + ``optimizer`` train privately on ``train_dataset`` (guide alg. 1).

    ``batch_size`` is the *expected* batch size B (q = B/N from the dataset size). Give exactly
    one of ``epochs``/``steps`` and exactly one of ``target_epsilon`` (σ is calibrated and the
    budget guard stops the run there) / ``noise_multiplier``. ``sampler`` is Poisson unless you
    explicitly choose "shuffle" (accounted under the Poisson assumption, flagged as not met) or
    "fixed-size" (replace-one adjacency, RDP accounting). ``seed`` makes sampling and noise
    reproducible; leave it None in production (OS-seeded). ``secure_noise`` draws noise and
    sampling from the OS CSPRNG (slower; see :mod:`dpfy.train.noise.source`; no seed then).
    ``distributed``
    (None: automatic when a process group of more than one rank is initialised) trains across
    ranks with one guarantee and one ledger: every rank passes the same whole dataset and
    settings (:mod:`dpfy.train.distributed`).
    ``user_ids`` (one user id per example) switches to user-level DP-SGD: ``batch_size`` is then
    the expected number of users per step (:mod:`dpfy.train.user_level`). ``algorithm="dp-ftrl"``
    trains with DP-FTRL instead (:func:`dpfy.train.ftrl.make_private_ftrl`: SGD, fixed batches in
    "shuffle" (default) or "fixed-order" order, no sampling assumption); ``sampler=None`` means
    Poisson for DP-SGD. ``loader_options`` go to the private loader's ``DataLoader``
    (``num_workers``, ``pin_memory``, ``collate_fn``, …; the batches stay the sampler's).
    """
    if algorithm != "dp-sgd":
        _refuse_process_group(f"algorithm={algorithm!r}", distributed)
        return _other_algorithm(locals())
    sampler = SamplingKind.POISSON if sampler is None else sampler
    if user_ids is not None or max_examples_per_user is not None:
        _refuse_process_group("user-level DP-SGD (user_ids)", distributed)
        return _user_level(locals())
    replicas = replicas_for(distributed, model)
    delta, max_grad_norm = check_common(model, optimizer, delta, max_grad_norm)
    dataset_size = dataset_size_of(train_dataset)
    batch_size = check_batch_size(dataset_size, batch_size)
    total_steps = _resolve_steps(epochs, steps, dataset_size, batch_size)
    warn_if_delta_too_large(delta, dataset_size)
    kind = SamplingKind.parse(sampler)
    relation, accountant = _accounting_for(kind, accountant)
    generator = seeded_generator(
        None if seed is None else replicas.sampling_seed(seed), secure_noise
    )
    loader = DPDataLoader(
        train_dataset,
        batch_size,
        steps=total_steps,
        sampler=replicas.sampler(
            kind, dataset_size, batch_size, total_steps, generator, secure=secure_noise
        ),
        generator=generator,
        secure=secure_noise,
        microbatch_size=microbatch_size,
        **checked_loader_options(loader_options),
    )
    record = loader.sampling_record
    sigma = _noise_multiplier(
        target_epsilon, noise_multiplier, delta, record, total_steps, accountant, relation
    )
    ledger = PrivacyLedger(
        delta, accountant=accountant, target_epsilon=target_epsilon, relation=relation
    )
    grad_engine = make_engine(model, engine, batch_first=batch_first)
    settings = NoiseSettings(sigma, max_grad_norm, batch_size, microbatch_size)
    noise = noise_source(secure_noise, None if seed is None else replicas.noise_seed(seed))
    boundary = BatchBoundary()
    private_optimizer = DPOptimizer(
        optimizer,
        grad_engine,
        ledger,
        record,
        settings,
        provenance=loader.provenance,
        loss_reduction=loss_reduction,
        noise=noise,
        boundary=boundary,
        aggregator=replicas.aggregator(),
    )
    run_loader = with_virtual_batches(loader, max_physical_batch_size, boundary)
    privacy = PrivacyPlan(
        dataset_size=dataset_size,
        expected_batch_size=batch_size,
        sampling_rate=record.sampling_rate,
        steps=total_steps,
        noise_multiplier=sigma,
        max_grad_norm=max_grad_norm,
        delta=delta,
        target_epsilon=target_epsilon,
        accountant=accountant,
        sampler=kind.value,
        microbatch_size=microbatch_size,
        loss_reduction=loss_reduction,
        seeded=seed is not None,
        world_size=replicas.world_size,
    )
    try:  # every rank must agree before training; a refused model is left without hooks
        replicas.check_agreement({**asdict(privacy), "parameters": trainable_shapes(model)})
        replicas.broadcast_model(model)
    except Exception:
        grad_engine.detach()
        raise
    return PrivateTraining(
        model, private_optimizer, run_loader, ledger, grad_engine, privacy, noise, replicas
    )


def _check_binding(ledger: PrivacyLedger, run: Any, loader_state: Any) -> None:
    """The checkpoint's ledger must be this run's and as long as its sampler has stepped.

    Every completed private step records one ledger step and consumes one drawn batch, so the
    two counts are equal in any checkpoint the run wrote itself.
    """
    if ledger.run_id != run:
        raise ValueError(
            f"the checkpoint's ledger belongs to run {ledger.run_id!r}, not to the checkpoint's "
            f"run {run!r}: it was taken from another checkpoint. Nothing was loaded — resume "
            "from a checkpoint as the run wrote it"
        )
    provenance = loader_state.get("provenance") if isinstance(loader_state, dict) else None
    stepped = provenance.get("stepped") if isinstance(provenance, dict) else None
    if stepped != ledger.steps:
        raise ValueError(
            f"the checkpoint's ledger records {ledger.steps} training steps but its sampler state "
            f"says {stepped} batches were stepped on: the ledger is from another point of the "
            "run (or was emptied). Nothing was loaded — resume from a checkpoint as the run "
            "wrote it"
        )


# -- steps every builder shares (DP-SGD here, user level in dpfy.train.user_level, DP-FTRL in
# dpfy.train.ftrl)


def check_common(
    model: nn.Module, optimizer: torch.optim.Optimizer, delta: float, max_grad_norm: float
) -> tuple[float, float]:
    """Refuse what no private run can use: batch-coupled layers, a bad δ or C, a stray optimizer.

    Returns δ and C, checked.
    """
    check_model(model)
    delta = check_delta(delta)
    max_grad_norm = check_positive("max_grad_norm", max_grad_norm)
    _check_optimizer_params(model, optimizer)
    return delta, max_grad_norm


def warn_if_delta_too_large(delta: float, records: int, record: str = "example") -> None:
    """δ must be ≪ 1/N: publishing one random record outright satisfies δ = 1/N (guide §2.1)."""
    if delta >= 1 / records:
        n = "N" if record == "example" else f"N_{record}s"
        warnings.warn(
            f"δ = {delta:g} is not below 1/{n} = {1 / records:g}: a mechanism that publishes one "
            f"random {record}'s data outright would satisfy it (guide §2.1); choose δ ≪ 1/{n}",
            UserWarning,
            stacklevel=3,
        )


def seeded_generator(seed: int | None, secure: bool = False) -> torch.Generator | None:
    """The sampling generator: OS-seeded in production, seeded only for experiments.

    None with ``secure``: sampling then draws from the OS CSPRNG like the noise, since an
    adversary who can predict the batches defeats the amplification the accounting counts on.
    """
    if secure:
        if seed is not None:
            raise ValueError(
                "secure_noise=True draws sampling and noise from the OS CSPRNG, which no seed can "
                "replay; pass seed=None with secure_noise=True, or secure_noise=False to seed"
            )
        return None
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def noise_source(secure: bool, seed: int | None) -> NoiseSource:
    """The OS CSPRNG when asked, else a torch generator (OS-seeded unless ``seed`` is given)."""
    return SecureNoise() if secure else TorchNoise(seed=seed)


def with_virtual_batches(
    loader: DPDataLoader, max_physical_batch_size: int | None, boundary: BatchBoundary
) -> DPDataLoader | VirtualBatchLoader:
    """The loader, or chunks of at most ``max_physical_batch_size`` of each logical batch."""
    if max_physical_batch_size is None:
        return loader
    return VirtualBatchLoader(loader, max_physical_batch_size, boundary)


def _refuse_process_group(route: str, distributed: bool | None) -> None:
    """One-process-only routes must not run silently on every rank of a process group.

    Each rank would train its own private model on the whole dataset, W releases that no single
    ledger accounts. ``distributed=False`` says the user wants exactly that, rank by rank.
    """
    if distributed is False:
        return
    if distributed or isinstance(current_replicas(), ProcessGroupReplicas):
        raise ValueError(
            f"{route} runs in one process only, but a torch.distributed process group of more "
            "than one rank is running (or distributed=True was passed): every rank would train "
            "its own private model. Run it in a single process, or pass distributed=False if "
            "each rank should train (and account) its own run independently"
        )


def _other_algorithm(arguments: dict[str, Any]) -> PrivateTraining:
    """make_private's arguments handed to another algorithm's builder (DP-FTRL: dpfy.train.ftrl)."""
    from dpfy.train.ftrl.session import ALGORITHM, from_make_private

    if str(arguments["algorithm"]).strip().lower() != ALGORITHM:
        raise ValueError(f"algorithm must be 'dp-sgd' or 'dp-ftrl'; got {arguments['algorithm']!r}")
    return from_make_private(arguments)


def _user_level(arguments: dict[str, Any]) -> PrivateTraining:
    """make_private's arguments handed to user-level DP-SGD, refusing example-level-only ones."""
    from dpfy.train.user_level import make_user_private

    if arguments["user_ids"] is None:
        raise ValueError("max_examples_per_user needs user_ids (one user id per example)")
    accepted = inspect.signature(make_user_private).parameters
    defaults = inspect.signature(make_private).parameters
    poisson = arguments.get("sampler") is None or (
        SamplingKind.parse(arguments["sampler"]) is SamplingKind.POISSON
    )
    unsupported = [
        name
        for name, value in arguments.items()
        if name not in accepted
        and value != defaults[name].default
        and not (name == "sampler" and poisson)
        and not (name == "distributed" and value is False)  # one run per rank, by request
    ]
    if unsupported:
        raise ValueError(
            f"{', '.join(unsupported)} not supported with user_ids (user-level DP-SGD samples "
            "users by Poisson and clips per user, in one process); leave them at their defaults"
        )
    return make_user_private(**{k: v for k, v in arguments.items() if k in accepted})


def _resolve_steps(
    epochs: float | None, steps: int | None, dataset_size: int, batch_size: int
) -> int:
    """Total steps from exactly one of epochs (⌈E·N/B⌉) and steps."""
    if (epochs is None) == (steps is None):
        raise ValueError("give exactly one of epochs= or steps=")
    if steps is not None:
        return check_count("steps", steps, minimum=1)
    epochs = check_positive("epochs", epochs)
    return max(1, math.ceil(epochs * dataset_size / batch_size))


def _check_optimizer_params(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The optimizer must update this model's parameters (not a copy's, e.g. after fix())."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    owned = {id(p) for p in model.parameters()}
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in owned:
                raise ValueError(
                    "the optimizer holds a parameter that is not in the model (was the optimizer "
                    "built before `model = dpfy.fix(model)`?); build it from model.parameters()"
                )


def _accounting_for(kind: SamplingKind, accountant: str) -> tuple[NeighbouringRelation, str]:
    """The relation and accountant a sampler's honest event needs."""
    if kind is SamplingKind.FIXED_SIZE:
        return NeighbouringRelation.REPLACE_ONE, "rdp"
    return NeighbouringRelation.ADD_OR_REMOVE, accountant


def _noise_multiplier(
    target_epsilon: float | None,
    noise_multiplier: float | None,
    delta: float,
    record: SamplingRecord,
    steps: int,
    accountant: str,
    relation: NeighbouringRelation,
) -> float:
    """σ given directly, or the smallest σ that meets the target for ``steps`` of ``record``."""
    return resolve_sigma(
        target_epsilon,
        noise_multiplier,
        delta,
        lambda sigma: SelfComposedEvent(record.event(sigma), steps),
        accountant,
        relation,
    )


def resolve_sigma(
    target_epsilon: float | None,
    noise_multiplier: float | None,
    delta: float,
    run_events: Callable[[float], DpEvent],
    accountant: str,
    relation: NeighbouringRelation,
) -> float:
    """σ given directly, or the smallest σ whose run (``run_events(σ)``) meets the target.

    Every builder calibrates against exactly the events its ledger will record.
    """
    if (target_epsilon is None) == (noise_multiplier is None):
        raise ValueError(
            "give exactly one of target_epsilon= (σ is calibrated) or noise_multiplier="
        )
    if noise_multiplier is not None:
        return check_positive("noise_multiplier", noise_multiplier)
    return smallest_noise_multiplier(
        run_events,
        check_positive("target_epsilon", target_epsilon),
        delta,
        accountant=accountant,
        relation=relation,
    )
