"""dpfy.hf.DPTrainer: the Hugging Face Trainer's loop, every optimizer step dpfy's private step.

Tiny GPT-2 and BERT built from config (nothing downloaded). The Trainer's gradient
accumulation is exact (k pieces = one whole-batch step), the run is the planned steps, LoRA
trains only its adapters, bf16 autocast runs, and the report card is written.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import Dataset

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("dpfy.hf")


class NoNoise:
    """Adds nothing: the update is the clipped average alone (tests only)."""

    def normal(self, like: torch.Tensor, std: float) -> torch.Tensor:
        return torch.zeros_like(like)


class Tokens(Dataset):
    """Random token sequences; labels the inputs (causal LM) or a class."""

    def __init__(self, n: int = 48, length: int = 8, vocab: int = 40, classes: int = 0) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, vocab, (n, length), generator=generator)
        self.classes = classes
        self.labels = torch.randint(0, max(classes, 1), (n,), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        label = self.labels[i] if self.classes else self.ids[i]
        return {"input_ids": self.ids[i], "labels": label}


def gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=40, n_positions=16, n_embd=16, n_layer=1, n_head=2, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def bert() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16, num_labels=3, pad_token_id=0,
    )  # fmt: skip
    return transformers.BertForSequenceClassification(config)


def arguments(tmp_path, accumulation: int = 2, **options) -> transformers.TrainingArguments:
    settings = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=8 // accumulation,
        gradient_accumulation_steps=accumulation, num_train_epochs=1, learning_rate=0.05,
        report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
    )  # fmt: skip
    settings.update(options)
    return transformers.TrainingArguments(**settings)


def trainer(model, args, data=None, **options) -> hf.DPTrainer:
    settings = dict(delta=1e-5, max_grad_norm=1.0, noise_multiplier=1.0)
    settings.update(options)
    private_options = {"seed": 3, **settings.pop("private_options", {})}
    return hf.DPTrainer(
        model, args, data if data is not None else Tokens(), private_options=private_options,
        optimizer_cls=torch.optim.SGD, **settings,
    )  # fmt: skip


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten().float() for p in model.parameters()])


def test_gradient_accumulation_in_the_trainer_takes_the_whole_batch_step(tmp_path):
    # Same seed, same Poisson batches: 4 pieces per batch or 1 give one and the same update.
    runs = {}
    for k in (1, 4):
        run = trainer(gpt2(), arguments(tmp_path / str(k), accumulation=k))
        run.private.optimizer.noise = NoNoise()
        run.train()
        runs[k] = run
    assert runs[1].private.ledger.steps == runs[4].private.ledger.steps == 6  # N/B = 48/8
    torch.testing.assert_close(
        flat(runs[4].private.model), flat(runs[1].private.model), rtol=1e-4, atol=1e-6
    )
    assert not torch.equal(flat(runs[1].private.model), flat(gpt2()))  # it trained
    assert runs[4].epsilon() == runs[1].epsilon() > 0


def test_the_trainer_runs_the_planned_steps_and_writes_the_report_card(tmp_path):
    run = trainer(bert(), arguments(tmp_path, bf16=True), Tokens(classes=3))
    run.train()
    assert run.state.global_step == run.private.plan.steps == run.private.ledger.steps
    report = tmp_path / "privacy-report"
    assert (report / "report.md").exists() and (report / "facts.json").exists()
    assert "ε" in (report / "report.md").read_text()


def test_lora_under_bf16_trains_only_the_adapters(tmp_path):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn"], fan_in_fan_out=True)
    model = peft.get_peft_model(gpt2(), config)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    run = trainer(model, arguments(tmp_path, bf16=True))  # the docs' DP-LoRA recipe, tiny
    run.train()
    after = dict(model.named_parameters())
    assert all(torch.equal(after[n], v) for n, v in frozen.items())
    assert any(not torch.equal(after[n], v) for n, v in adapters.items())
    assert run.private.ledger.steps == run.private.plan.steps


def test_a_trainer_checkpoint_resume_and_max_steps_are_refused(tmp_path):
    with pytest.raises(ValueError, match="num_train_epochs"):
        trainer(gpt2(), arguments(tmp_path, max_steps=3))
    run = trainer(gpt2(), arguments(tmp_path))
    with pytest.raises(ValueError, match="no privacy ledger"):
        run.train(resume_from_checkpoint=str(tmp_path))
    assert run.private.ledger.steps == 0


def test_a_launch_of_several_processes_is_refused(tmp_path, monkeypatch):
    # The Trainer would wrap the model in DDP; one private run per process is not one ledger.
    monkeypatch.setattr(transformers.TrainingArguments, "world_size", property(lambda self: 2))
    with pytest.raises(ValueError, match="one process"):
        trainer(gpt2(), arguments(tmp_path))


def test_empty_pieces_of_a_small_poisson_batch_are_steps_all_the_same(tmp_path):
    # B = 4 cut into 4 pieces: most pieces hold 0 or 1 example, and some batches none at all.
    args = arguments(tmp_path, accumulation=4, per_device_train_batch_size=1)
    run = trainer(gpt2(), args, Tokens(n=24))
    sizes = [len(piece["input_ids"]) for piece in run.get_train_dataloader()]
    assert 0 in sizes
    run = trainer(gpt2(), args, Tokens(n=24))
    run.train()
    assert run.private.ledger.steps == run.private.plan.steps == 6


@pytest.mark.parametrize(
    ("args_options", "options", "named"),
    [
        ({"label_smoothing_factor": 0.1}, {}, "label_smoothing_factor"),
        ({}, {"compute_loss_func": lambda outputs, labels, **kw: outputs.loss}, "compute_loss"),
        ({}, {"private_options": {"max_physical_batch_size": 2}}, "max_physical_batch_size"),
    ],
    ids=["label-smoothing", "custom-loss", "chunking"],
)
def test_trainer_settings_that_couple_examples_or_recount_steps_are_refused(
    tmp_path, args_options, options, named
):
    # Label smoothing divides by the piece's token count: each example's gradient would depend
    # on the others' lengths. A whole-piece loss escapes the checks; dpfy's chunking inside the
    # Trainer's pieces would count a step per chunk.
    with pytest.raises(ValueError, match=named):
        trainer(gpt2(), arguments(tmp_path, **args_options), **options)
