"""The cases of issue 35 ("Faults and bad input"), each classified the campaign's way.

Classes: clear (one ``error:`` line naming the problem), vague (one line that misleads or omits
the cause), traceback, hang (killed at the timeout), silent wrong (exit 0 or a state that is
wrong), silent accept (a setting that does not apply, taken without a word), data lost.

Run against any checkout: ``python benchmarks/faults_campaign.py --src /tmp/base/src`` runs the
subprocesses with that source tree first on PYTHONPATH (e.g. a ``git worktree`` of an older
commit); without ``--src`` the installed dpfy. Prints one row per case and the counts per class.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np

CLEAR, VAGUE, TRACE, HANG = "clear", "vague", "traceback", "hang"
WRONG, ACCEPT, LOST = "silent wrong", "silent accept", "data lost"
ENV: dict[str, str] = dict(os.environ)


def run(args: list[str], timeout: float = 120, limit_gb: float | None = None,
        **kw) -> tuple[int | None, str, str]:  # fmt: skip
    """Run ``python -m dpfy ARGS`` (or a python -c when args[0] == '-c'); None rc: timed out."""
    command = [sys.executable, *(args if args[0] == "-c" else ["-m", "dpfy", *args])]

    def limit() -> None:
        if limit_gb is not None:
            size = int(limit_gb * 2**30)
            resource.setrlimit(resource.RLIMIT_AS, (size, size))

    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=ENV, preexec_fn=limit, **kw)  # fmt: skip
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        return None, out, err
    return process.returncode, out, err


def classify(rc: int | None, err: str, keyword: str | None = None) -> str:
    """The class of a run expected to be refused."""
    if rc is None:
        return HANG
    if "Traceback" in err:
        return TRACE
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    if rc != 0 and len(errors) == 1:
        return CLEAR if keyword is None or keyword.lower() in errors[0].lower() else VAGUE
    if rc != 0:
        return VAGUE
    return ACCEPT


# --------------------------------------------------------------------------- fixtures


def adult_rows(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        rows.append(", ".join([
            str(rng.integers(17, 90)), "Private", str(rng.integers(10**4, 10**6)), "Bachelors",
            str(rng.integers(1, 17)), "Never-married", "Sales", "Not-in-family", "White",
            rng.choice(["Male", "Female"]), str(rng.integers(0, 5000)), "0",
            str(rng.integers(1, 99)), "United-States", rng.choice(["<=50K", ">50K"]),
        ]))  # fmt: skip
    return rows


def write_idx(path: Path, array: np.ndarray) -> None:
    code = {np.dtype("uint8"): 0x08, np.dtype("float32"): 0x0D}[array.dtype]
    big = array.astype(array.dtype.newbyteorder(">"))
    header = bytes([0, 0, code, array.ndim]) + np.asarray(array.shape, ">u4").tobytes()
    path.write_bytes(gzip.compress(header + big.tobytes()))


def float_mnist(directory: Path, nan_train: str, nan_test: bool) -> Path:
    rng = np.random.default_rng(0)
    directory.mkdir(parents=True)
    for prefix, n in (("train", 600), ("t10k", 200)):
        images = (rng.random((n, 28, 28)) * 255).astype(np.float32)
        if prefix == "train" and nan_train == "all":
            images[:] = np.nan
        if prefix == "train" and nan_train == "one":
            images[5] = np.nan
        if prefix == "t10k" and nan_test:
            images[::2] = np.nan
        write_idx(directory / f"{prefix}-images-idx3-ubyte.gz", images)
        labels = rng.integers(0, 10, n).astype(np.uint8)
        write_idx(directory / f"{prefix}-labels-idx1-ubyte.gz", labels)
    return directory


def tiny_model(directory: Path) -> Path:
    from transformers import BertConfig, BertModel, BertTokenizerFast

    directory.mkdir(parents=True)
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "good", "bad", "film", "plot", "a"]
    (directory / "vocab.txt").write_text("\n".join(words) + "\n")
    BertTokenizerFast(vocab_file=str(directory / "vocab.txt")).save_pretrained(directory)
    config = BertConfig(
        vocab_size=len(words), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=24, max_position_embeddings=32,
    )  # fmt: skip
    BertModel(config, add_pooling_layer=False).save_pretrained(directory)
    return directory


def rt_data(directory: Path) -> Path:
    import bz2
    import csv
    import io

    directory.mkdir(parents=True)
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(["category", "text", "movie_name", "has_plot_and_reviews"])
    rng = np.random.default_rng(0)
    for i in range(2200):
        fresh = i % 5 < 3
        words = rng.choice(["good", "film"] if fresh else ["bad", "plot"], size=4)
        writer.writerow(["fresh" if fresh else "rotten", " ".join(words), "m", "False"])
    (directory / "rotten_tomatoes_corpus_full.csv.bz2").write_bytes(
        bz2.compress(buffer.getvalue().encode())
    )
    return directory


def finished_run(root: Path, name: str) -> Path:
    out = root / name
    rc, _, err = run(["train", "--model", "logreg", "--epochs", "0.3", "--out", str(out)])
    assert rc in (0, 3), err
    return out


def interrupted_run(root: Path, name: str) -> Path:
    """A run stopped by Ctrl-C once its first checkpoint exists."""
    out = root / name
    process = subprocess.Popen([sys.executable, "-m", "dpfy", "train", "--model", "logreg",
                                "--epochs", "3", "--out", str(out)], env=ENV,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    while not (out / "checkpoint.pt").exists():
        time.sleep(0.2)
    time.sleep(0.5)
    process.send_signal(signal.SIGINT)
    process.wait(120)
    return out


def copy(run_dir: Path, to: Path) -> Path:
    import shutil

    shutil.copytree(run_dir, to)
    return to


# --------------------------------------------------------------------------- cases

Case = Callable[[Path], tuple[str, str]]
CASES: list[tuple[str, Case]] = []


def case(name: str) -> Callable[[Case], Case]:
    def register(function: Case) -> Case:
        CASES.append((name, function))
        return function

    return register


@case("1 adult age=nan in half the test rows")
def _(tmp: Path) -> tuple[str, str]:
    d = tmp / "adult"
    d.mkdir()
    (d / "adult.data").write_text("\n".join(adult_rows(200, 0)) + "\n")
    test = [
        ("nan" + r[r.index(",") :] if i % 2 else r) + "." for i, r in enumerate(adult_rows(60, 1))
    ]
    (d / "adult.test").write_text("\n".join(test) + "\n")
    rc, out, err = run(["train", "--dataset", "adult", "--data-dir", str(d), "--model", "logreg",
                        "--epochs", "1", "--out", str(tmp / "r")])  # fmt: skip
    return (WRONG if rc in (0, 3) else classify(rc, err, "finite")), (out + err)[-160:]


@case("1 mnist NaN test images")
def _(tmp: Path) -> tuple[str, str]:
    d = float_mnist(tmp / "m", "none", True)
    rc, out, err = run(["train", "--dataset", "mnist", "--data-dir", str(d), "--model", "logreg",
                        "--epochs", "1", "--out", str(tmp / "r")])  # fmt: skip
    return (WRONG if rc in (0, 3) else classify(rc, err, "finite")), (out + err)[-160:]


for _access in ("label", "prediction"):

    @case(f"1 all-NaN training images, --access {_access}")
    def _(tmp: Path, access: str = _access) -> tuple[str, str]:
        d = float_mnist(tmp / "m", "all", False)
        extra = ["--features-public"] if access == "label" else []
        rc, out, err = run(["train", "--dataset", "mnist", "--data-dir", str(d), "--access",
                            access, *extra, "--model", "logreg", "--epochs", "1", "--out",
                            str(tmp / "r")])  # fmt: skip
        return (ACCEPT if rc in (0, 3) else classify(rc, err, "finite")), (out + err)[-160:]


@case("1 all-NaN training images, dpfy federated")
def _(tmp: Path) -> tuple[str, str]:
    d = float_mnist(tmp / "m", "all", False)
    rc, out, err = run(["federated", "--dataset", "mnist", "--data-dir", str(d), "--model",
                        "logreg", "--rounds", "2", "--users", "20", "--clients-per-round", "5",
                        "--out", str(tmp / "r")])  # fmt: skip
    return (ACCEPT if rc in (0, 3) else classify(rc, err, "finite")), (out + err)[-160:]


@case("1 DP-SGD with one NaN training row")
def _(tmp: Path) -> tuple[str, str]:
    d = float_mnist(tmp / "m", "one", False)
    rc, out, err = run(["train", "--dataset", "mnist", "--data-dir", str(d), "--model", "logreg",
                        "--epochs", "2", "--out", str(tmp / "r")])  # fmt: skip
    status = json.loads((tmp / "r" / "status.json").read_text()).get("status") if (
        tmp / "r" / "status.json").exists() else None  # fmt: skip
    if rc in (0, 3):
        return WRONG, "trained on a NaN row: " + (out + err)[-100:]
    if status == "running":
        return LOST, f"failed, status left running: {err[-120:]}"
    return classify(rc, err, "finite"), err[-160:]


API_LOAD = textwrap.dedent("""
    import torch, dpfy
    from torch import nn
    from torch.utils.data import TensorDataset
    def run(seed):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        data = TensorDataset(torch.randn(96, 4), torch.arange(96) % 3)
        return dpfy.make_private(net, torch.optim.SGD(net.parameters(), lr=0.5), data,
            batch_size=8, delta=1e-5, max_grad_norm=1.0, noise_multiplier=1.0, steps=40, seed=seed)
    def steps(p, n):
        done = 0
        while done < n:
            for x, y in p.loader:
                p.optimizer.zero_grad()
                nn.functional.cross_entropy(p.model(x), y).backward(); p.optimizer.step()
                done += 1
                if done == n:
                    return
    other = run(1); steps(other, 8); other.save('OTHER')
    me = run(2); steps(me, 16); before = me.epsilon()
    me.load('OTHER')
    print(before, me.epsilon())
""")


@case("2 API: load another run's checkpoint after 16 steps")
def _(tmp: Path) -> tuple[str, str]:
    rc, out, err = run(["-c", API_LOAD.replace("OTHER", str(tmp / "o.pt"))])
    if rc != 0:
        return classify(rc, err), err[-160:]
    before, after = map(float, out.split())
    return (WRONG if after < before else CLEAR), f"ε before load {before:.3f}, after {after:.3f}"


AUDIT = ["--canaries", "20", "--blocks", "5", "--method", "one-run", "--seed", "0"]


@case("3 two audits of one run at once")
def _(tmp: Path) -> tuple[str, str]:
    r = copy(RUNS["finished"], tmp / "r")
    procs = [subprocess.Popen([sys.executable, "-m", "dpfy", "audit", str(r), *AUDIT], env=ENV,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]  # fmt: skip
    codes = [p.wait(300) for p in procs]
    audits = len(json.loads((r / "facts.json").read_text()).get("audits", []))
    listed = len(json.loads((r / "audit.json").read_text()).get("audits", []))
    detail = f"exit {codes}, facts.json holds {audits} audits, audit.json {listed}"
    if codes == [0, 0] and audits == listed == 2:
        return CLEAR, detail
    return LOST, detail


@case("3 audit while the run trains (a resume)")
def _(tmp: Path) -> tuple[str, str]:
    r = copy(RUNS["interrupted"], tmp / "r")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    status = json.loads((r / "status.json").read_text())
    status.update(status="running", pid=sleeper.pid)
    (r / "status.json").write_text(json.dumps(status))
    try:
        rc, _out, err = run(["audit", str(r), *AUDIT])
    finally:
        sleeper.kill()
    if rc == 0:
        return LOST, "accepted: the resume's final report then erases it"
    return classify(rc, err, "trained"), err[-160:]


@case("3 audit of an interrupted run keeps its banner")
def _(tmp: Path) -> tuple[str, str]:
    r = copy(RUNS["interrupted"], tmp / "r")
    rc, _out, err = run(["audit", str(r), *AUDIT])
    if rc != 0:
        return classify(rc, err), err[-160:]
    kept = (r / "report.md").read_text().startswith("> **Interrupted**")
    return (CLEAR if kept else LOST), f"banner kept: {kept}"


@case("4 --config /dev/zero (address space limited to 3 GB)")
def _(tmp: Path) -> tuple[str, str]:
    rc, _out, err = run(["train", "--config", "/dev/zero"], timeout=60, limit_gb=3)
    return classify(rc, err, "regular file"), err.strip().splitlines()[-1][
        :160
    ] if err.strip() else ""


@case("4 --config FIFO")
def _(tmp: Path) -> tuple[str, str]:
    os.mkfifo(tmp / "c.json")
    rc, _out, err = run(["train", "--config", str(tmp / "c.json")], timeout=30)
    return classify(rc, err, "FIFO"), err[-160:]


@case("4 --config deeply nested JSON")
def _(tmp: Path) -> tuple[str, str]:
    (tmp / "c.json").write_text("[" * 100000 + "]" * 100000)
    rc, _out, err = run(["train", "--config", str(tmp / "c.json")], timeout=60)
    return classify(rc, err, "nested"), err.strip().splitlines()[-1][:160] if err.strip() else ""


@case("4 dpfy report on a FIFO facts.json")
def _(tmp: Path) -> tuple[str, str]:
    (tmp / "r").mkdir()
    os.mkfifo(tmp / "r" / "facts.json")
    rc, _out, err = run(["report", str(tmp / "r")], timeout=30)
    return classify(rc, err, "FIFO"), err[-160:]


DISK_FULL = textwrap.dedent("""
    import errno, sys, torch
    def full(*a, **k):
        raise OSError(errno.ENOSPC, 'No space left on device')
    torch.save = full
    sys.argv = ['dpfy'] + ARGS
    from dpfy.cli.app import main
    main()
""")


@case("5 disk full at the first checkpoint")
def _(tmp: Path) -> tuple[str, str]:
    args = ["train", "--model", "logreg", "--epochs", "1", "--out", str(tmp / "r")]
    rc, _out, err = run(["-c", DISK_FULL.replace("ARGS", repr(args))])
    status = json.loads((tmp / "r" / "status.json").read_text()).get("status")
    kind = classify(rc, err, "cannot write")
    if kind == CLEAR and status != "failed":
        kind = LOST
    return kind, f"status {status}; " + (err.strip().splitlines() or [""])[-1][:120]


@case("5 audit --blocks 10**12")
def _(tmp: Path) -> tuple[str, str]:
    rc, _out, err = run(["audit", str(RUNS["finished"]), "--blocks", str(10**12)], timeout=120,
                       limit_gb=4)  # fmt: skip
    return classify(rc, err, "blocks"), (err.strip().splitlines() or [""])[-1][:160]


def finetune_case(tmp: Path, *extra: str, model: Path | None = None) -> tuple[int | None, str]:
    rc, out, err = run(["finetune", "--model-dir", str(model or RUNS["model"]), "--data-dir",
                        str(RUNS["rt"]), "--epochs", "1", "--batch-size", "40", "--limit", "80",
                        "--out", str(tmp / "r"), *extra], timeout=180)  # fmt: skip
    return rc, out + err


@case("5 finetune --max-length beyond the model's positions")
def _(tmp: Path) -> tuple[str, str]:
    rc, text = finetune_case(tmp, "--mode", "head", "--max-length", "4096")
    return (ACCEPT if rc == 0 else classify(rc, text, "max-length")), text.strip()[-160:]


@case("5 finetune: a non-JSON model config")
def _(tmp: Path) -> tuple[str, str]:
    m = copy(RUNS["model"], tmp / "m")
    (m / "config.json").write_text("{not json")
    rc, text = finetune_case(tmp, "--mode", "head", "--max-length", "8", model=m)
    return (ACCEPT if rc == 0 else classify(rc, text, "json")), text.strip()[-160:]


@case("5 finetune: truncated weights")
def _(tmp: Path) -> tuple[str, str]:
    m = copy(RUNS["model"], tmp / "m")
    w = next(p for p in m.iterdir() if p.suffix in (".safetensors", ".bin"))
    w.write_bytes(w.read_bytes()[:100])
    rc, text = finetune_case(tmp, "--mode", "head", "--max-length", "8", model=m)
    return (ACCEPT if rc == 0 else classify(rc, text, "weights")), text.strip()[-160:]


API = textwrap.dedent("""
    import torch, dpfy
    from torch import nn
    from torch.utils.data import TensorDataset
    net = nn.Linear(4, 2)
    FREEZE
    data = TensorDataset(torch.randn(64, 4), torch.arange(64) % 2)
    kw = dict(batch_size=8, epochs=1, target_epsilon=3.0, delta=1e-5, max_grad_norm=1.0)
    kw.update(OPTIONS)
    try:
        p = dpfy.make_private(net, torch.optim.SGD(net.parameters(), lr=0.1), data, **kw)
        x, y = next(iter(p.loader))
        p.optimizer.zero_grad(); nn.functional.cross_entropy(p.model(x), y).backward()
        p.optimizer.step()
        print('ACCEPTED', p.plan.accountant)
    except ValueError as err:
        print('error:', err)
""")


def api_case(options: dict, keyword: str, freeze: bool = False) -> Case:
    def check(tmp: Path) -> tuple[str, str]:
        code = API.replace("OPTIONS", repr(options)).replace(
            "FREEZE", "net.requires_grad_(False)" if freeze else ""
        )
        _rc, out, err = run(["-c", code])
        if "Traceback" in err:
            return TRACE, err.strip().splitlines()[-1][:160]
        if out.startswith("ACCEPTED"):
            return ACCEPT, out.strip()
        return (CLEAR if keyword.lower() in out.lower() else VAGUE), out.strip()[:160]

    return check


for _name, _options, _keyword in [
    ("5 API seed=1.5", {"seed": 1.5}, "seed"),
    ("5 API seed='abc'", {"seed": "abc"}, "seed"),
    ("7 API seed=-1", {"seed": -1}, "seed"),
    ("7 API accountant='gdp' (fixed-size)", {"accountant": "gdp", "sampler": "fixed-size"},
     "accountant"),
    ("7 API numeric strings (target_epsilon='3')", {"target_epsilon": "3"}, "number"),
    ("7 API numeric strings (delta='1e-5')", {"delta": "1e-5"}, "number"),
]:  # fmt: skip
    case(_name)(api_case(_options, _keyword))
case("7 API model with no trainable parameters")(api_case({}, "trainable", freeze=True))


def cli_case(args: list[str], keyword: str) -> Case:
    def check(tmp: Path) -> tuple[str, str]:
        rc, _out, err = run([*args, "--out", str(tmp / "r")] if args[0] == "train" else args)
        if rc in (0, 3):
            return ACCEPT, "exit 0: run trained"
        return classify(rc, err, keyword), err.strip()[-160:]

    return check


QUICK = ["train", "--model", "logreg", "--epochs", "0.3"]
for _name, _args, _keyword in [
    ("7 --max-user-examples without --unit user", [*QUICK, "--max-user-examples", "3"], "unit"),
    ("7 --label-mechanism with --access full", [*QUICK, "--label-mechanism", "rr-prior"],
     "label-mechanism"),
    ("7 --features-public with --access full", [*QUICK, "--features-public"], "features-public"),
    ("7 --features-public with --access input", [*QUICK, "--access", "input",
                                                  "--features-public"], "features-public"),
]:  # fmt: skip
    case(_name)(cli_case(_args, _keyword))


@case("7 finetune LoRA rank 100000 on a 16-wide model")
def _(tmp: Path) -> tuple[str, str]:
    rc, text = finetune_case(tmp, "--mode", "lora", "--lora-rank", "100000", "--max-length", "8")
    return (ACCEPT if rc == 0 else classify(rc, text, "rank")), text.strip()[-160:]


@case("7 audit --seed -1")
def _(tmp: Path) -> tuple[str, str]:
    r = copy(RUNS["finished"], tmp / "r")
    rc, _out, err = run(["audit", str(r), *AUDIT[:-2], "--seed", "-1"])
    return (ACCEPT if rc == 0 else classify(rc, err, "seed")), err.strip()[-160:]


@case("7 plan --target-epsilon 1e308")
def _(tmp: Path) -> tuple[str, str]:
    rc, _out, err = run(["plan", "--dataset-size", "1000", "--batch-size", "10", "--epochs", "1",
                        "--target-epsilon", "1e308", "--delta", "1e-5"])  # fmt: skip
    return classify(rc, err, "target"), err.strip()[-160:]


for _rows in (0, 1, 4):

    @case(f"7 adult CSV with {_rows} rows")
    def _(tmp: Path, rows: int = _rows) -> tuple[str, str]:
        header = ("age,workclass,fnlwgt,education,education-num,marital-status,occupation,"
                  "relationship,race,sex,capital-gain,capital-loss,hours-per-week,"
                  "native-country,income")  # fmt: skip
        (tmp / "a.csv").write_text(header + "\n" + "\n".join(adult_rows(rows, 0)) + "\n")
        rc, _out, err = run(["train", "--dataset", "adult", "--data-dir", str(tmp / "a.csv"),
                            "--out", str(tmp / "r")])  # fmt: skip
        return classify(rc, err, "supply at least"), err.strip()[-160:]


@case("7 --out of a running run")
def _(tmp: Path) -> tuple[str, str]:
    r = copy(RUNS["interrupted"], tmp / "r")
    status = json.loads((r / "status.json").read_text())
    status["status"] = "running"
    (r / "status.json").write_text(json.dumps(status))
    rc, _out, err = run(["train", "--out", str(r)])
    return classify(rc, err, "running"), err.strip()[-160:]


@case("6 SIGTERM during training")
def _(tmp: Path) -> tuple[str, str]:
    out = tmp / "r"
    process = subprocess.Popen([sys.executable, "-m", "dpfy", "train", "--model", "logreg",
                                "--epochs", "3", "--out", str(out)], env=ENV, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    while not (out / "checkpoint.pt").exists():
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    _, _err = process.communicate(timeout=120)
    status = json.loads((out / "status.json").read_text()).get("status")
    report = (out / "report.md").exists()
    detail = f"exit {process.returncode}, status {status}, report {report}"
    if status == "interrupted" and report:
        return CLEAR, detail
    return LOST, detail


@case("6 resume of a run killed on another host")
def _(tmp: Path) -> tuple[str, str]:
    r = copy(RUNS["interrupted"], tmp / "r")
    status = json.loads((r / "status.json").read_text())
    status.update(status="running", host="node-17", pid=4242)
    (r / "status.json").write_text(json.dumps(status))
    rc, _out, err = run(["train", "--resume", str(r)])
    kind = classify(rc, err, "--force")
    if kind == CLEAR:
        rc2, _, _err2 = run(["train", "--resume", str(r), "--force"])
        kind = CLEAR if rc2 in (0, 3) else VAGUE
    return kind, err.strip()[-160:]


@case("6 a failed resume keeps the run interrupted")
def _(tmp: Path) -> tuple[str, str]:
    # A checkpoint that passes the claim (intact, never resumed) but does not fit the run's
    # settings: the resume fails after it has marked the run running.
    r = copy(RUNS["interrupted"], tmp / "r")
    config = json.loads((r / "config.json").read_text())
    config["epochs"] = 4
    (r / "config.json").write_text(json.dumps(config))
    rc, _out, err = run(["train", "--resume", str(r)])
    status = json.loads((r / "status.json").read_text()).get("status")
    if status != "interrupted":
        return WRONG, f"status now {status}: " + err.strip()[-100:]
    return classify(rc, err), err.strip()[-160:]


@case("8 train --delta 0.5 --epochs 0.2 (time, peak RSS)")
def _(tmp: Path) -> tuple[str, str]:
    start = time.perf_counter()
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    rc, _out, _err = run(["train", "--delta", "0.5", "--epochs", "0.2", "--out", str(tmp / "r")],
                       timeout=300)  # fmt: skip
    seconds = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    detail = f"{seconds:.0f} s, peak RSS {max(rss, before) / 2**20:.2f} GB, exit {rc}"
    if rc is None:
        return HANG, detail
    return (CLEAR if seconds < 30 and rss < 2**20 else HANG), detail


RUNS: dict[str, Path] = {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", type=Path, help="source tree to run (PYTHONPATH first)")
    parser.add_argument("--only", help="run only cases whose name contains this")
    parser.add_argument("--json", type=Path, help="write the rows here")
    options = parser.parse_args()
    if options.src is not None:
        ENV["PYTHONPATH"] = str(options.src.resolve())
    ENV["DPFY_KEEP_FREED_MEMORY"] = "0"
    rows = []
    with tempfile.TemporaryDirectory() as root_name:
        root = Path(root_name)
        selected = [(n, c) for n, c in CASES if not options.only or options.only in n]
        if any(n.startswith(("3", "5 audit", "6", "7 audit", "7 --out")) for n, _ in selected):
            RUNS["finished"] = finished_run(root, "finished")
            RUNS["interrupted"] = interrupted_run(root, "interrupted")
        if any("finetune" in n for n, _ in selected):
            RUNS["model"], RUNS["rt"] = tiny_model(root / "model"), rt_data(root / "rt")
        for index, (name, check) in enumerate(selected):
            work = root / f"case-{index}"
            work.mkdir()
            try:
                kind, detail = check(work)
            except Exception as err:  # the harness itself failed: say so, count it apart
                kind, detail = "harness error", f"{type(err).__name__}: {err}"
            detail = " ".join(detail.split())
            rows.append({"case": name, "class": kind, "detail": detail})
            print(f"{kind:13} | {name} | {detail[:150]}", flush=True)
    counts = Counter(row["class"] for row in rows)
    print("counts:", dict(sorted(counts.items())))
    if options.json:
        options.json.write_text(json.dumps({"rows": rows, "counts": counts}, indent=2) + "\n")


if __name__ == "__main__":
    main()
