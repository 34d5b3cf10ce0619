"""The settings of ``dpfy train``, torch-free so the CLI can show their defaults cheaply."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dpfy._validate import (
    check_count,
    check_learning_rate,
    check_positive,
    check_positive_at_most,
    check_seed,
)
from dpfy.jobs.access import ACCESS_NAMES as _ACCESS_NAMES
from dpfy.plan.variants import trained_algorithms, variant_keys

#: Datasets, models and gradient engines ``dpfy train`` offers, spelt out here so the CLI lists
#: them without importing torch; a test holds each equal to its registry (datasets, models,
#: ``make_engine``'s choices).
DATASET_NAMES = ("adult", "breast-cancer", "digits", "fashion-mnist", "mnist")
MODEL_NAMES = ("cnn", "logreg", "mlp")
ENGINE_NAMES = ("auto", "fast", "vmap")

#: Optimizers the trainer offers (each post-processes the private gradient, guide §5.5.2).
OPTIMIZER_NAMES = ("sgd", "adam", "adamw", "adagrad")

#: Units of privacy ``dpfy train`` offers: per example (DP-SGD), or per simulated user
#: (user-level DP-SGD on :func:`dpfy.data.users.split_users`; batch_size then counts users).
UNIT_NAMES = ("example", "user")

#: Training algorithms ``dpfy train`` offers: every variant make_private trains, as registered
#: (dpfy.plan.variants): DP-SGD, DP-FTRL, BandMF, BLT; all but DP-SGD at the example level only.
ALGORITHM_NAMES = trained_algorithms()

#: ``--sampler`` names; which fit which algorithm is the variant's resolver's word.
SAMPLER_NAMES = (
    "poisson",
    "truncated-poisson",
    "balls-in-bins",
    "shuffle",
    "fixed-size",
    "fixed-order",
    "cyclic-poisson",
)

#: Where DP applies (guide §3.2): full training (DP-SGD), label-only or input-level DP; the
#: names come from the access-model registry (:mod:`dpfy.jobs.access`).
ACCESS_NAMES = _ACCESS_NAMES

#: Label-only DP's randomisers: k-ary randomised response, or RR-with-prior in stages (a test
#: holds this equal to :data:`dpfy.access.label_ledger.LABEL_MECHANISMS`).
LABEL_MECHANISM_NAMES = ("rr", "rr-prior")

#: Upper bound on --epochs (and tuning's --trial-epochs): generous, as DP runs take tens to
#: hundreds of passes, and it keeps the ⌈E·N/B⌉ steps within what the accountants compose.
MAX_EPOCHS = 10_000


def check_epochs(name: str, value: float) -> float:
    """Epochs lie in (0, MAX_EPOCHS]: a longer run never ends and overflows the accounting."""
    return check_positive_at_most(
        name, value, MAX_EPOCHS, "no DP run needs more passes over its data"
    )


#: Users per step a user-level run expects when no batch size is given: a fifth of the users,
#: so the default run samples (q = 0.2) rather than being refused for B > users.
USERS_PER_STEP_SHARE = 5


def default_user_batch(users: int) -> int:
    """The expected users per step of a user-level run given no batch size: users / 5."""
    return max(1, users // USERS_PER_STEP_SHARE)


@dataclass(frozen=True)
class TrainConfig:
    """Everything ``dpfy train`` needs; the defaults train digits at ε = 3 in under a minute."""

    dataset: str = "digits"
    model: str = "mlp"
    target_epsilon: float = 3.0
    delta: float | None = None
    epochs: float = 20
    batch_size: int = 128
    max_grad_norm: float = 1.0
    lr: float = 0.01
    optimizer: str = "adam"
    out: Path | None = None
    #: Seeds sampling and noise (experiments only: the report flags a seeded run as not private
    #: against anyone who knows the seed). None: OS entropy.
    seed: int | None = None
    baseline: bool = False
    data_dir: Path | None = None
    engine: str = "auto"
    unit: str = "example"
    users: int = 100
    max_examples_per_user: int | None = None
    algorithm: str = "dp-sgd"
    #: How batches are drawn, when the algorithm offers a choice (None: its default): DP-SGD
    #: poisson | shuffle | fixed-size, DP-FTRL shuffle | fixed-order, BandMF fixed-order |
    #: cyclic-poisson (amplified BandMF), BLT fixed-order. The variant's resolver checks it.
    sampler: str | None = None
    #: ``--sampler truncated-poisson``: M, the rows of every padded batch.
    max_batch_size: int | None = None
    #: BandMF's bands and BLT's buffers (None: the variant's default).
    bands: int | None = None
    buffers: int | None = None
    access: str = "full"
    label_mechanism: str = "rr"
    stages: int = 1
    #: The user declares the features public (what label-only DP assumes; the report says so).
    features_public: bool = False
    #: The user's own data (``--data FILE --label COLUMN``; dpfy.data.user_file): the file, its
    #: label column, the features' declared scale, and an optional file of test rows.
    data: Path | None = None
    label: str | None = None
    feature_bounds: str | None = None
    test_data: Path | None = None

    def resolved_delta(self, dataset_size: int) -> float:
        """δ as given, or a power of ten at least 10× below 1/N (guide §2.1: δ ≪ 1/N)."""
        if self.delta is not None:
            return self.delta
        return 10.0 ** -(math.ceil(math.log10(dataset_size)) + 1)


def check_config(config: TrainConfig) -> None:
    """Refuse bad settings before any data is loaded."""
    check_positive("target_epsilon", config.target_epsilon)
    check_epochs("epochs", config.epochs)
    check_count("batch_size", config.batch_size, minimum=1)
    check_positive("max_grad_norm", config.max_grad_norm)
    check_learning_rate("lr", config.lr)
    check_seed(config.seed)
    if config.optimizer not in OPTIMIZER_NAMES:
        raise ValueError(
            f"optimizer must be one of {', '.join(OPTIMIZER_NAMES)}; got {config.optimizer!r}"
        )
    if config.unit not in UNIT_NAMES:
        raise ValueError(f"unit must be one of {', '.join(UNIT_NAMES)}; got {config.unit!r}")
    if config.unit == "user":
        check_count("users", config.users, minimum=1)
        if config.batch_size > config.users:
            raise ValueError(
                f"batch_size {config.batch_size} exceeds --users {config.users}: at user level "
                "batch_size is the expected number of users per step; lower it"
            )
    if config.max_examples_per_user is not None:
        check_count("max_examples_per_user", config.max_examples_per_user, minimum=1)
        if config.unit != "user":
            raise ValueError(
                "--max-examples-per-user caps a sampled user's examples, so it needs --unit user; "
                "drop it, or pass --unit user"
            )
    if config.algorithm not in ALGORITHM_NAMES:
        raise ValueError(
            f"algorithm must be one of {', '.join(ALGORITHM_NAMES)}; got {config.algorithm!r}"
        )
    units = [unit for name, unit in variant_keys() if name == config.algorithm]
    if config.unit not in units:
        raise ValueError(f"--algorithm {config.algorithm} needs --unit {' or '.join(units)}")
    if config.sampler is not None and config.sampler not in SAMPLER_NAMES:
        raise ValueError(
            f"sampler must be one of {', '.join(SAMPLER_NAMES)}; got {config.sampler!r}"
        )
    for name in ("bands", "buffers", "max_batch_size"):
        if getattr(config, name) is not None:
            check_count(name, getattr(config, name), minimum=1)
    _check_access(config)
    _check_own_data(config)


def _check_own_data(config: TrainConfig) -> None:
    """``--data`` needs ``--label`` and trains with full DP-SGD access only (for now)."""
    if config.data is None:
        if config.label is not None or config.feature_bounds is not None or config.test_data:
            raise ValueError("--label, --feature-bounds and --test-data go with --data FILE")
        return
    if not config.label and not config.data.is_dir():  # a folder's labels are its subfolders
        raise ValueError("--data needs --label COLUMN: the column (or NPZ array) of the labels")
    if config.access != "full":
        raise ValueError(
            f"--data trains with --access full only; --access {config.access} uses the "
            "bundled datasets (drop --access, or --data)"
        )


#: Why --features-public means nothing under each other access model.
_FEATURES_COVERED = {
    "full": "protects the features with the labels",
    "input": "randomises the features themselves",
    "prediction": "protects the whole training set behind the answers",
}


def _check_access(config: TrainConfig) -> None:
    """The access model is known, and its options belong to it (label: mechanism, stages)."""
    if config.access not in ACCESS_NAMES:
        raise ValueError(f"access must be one of {', '.join(ACCESS_NAMES)}; got {config.access!r}")
    if config.label_mechanism not in LABEL_MECHANISM_NAMES:
        raise ValueError(
            f"label_mechanism must be one of {', '.join(LABEL_MECHANISM_NAMES)}; "
            f"got {config.label_mechanism!r}"
        )
    check_count("stages", config.stages, minimum=1)
    if config.stages > 1 and (config.access != "label" or config.label_mechanism != "rr-prior"):
        raise ValueError("--stages applies to --access label --label-mechanism rr-prior only")
    if config.access != "label" and config.label_mechanism != "rr":
        raise ValueError(
            f"--label-mechanism applies to --access label only (--access {config.access} "
            "randomises no labels); drop it, or pass --access label"
        )
    if config.access != "label" and config.features_public:
        raise ValueError(
            f"--features-public applies to --access label only (it declares the features that "
            f"label-only DP leaves unprotected public; --access {config.access} "
            f"{_FEATURES_COVERED.get(config.access, 'does not use it')}); drop it"
        )
    if config.access in ("label", "input") and (config.unit, config.algorithm) != (
        "example",
        "dp-sgd",
    ):
        raise ValueError(
            f"--access {config.access} randomises each example's data once and trains without "
            "DP-SGD: drop --unit and --algorithm (they apply to --access full)"
        )


def public_seed(seed: int | None) -> int:
    """The seed for what is public anyway — model init, simulated splits, candidate grids.

    An unset seed fixes these at 0 so that runs stay comparable, while sampling and noise (the
    private randomness) come from OS entropy.
    """
    return 0 if seed is None else seed


#: The file a run directory keeps its settings in, and the key naming the command that wrote it.
CONFIG_FILE = "config.json"
_COMMAND_KEY = "command"
_PATH_FIELDS = ("out", "data_dir", "data", "test_data")


def config_document(config: TrainConfig) -> dict[str, Any]:
    """The JSON object ``config.json`` holds: every setting by its TrainConfig name.

    ``dpfy train --config`` reads it back, so it names the command that wrote it (a federated
    run's settings are a different set) and keeps paths as strings.
    """
    settings = {k: (None if v is None else str(v)) if k in _PATH_FIELDS else v
                for k, v in dataclasses.asdict(config).items()}  # fmt: skip
    return {_COMMAND_KEY: "train", **settings}


def write_config(config: TrainConfig, run_dir: Path) -> Path:
    """Write the run's ``config.json`` (what ``--config`` replays and ``--resume`` continues)."""
    from dpfy._safe_io import atomic_write_text  # fsynced, then renamed: never a 0-byte file

    return atomic_write_text(
        run_dir / CONFIG_FILE, json.dumps(config_document(config), indent=2) + "\n"
    )


def read_config(path: Path) -> TrainConfig:
    """The settings a ``config.json`` holds; one ValueError naming the file and the fix if not."""
    from dpfy._safe_io import read_json  # bounded, regular files only: no FIFO, no /dev/zero

    try:
        document = read_json(Path(path), "--config", limit=2**20)
    except FileNotFoundError:
        raise ValueError(
            f"{path} does not exist; pass the config.json of a `dpfy train` run"
        ) from None
    except ValueError as err:
        reason = str(err).removesuffix("; pass the path of a file")
        raise ValueError(f"{reason}; pass the config.json of a `dpfy train` run") from None
    if not isinstance(document, dict) or document.get(_COMMAND_KEY, "train") != "train":
        written_by = document.get(_COMMAND_KEY) if isinstance(document, dict) else None
        raise ValueError(
            f"{path} holds no `dpfy train` settings (written by {written_by or 'something else'}); "
            "pass the config.json of a `dpfy train` run"
        )
    settings = {k: v for k, v in document.items() if k != _COMMAND_KEY}
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise ValueError(
            f"{path} holds settings `dpfy train` does not know ({', '.join(unknown)}); remove "
            f"them (known: {', '.join(sorted(known))})"
        )
    for name, value in settings.items():
        if not _fits(value, _FIELD_TYPES[name]):
            raise ValueError(
                f"{path}: {name} is {value!r}, not {_FIELD_TYPES[name]}; correct it in the file "
                "(or write it again with `dpfy train`)"
            )
    for name in _PATH_FIELDS:
        if settings.get(name) is not None:
            settings[name] = Path(settings[name])
    return TrainConfig(**settings)


#: Each setting's type as written in TrainConfig ("float | None", …), for checking a read file.
_FIELD_TYPES = {f.name: str(f.type) for f in dataclasses.fields(TrainConfig)}
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "float": (int, float), "int": (int,), "str": (str,), "bool": (bool,), "Path": (str,),
}  # fmt: skip


def _fits(value: Any, annotation: str) -> bool:
    """Whether a JSON value can stand for a setting of this annotation (bool is no number)."""
    for part in (name.strip() for name in annotation.split("|")):
        if part == "None" and value is None:
            return True
        kinds = _JSON_TYPES.get(part, ())
        if isinstance(value, bool) and bool not in kinds:
            continue
        if isinstance(value, kinds):
            return True
    return False
