"""A private training run: model, private optimizer, loader, ledger and engine, with checkpoints.

:func:`dpfy.train.builder.make_private` returns one :class:`PrivateTraining` whatever the
variant; its checkpoints hold the plan, and resuming refuses any checkpoint that does not belong
to the run (another run's ledger, an earlier one, other settings, edited bytes). They hold no
noise generator state: every resume draws fresh noise, so noise is never replayed.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import secrets
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dpfy._safe_io import check_regular_file
from dpfy.data.loader import DPDataLoader
from dpfy.plan.accounting.events import GaussianEvent, SelfComposedEvent
from dpfy.plan.privacy_plan import PrivacyPlan
from dpfy.plan.sampling import SamplingKind
from dpfy.train import report_seam
from dpfy.train.checkpoints import save_atomically, seal, unseal
from dpfy.train.compiled_step import CompiledStep
from dpfy.train.distributed import (
    ProcessGroupReplicas,
    SingleProcess,
)
from dpfy.train.grads import GradEngine
from dpfy.train.ledger import TRAINING, PrivacyLedger
from dpfy.train.noise.source import NoiseSource
from dpfy.train.opacus_names import RUN_ATTRIBUTES, UNPACKING, attribute_error
from dpfy.train.optim import DPOptimizer
from dpfy.train.virtual import VirtualBatchLoader

#: The ledger label of steps taken after a checkpoint that the run then went back to.
REWOUND = "rewound steps"
#: The label of the steps a session took before it loaded another run's checkpoint: released on
#: the same data, so they stay in its ledger.
SPENT_BEFORE_LOAD = "steps before loading another run's checkpoint"
#: The label of the balls-in-bins epochs a load makes the run release again with the same
#: assignment of examples to batches (charged two Gaussians of σ each, at the load).
REPLAYED_EPOCH = "balls-in-bins epochs released again with their assignment after going back"


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
        optimizer.noise = noise
        self.replicas = replicas if replicas is not None else SingleProcess()
        if ledger.run_id is None:  # one identity for all ranks, drawn by the writer
            ledger.run_id = self.replicas.on_writer(lambda: secrets.token_hex(8))

    def __iter__(self) -> Any:
        """Not a tuple: Opacus's ``model, optimizer, loader = …`` is answered with dpfy's way."""
        raise TypeError(UNPACKING)

    def __getattr__(self, name: str) -> Any:
        """Only reached for a missing attribute: Opacus's names get dpfy's spelling."""
        raise attribute_error(type(self).__name__, name, RUN_ATTRIBUTES)

    @property
    def noise(self) -> NoiseSource:
        """The source the run's noise is drawn from (the optimizer's: one source, one state)."""
        return self.optimizer.noise

    @property
    def criterion(self) -> Callable[..., torch.Tensor]:
        """The ``criterion`` given to make_private, probed for coupled examples: call this one.

        It returns what the criterion returns; on scheduled batches it also checks that each
        example's loss gradient is its gradient alone (:mod:`dpfy.train.behaviour.loss_probe`).
        """
        behaviour = self.optimizer.behaviour
        if behaviour is None or behaviour.loss is None:
            raise ValueError(
                "no criterion was given to make_private: pass criterion=your_loss to "
                "make_private to have the loss checked, then call private.criterion(output, "
                "target)"
            )
        return behaviour.loss

    def compiled_step(
        self,
        criterion: Callable[..., torch.Tensor] | None = None,
        *,
        compile: bool = True,
        compile_options: dict[str, Any] | None = None,
    ) -> CompiledStep:
        """A private step that is one function of the batch: ``loss = step(x, y)`` per batch.

        Per-example gradients come from ``torch.func`` (each example alone) and, with
        ``compile=True``, the clip-and-sum is compiled by ``torch.compile`` once per batch shape,
        so it needs a sampler whose batches all have the same rows
        (``sampler="truncated-poisson"`` with ``max_batch_size``, ``"fixed-size"``, or the
        epoch orders of DP-FTRL, BandMF and BLT); ``compile=False`` runs it eagerly.
        ``criterion`` defaults to the one given to make_private; ``compile_options`` go to
        ``torch.compile`` (e.g. ``{"mode": "max-autotune"}``). Use it instead of
        ``loss.backward(); optimizer.step()``, with the loader's batches as handed out::

            step = private.compiled_step()
            for x, y in private.loader:
                loss = step(x, y)

        The same guarantees and the same ledger as the hooked step
        (:mod:`dpfy.train.compiled_step`).
        """
        if isinstance(self.loader, VirtualBatchLoader):
            raise ValueError(
                "the compiled step takes each loader batch whole; drop max_physical_batch_size "
                "(lower max_batch_size instead to fit memory)"
            )
        if criterion is None:
            behaviour = self.optimizer.behaviour
            if behaviour is None or behaviour.loss is None:
                raise ValueError(
                    "the compiled step needs the loss: pass criterion=your_loss to make_private "
                    "or to compiled_step"
                )
            criterion = behaviour.loss.criterion
        return CompiledStep(
            self.model, self.optimizer, criterion, compile=compile, compile_options=compile_options
        )

    @property
    def noise_multiplier(self) -> float:
        """σ: noise std divided by the clip norm (decoupled: accounting never sees σ·C)."""
        return self.plan.noise_multiplier

    def epsilon(self, delta: float | None = None) -> float:
        """ε spent so far at ``delta`` (the run's δ by default), training and tuning included."""
        return self.ledger.epsilon(delta)

    def report(self, out_dir: str | os.PathLike[str], **details: Any) -> dict[str, Path]:
        """Write this run's privacy report card into ``out_dir``: report.md, report.json,
        facts.json and the plots (guide §5.3.3), from what the ledger recorded so far.

        ``details`` say what only the caller knows: ``dataset`` and ``model`` names,
        ``dataset_source``, ``preprocessing``, ``accuracy`` and ``baseline_accuracy`` measured on
        held-out data, the training ``history`` (rows with ``step``, ``loss``, …), ``overwrite``
        (a directory that already holds a report is refused without it), ``plots``, and for a
        sequence task ``sequence_task`` and ``loss_normalisation`` (defaults: what the engine saw).
        Returns the written paths by name. In a distributed run call it on one rank.
        """
        return report_seam.write(self, out_dir, **details)

    @property
    def run_id(self) -> str:
        """This run's identity, kept by its ledger: a resumed run continues the same one."""
        assert self.ledger.run_id is not None
        return self.ledger.run_id

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs: model, optimizer, ledger, sampler, and the noise a
        correlated mechanism must carry on (DP-FTRL's tree nodes already drawn, BandMF's and
        BLT's buffers).

        No noise generator state: a resumed run draws fresh noise (:meth:`load_state_dict`).
        Sealed with a content digest (:mod:`dpfy.train.checkpoints`). Distributed: collective (call
        it on every rank); holds every rank's sampler state.
        """
        return seal(
            {
                "plan": asdict(self.plan),
                "model": self.replicas.model_state(self.model),
                "optimizer": self.replicas.optimizer_state(
                    self.model, self.optimizer.original_optimizer
                ),
                "ledger": self.ledger.state_dict(),
                "loader": self.replicas.gather(self.loader.state_dict()),
                "mechanism": self.optimizer.mechanism.state_dict(),
                "run": self.run_id,
            }
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`; all or nothing — on any error nothing has changed.

        Every resume draws fresh noise: the checkpoint holds no noise generator state, and the
        run's source starts a stream never drawn before (OS entropy; with ``seed=``, one derived
        from the seed, the step resumed at and a count of this process's resumes, so an
        experiment reproduces yet never replays the interrupted run's stream). Replaying noise
        would let two continuations that differ in one record cancel it in their difference.
        Only noise a correlated mechanism already drew is restored exactly (DP-FTRL's tree
        nodes, BandMF's past outputs, BLT's buffers): the stream continues once. Two
        continuations of one checkpoint are therefore two releases of the steps after it, and
        they spend twice: this method does not refuse the second (``dpfy train --resume``
        does), and each continuation's ledger counts only its own steps, so say so when
        publishing both.

        Refused: a checkpoint whose content changed since it was written, or whose ledger does
        not belong with its sampler state (another run's, an earlier one, an emptied one), and a
        run whose noise source cannot start a fresh stream (no ``reseed``). Going back to an
        earlier checkpoint of this same run keeps what was spent since: those steps are carried
        in the ledger as :data:`REWOUND` releases, so ε never goes down; loading another run's
        checkpoint keeps what this session spent before, as :data:`SPENT_BEFORE_LOAD`. A
        DP-FTRL, BandMF or BLT run cannot go back at all. Checkpoints of dpfy versions that saved
        the noise state still load; that state is ignored, and plan fields they predate take
        their defaults.
        """
        state = unseal(state)
        if not callable(getattr(self.noise, "reseed", None)):
            raise ValueError(
                f"the run's noise source ({type(self.noise).__name__}) cannot start a fresh "
                "stream (it has no reseed method), and a resumed run must never draw noise it "
                "may have drawn before. Nothing was loaded — resume with dpfy's own noise source"
            )
        mine = self.replicas.mine(state["loader"])  # another number of ranks: refused by name
        saved = _with_defaults(state["plan"])
        if saved != asdict(self.plan):
            raise ValueError(
                "the checkpoint was made with different privacy settings "
                f"({saved}) than this run ({asdict(self.plan)}); resume with the same "
                "make_private arguments. Nothing was loaded."
            )
        ledger = PrivacyLedger.from_state_dict(state["ledger"])  # validates before any change
        _check_binding(ledger, state["run"], mine, state["mechanism"])
        carried = REWOUND if ledger.run_id == self.run_id else SPENT_BEFORE_LOAD
        steps_before = self.ledger.steps  # the training steps released before this load
        if ledger.run_id == self.run_id:
            rewound = self.ledger.spent_beyond(ledger)
        else:  # another run's checkpoint: what this session already released stays spent
            rewound = self.ledger.spent_beyond(PrivacyLedger.from_state_dict(_emptied(ledger)))
        if rewound and ledger.run_id == self.run_id and self.plan.mechanism != "gaussian":
            raise ValueError(
                f"the checkpoint is an earlier point of this {self.plan.algorithm} run: training "
                f"on from it would release again noise correlated with steps already released "
                "(tree nodes, or matrix-factorisation buffers) that hold its examples, which the "
                "ledger cannot charge. Nothing was loaded — resume from the latest checkpoint, "
                "or start a new run"
            )
        backup = {
            "model": copy.deepcopy(self.replicas.model_state(self.model)),
            "optimizer": copy.deepcopy(
                self.replicas.optimizer_state(self.model, self.optimizer.original_optimizer)
            ),
            "loader": self.loader.state_dict(),
            "mechanism": copy.deepcopy(self.optimizer.mechanism.state_dict()),
        }
        try:
            self._load_model_and_optimizer(state["model"], state["optimizer"])
            self.loader.load_state_dict(mine)
            self.optimizer.mechanism.load_state_dict(state["mechanism"])
        except Exception as err:
            self._load_model_and_optimizer(backup["model"], backup["optimizer"])
            self.loader.load_state_dict(backup["loader"])
            self.optimizer.mechanism.load_state_dict(backup["mechanism"])
            raise ValueError(
                f"the checkpoint does not fit this run ({err}); nothing was loaded"
            ) from None
        self.noise.reseed(ledger.steps)  # never the stream drawn on from this checkpoint before
        self.ledger.load_state_dict(ledger.state_dict())
        for (label, event), count in rewound.items():
            self.ledger.record_event(
                event, label=carried if label in (TRAINING, REWOUND) else label, count=count
            )
        if rewound and ledger.run_id == self.run_id:
            replayed = self._replayed_epochs(ledger.steps, steps_before)
            if replayed:
                gaussians = SelfComposedEvent(GaussianEvent(self.plan.noise_multiplier), 2)
                self.ledger.record_event(gaussians, label=REPLAYED_EPOCH, count=replayed)

    def _replayed_epochs(self, resumed_at: int, reached: int) -> int:
        """How many balls-in-bins epochs going back from step ``reached`` to ``resumed_at`` may
        release a second time with the assignment of examples to batches they had.

        An epoch's charge (random allocation) holds for one release of a hidden assignment
        drawn afresh; the sampler's state makes the resumed run draw the same batches again,
        and two releases of one assignment can reveal it. For each fixed assignment, two
        releases are two Gaussian mechanisms of σ on each example (one batch per release), and a
        random assignment is a mixture of those, so two Gaussians of σ per such epoch (on top of
        what the ledger holds) cover it: every epoch begun before the load, from the one the
        checkpoint is in (:data:`REPLAYED_EPOCH`, charged at the load).
        """
        record = self.plan.sampling_record()
        if record.kind is not SamplingKind.BALLS_IN_BINS:
            return 0
        k = record.batches_per_epoch
        return max(0, -(-reached // k) - resumed_at // k)

    def _load_model_and_optimizer(self, model: Any, optimizer: Any) -> None:
        """The model's state, then the wrapped optimizer's (sharded models: into each shard)."""
        self.replicas.load_model_state(self.model, model)
        self.replicas.load_optimizer_state(self.model, self.optimizer.original_optimizer, optimizer)
        self.optimizer.load_state_dict(self.optimizer.original_optimizer.state_dict())

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write a checkpoint atomically: a crash mid-write never destroys the previous one.

        Distributed: call it on every rank; only rank 0 writes, the others wait until it has.
        """
        target = Path(path)
        state = self.state_dict()
        if not self.replicas.is_writer:
            self.replicas.barrier()
            return target
        save_atomically(state, target)
        self.replicas.barrier()
        return target

    def load(self, path: str | os.PathLike[str]) -> None:
        """Resume from a checkpoint file; a corrupt file is refused with nothing changed.

        As :meth:`load_state_dict`: the resumed run draws fresh noise, and loading one file into
        two runs makes two releases of the steps after it, which spend twice.
        """
        try:
            check_regular_file(Path(path), "checkpoint")  # a FIFO or device would never end
            state = torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise ValueError(f"checkpoint {path} does not exist") from None
        except ValueError:
            raise
        except Exception as err:
            raise ValueError(
                f"checkpoint {path} is corrupt or not a dpfy checkpoint ({type(err).__name__}); "
                "nothing was loaded — resume from an earlier checkpoint"
            ) from None
        self.load_state_dict(state)

    def detach(self) -> nn.Module:
        """Remove dpfy's hooks; returns the model (the optimizer can no longer step)."""
        self.engine.detach()
        self.optimizer.accumulation.remove()
        if self.optimizer.behaviour is not None:
            self.optimizer.behaviour.detach()
        return self.model

    def __repr__(self) -> str:
        """The run's privacy settings at a glance."""
        s = self.plan
        return (
            f"PrivateTraining(N={s.dataset_size}, B={s.expected_batch_size}, "
            f"q={s.sampling_rate:.4g}, σ={s.noise_multiplier:.4g}, C={s.max_grad_norm:g}, "
            f"steps={s.steps}, δ={s.delta:g}, engine={self.engine.kind})"
        )


def _emptied(ledger: PrivacyLedger) -> dict[str, Any]:
    """``ledger``'s state with nothing recorded: what another run's checkpoint takes over of
    this session's own ledger (so all of it is carried)."""
    return {**ledger.state_dict(), "entries": [], "examples_seen": 0, "sized_steps": 0}


def _with_defaults(saved: Any) -> Any:
    """A checkpoint's plan with the fields its dpfy version did not have at their defaults."""
    if not isinstance(saved, dict):
        return saved
    defaults = {
        f.name: f.default
        for f in dataclasses.fields(PrivacyPlan)
        if f.default is not dataclasses.MISSING
    }
    return {**{k: v for k, v in defaults.items() if k not in saved}, **saved}


def _check_binding(ledger: PrivacyLedger, run: Any, loader_state: Any, mechanism: Any) -> None:
    """The checkpoint's ledger must be this run's and as long as its sampler has stepped.

    Every completed private step records one ledger step, consumes one drawn batch and, for a
    mechanism with state across steps, advances it once, so the counts are equal in any
    checkpoint the run wrote itself.
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
    advanced = mechanism.get("steps_done", ledger.steps) if isinstance(mechanism, dict) else None
    if advanced != ledger.steps:
        raise ValueError(
            f"the checkpoint's noise mechanism has advanced {advanced} steps but its ledger "
            f"records {ledger.steps}: they are from different points of the run. Nothing was "
            "loaded — resume from a checkpoint as the run wrote it"
        )
