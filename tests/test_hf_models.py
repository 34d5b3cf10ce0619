"""Both engines on Hugging Face models, called as users call them, against a per-example loop.

Tiny BERT and GPT-2 models are built from configs (nothing is downloaded). Each model is called
the default way (``model(input_ids=..., labels=...)``: BERT's position and token-type ids of shape
(1, T), GPT-2's ``Conv1D`` projections, tied input and output embeddings), and the clipped sum of
one batch of 4, with C between the per-example norms, is compared with one computed from each
example's own backward pass (clip, sum).
"""

from __future__ import annotations

import contextlib
import math
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset

pytest.importorskip("transformers")

from transformers import (
    BertConfig,
    BertForMaskedLM,
    BertForSequenceClassification,
    BertModel,
    GPT2Config,
    GPT2LMHeadModel,
)
from transformers.pytorch_utils import Conv1D

import dpfy
from dpfy.data.loader import rest_of_run
from dpfy.train.grads import find_rule, make_engine

VOCAB, POSITIONS, BATCH, CLASSES = 40, 6, 4, 3
#: fp32: the engines and the loop round differently (batched vs single-example kernels), by
#: about 1e-7 relative; a wrong norm or a lost term moves the sum by far more.
RTOL = 1e-5


def bert_config(**extra: object) -> BertConfig:
    """A two-layer BERT of width 16, without dropout (the comparison needs one function)."""
    return BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=24, max_position_embeddings=16, type_vocab_size=2,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **extra,
    )  # fmt: skip


def gpt2_config() -> GPT2Config:
    """A two-layer GPT-2 of width 16, without dropout."""
    return GPT2Config(
        vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=16, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip


class BertWithHead(nn.Module):
    """``AutoModel``-style use: a bare BertModel and a linear head on the first token."""

    def __init__(self) -> None:
        super().__init__()
        self.bert = BertModel(bert_config())
        self.head = nn.Linear(16, CLASSES)

    def forward(self, input_ids: Tensor, labels: Tensor) -> Tensor:
        hidden = self.bert(input_ids=input_ids).last_hidden_state
        return nn.functional.cross_entropy(self.head(hidden[:, 0]), labels)


def lora_bert() -> nn.Module:
    """PEFT LoRA (rank 4) on BERT's query and value projections, classifier trained too."""
    peft = pytest.importorskip("peft")
    base = BertForSequenceClassification(bert_config(num_labels=CLASSES))
    config = peft.LoraConfig(
        task_type="SEQ_CLS", r=4, lora_alpha=8, target_modules=["query", "value"], lora_dropout=0.0
    )
    return peft.get_peft_model(base, config)


#: family → (builder, base model attribute, blocks attribute, labels per example or per token)
FAMILIES: dict[str, tuple[Callable[[], nn.Module], str, str, bool]] = {
    "bert+head": (BertWithHead, "bert", "encoder.layer", False),
    "bert-seq-cls": (
        lambda: BertForSequenceClassification(bert_config(num_labels=CLASSES)),
        "bert",
        "encoder.layer",
        False,
    ),
    "bert-mlm": (lambda: BertForMaskedLM(bert_config()), "bert", "encoder.layer", True),
    "gpt2-lm": (lambda: GPT2LMHeadModel(gpt2_config()), "transformer", "h", True),
}


def model_of(family: str, trainable: str) -> nn.Module:
    """A seeded model of ``family`` with ``trainable`` parameters: "full", "last" or "frozen".

    "frozen": the pretrained body frozen, the head trained (for BERT-MLM and GPT-2 the head's
    decoder is tied to the word embeddings, so those train too); "last": the last block as well.
    """
    torch.manual_seed(0)
    build, body, blocks, _ = FAMILIES[family]
    model = build()
    if trainable != "full":
        base = getattr(model, body)
        base.requires_grad_(False)
        for name, child in model.named_children():
            if name != body:
                child.requires_grad_(True)
        if trainable == "last":
            base.get_submodule(blocks)[-1].requires_grad_(True)
            if hasattr(base, "ln_f"):
                base.ln_f.requires_grad_(True)
    return model


def batch_of(family: str, n: int = BATCH, seed: int = 1) -> dict[str, Tensor]:
    """Token ids and labels (a class per example, or the tokens themselves for LM heads)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (n, POSITIONS), generator=generator)
    if family in FAMILIES and FAMILIES[family][3]:
        return {"input_ids": ids, "labels": ids.clone()}
    return {"input_ids": ids, "labels": torch.randint(0, CLASSES, (n,), generator=generator)}


def loss_of(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """The model's own mean loss, called the default way."""
    out = model(**batch)
    return out if isinstance(out, Tensor) else out.loss


def trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    """Trainable parameters by the name the engines use (tied ones once)."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


Context = Callable[[], contextlib.AbstractContextManager]


def reference(
    model: nn.Module,
    batch: dict[str, Tensor],
    clip: float,
    context: Context = contextlib.nullcontext,
) -> tuple[dict[str, Tensor], Tensor]:
    """Clipped sum (float64) and norms from each example's own backward pass (in ``context``)."""
    params = trainable(model)
    grads = []
    for i in range(batch["input_ids"].shape[0]):
        model.zero_grad(set_to_none=True)
        with context():
            loss = loss_of(model, {k: v[i : i + 1] for k, v in batch.items()})
        loss.backward()
        grads.append(
            {
                n: torch.zeros_like(p) if p.grad is None else p.grad.double()
                for n, p in params.items()
            }
        )
    model.zero_grad(set_to_none=True)
    norms = torch.stack(
        [torch.sqrt(sum(g.double().square().sum() for g in d.values())) for d in grads]
    )
    total = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in params.items()}
    for example, norm in zip(grads, norms, strict=True):
        factor = min(1.0, clip / float(norm))
        for n in params:
            total[n] += factor * example[n].double()
    return total, norms


def engine_sum(
    model: nn.Module,
    batch: dict[str, Tensor],
    clip: float,
    kind: str,
    context: Context = contextlib.nullcontext,
) -> tuple[dict[str, Tensor], Tensor]:
    """One default-call forward (in ``context``) and backward with an engine attached."""
    engine = make_engine(model, kind)
    try:
        with context():
            loss = loss_of(model, batch)
        loss.backward()
        norms = engine.clip_and_accumulate(clip, "mean").norms
        return engine.summed_grads(), norms
    finally:
        engine.detach()


def relative_error(got: dict[str, Tensor], expected: dict[str, Tensor]) -> float:
    """‖got − expected‖ / ‖expected‖ over all parameters together."""
    assert got.keys() == expected.keys()
    gap = sum(float((got[n].double() - expected[n]).square().sum()) for n in expected)
    size = sum(float(expected[n].square().sum()) for n in expected)
    return math.sqrt(gap / size)


def assert_exact(
    model: nn.Module,
    batch: dict[str, Tensor],
    kinds: tuple[str, ...],
    rtol: float = RTOL,
    context: Context = contextlib.nullcontext,
) -> None:
    """Each engine's clipped sum and norms match the loop's, C between the examples' norms."""
    _, free = reference(model, batch, math.inf, context)
    clip = float(free.median())
    assert float(free.min()) < clip < float(free.max())  # some clipped, some not
    expected, norms = reference(model, batch, clip, context)
    for kind in kinds:
        got, got_norms = engine_sum(model, batch, clip, kind, context)
        assert relative_error(got, expected) <= rtol, kind
        torch.testing.assert_close(got_norms.double(), norms, rtol=rtol, atol=0.0)


@pytest.mark.parametrize("trainable_part", ["frozen", "last", "full"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_clipped_sum_matches_a_per_example_loop(family: str, trainable_part: str) -> None:
    model = model_of(family, trainable_part)
    assert_exact(model, batch_of(family), ("fast", "vmap"))


def test_lora_on_bert_matches_a_per_example_loop() -> None:
    torch.manual_seed(0)
    model = lora_bert()
    assert_exact(model, batch_of("lora"), ("fast", "vmap"))


@pytest.mark.parametrize("family", [*FAMILIES, "lora"])
def test_auto_picks_the_fast_engine(family: str) -> None:
    torch.manual_seed(0)
    model = lora_bert() if family == "lora" else model_of(family, "full")
    engine = make_engine(model)
    assert engine.kind == "fast" and engine.fallback_reason is None
    engine.detach()


def test_tied_embeddings_are_clipped_by_the_norm_of_their_summed_gradient(monkeypatch) -> None:
    """Leaving out the inner product of the two uses' gradients is caught by the comparison."""
    model = model_of("gpt2-lm", "frozen")  # only lm_head = wte trains: the tied weight alone
    batch = batch_of("gpt2-lm")
    _, free = reference(model, batch, math.inf)
    clip = float(free.median())
    _, norms = reference(model, batch, clip)
    _, joint = engine_sum(model, batch, clip, "fast")
    torch.testing.assert_close(joint.double(), norms, rtol=RTOL, atol=0.0)
    monkeypatch.setattr("dpfy.train.grads.fast.cross_inner_products", lambda *pair: 0.0)
    _, separate = engine_sum(model, batch, clip, "fast")
    assert float((separate.double() - norms).abs().max() / norms.max()) > 100 * RTOL


def test_conv1d_has_a_fast_rule_and_only_the_real_class_gets_it() -> None:
    assert find_rule(Conv1D(4, 3)) is not None

    class Impostor(Conv1D):
        def forward(self, x: Tensor) -> Tensor:  # its own forward: no rule
            return x

    namesake = type("Conv1D", (nn.Module,), {"__module__": "transformers.pytorch_utils"})
    assert find_rule(Impostor(4, 3)) is None
    assert find_rule(namesake()) is None


class Conv1DStack(nn.Module):
    """Two ``Conv1D`` layers (in 6 → 8 → 2): wide enough for the ghost route at T = 4, and not."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = Conv1D(8, 6), Conv1D(2, 8)

    def forward(self, input_ids: Tensor, labels: Tensor) -> Tensor:
        out = self.second(torch.tanh(self.first(input_ids)))
        return (out - labels).square().flatten(1).sum(1).mean()


@pytest.mark.parametrize("bias", ["trained", "frozen"])
@pytest.mark.parametrize("positions", [None, 1, 4])
def test_conv1d_layers_match_a_per_example_loop(positions: int | None, bias: str) -> None:
    """Conv1D's transposed weight on every route: one position (rank one), direct and ghost."""
    torch.manual_seed(3)
    model = Conv1DStack()
    if bias == "frozen":
        model.first.bias.requires_grad_(False)
    shape = (BATCH,) if positions is None else (BATCH, positions)
    batch = {"input_ids": torch.randn(*shape, 6), "labels": torch.randn(*shape, 2)}
    assert_exact(model, batch, ("fast", "vmap"))


def test_importing_dpfy_does_not_import_transformers() -> None:
    code = "import sys, dpfy, dpfy.train.grads; sys.exit('transformers' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_a_private_step_runs_on_gpt2_called_the_default_way() -> None:
    """make_private on the fast engine, the user's call unchanged: parameters move by the step."""
    model = model_of("gpt2-lm", "last")
    ids = batch_of("gpt2-lm", n=32)["input_ids"]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    private = dpfy.make_private(
        model, optimizer, TensorDataset(ids), batch_size=8, steps=2, noise_multiplier=1.0,
        delta=1e-5, max_grad_norm=1.0, seed=0,
    )  # fmt: skip
    assert private.optimizer.engine.kind == "fast"
    before = model.lm_head.weight.detach().clone()
    taken = 0
    for (x,) in rest_of_run(private.loader):
        private.optimizer.zero_grad()
        if len(x):  # Hugging Face attention cannot run an empty batch; the step is noise only
            private.model(input_ids=x, labels=x).loss.backward()
        private.optimizer.step()
        taken += 1
    assert taken == 2 and private.ledger.steps == 2
    assert not torch.equal(before, model.lm_head.weight)
