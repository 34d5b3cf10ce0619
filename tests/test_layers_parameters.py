"""Parameters used directly in a module's forward: 0-d ones, and the ViT layout with dropout."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from tests.layer_reference import reference, relative_error
from torch import Tensor, nn

from dpfy.train.grads import make_engine


@pytest.fixture(autouse=True, scope="module")
def _float64_by_default():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


class Pinned:
    """Records every dropout's mask in one batched forward, then pins them for single examples.

    The masks are read back from what each dropout did (output / input), so the reference loop
    runs each example through the very dropout draws of the batched pass the engine clipped.
    """

    def __init__(self, model: nn.Module) -> None:
        self.dropouts = [m for m in model.modules() if isinstance(m, nn.Dropout)]
        self.masks: dict[int, list[Tensor]] = {id(m): [] for m in self.dropouts}
        self.example: int | None = None
        self.calls: dict[int, int] = {}
        self.handles = [m.register_forward_hook(self._hook) for m in self.dropouts]

    def _hook(self, module: nn.Module, args: tuple, output: Tensor) -> Tensor | None:
        x = args[0]
        if self.example is None:  # the batched pass: read the mask off
            mask = torch.where(x != 0, output / torch.where(x != 0, x, 1), 0).detach()
            self.masks[id(module)].append(mask)
            return None
        k = self.calls.get(id(module), 0)
        self.calls[id(module)] = k + 1
        mask = self.masks[id(module)][k]
        return x * mask[self.example : self.example + 1]

    def alone(self, i: int, run: Callable[[], Tensor]) -> Tensor:
        """Run example ``i`` with its masks from the batched pass."""
        self.example, self.calls = i, {}
        try:
            return run()
        finally:
            self.example = None

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def assert_exact_with_dropout(
    model: nn.Module,
    batch_loss: Callable[[], Tensor],
    example_loss: Callable[[int], Tensor],
    n: int,
    *,
    reduction: str = "mean",
    dropout: bool = True,
) -> float:
    """Engine (train mode) against the loop on the same dropout draws; returns the error.

    The engine runs twice on the same random draws: unclipped first, to set C at half the
    median norm (some examples clipped, some not), then at that C.
    """

    def run(clip: float, pin: bool) -> tuple[dict[str, Tensor], Tensor, Pinned | None]:
        engine = make_engine(model)
        pinned = Pinned(model) if pin else None  # after the engine: sees what its dropouts did
        try:
            torch.manual_seed(99)
            batch_loss().backward()
            result = engine.clip_and_accumulate(clip, reduction)
            return engine.summed_grads(), result.norms, pinned
        finally:
            engine.detach()

    _, free, _ = run(1e30, pin=False)
    clip = 0.5 * float(free.median())
    got, norms, pinned = run(clip, pin=True)
    assert pinned is not None
    try:
        want, want_norms = reference(
            model, lambda i: pinned.alone(i, lambda: example_loss(i)), n, clip
        )
    finally:
        pinned.remove()
    if dropout:  # the draws did drop something, and every example saw its own
        assert any(mask.eq(0).any() for masks in pinned.masks.values() for mask in masks)
    torch.testing.assert_close(norms, want_norms, rtol=1e-7, atol=1e-9)
    error = relative_error(got, want)
    assert error < 1e-7, error
    return error


class Temperature(nn.Module):
    """A classifier with a learned 0-d temperature."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 3)
        self.temperature = nn.Parameter(torch.tensor(1.7))

    def forward(self, x: Tensor) -> Tensor:
        return self.layer(x) / self.temperature


def test_zero_dimensional_parameter_matches_a_per_example_loop():
    torch.manual_seed(0)
    model = Temperature()
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))

    def losses() -> Tensor:
        return F.cross_entropy(model(x), y, reduction="none")

    error = assert_exact_with_dropout(
        model,
        lambda: losses().mean(),
        lambda i: F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]),
        6,
        dropout=False,
    )
    assert error < 1e-7


class RootOwnedViT(nn.Module):
    """timm's layout: the root owns cls_token and pos_embed, then dropout, blocks, a head."""

    def __init__(self, functional_dropout: bool = False) -> None:
        super().__init__()
        self.patch = nn.Linear(4, 6)
        self.cls_token = nn.Parameter(torch.randn(1, 1, 6))
        self.pos_embed = nn.Parameter(torch.randn(1, 5, 6) * 0.5)
        self.pos_drop = nn.Dropout(0.3)
        self.block = nn.Sequential(nn.LayerNorm(6), nn.Linear(6, 6), nn.GELU(), nn.Dropout(0.3))
        self.head = nn.Linear(6, 3)
        self.functional_dropout = functional_dropout

    def forward(self, patches: Tensor) -> Tensor:  # (B, 4 patches, 4)
        x = self.patch(patches)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], 1)
        if self.functional_dropout:
            x = F.dropout(x + self.pos_embed, 0.3, self.training)
        else:
            x = self.pos_drop(x + self.pos_embed)
        x = x + self.block(x)
        return self.head(x[:, 0])


def test_root_owned_position_embedding_with_dropout_in_training_matches_the_loop():
    torch.manual_seed(1)
    model = RootOwnedViT().train()
    x, y = torch.randn(6, 4, 4), torch.randint(0, 3, (6,))
    assert_exact_with_dropout(
        model,
        lambda: F.cross_entropy(model(x), y),
        lambda i: F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]),
        6,
    )


def test_functional_dropout_in_a_replayed_forward_is_refused_naming_the_layer():
    model = RootOwnedViT(functional_dropout=True).train()
    engine = make_engine(model)
    F.cross_entropy(model(torch.randn(3, 4, 4)), torch.tensor([0, 1, 2])).backward()
    with pytest.raises(RuntimeError, match=r"layer '' \(RootOwnedViT\) draws random numbers"):
        engine.clip_and_accumulate(1.0)
    assert engine.num_examples == 0
    engine.detach()


def test_dropouts_behave_as_before_once_the_engine_is_detached():
    torch.manual_seed(2)
    model = RootOwnedViT().train()
    x = torch.randn(4, 4, 4)
    engine = make_engine(model)
    engine.detach()
    torch.manual_seed(3)
    first = model(x)
    torch.manual_seed(3)
    assert torch.equal(model(x), first)
    assert not model.pos_drop._forward_hooks and not model.pos_drop._forward_pre_hooks


def test_hugging_face_vit_for_image_classification_default_call_in_training_matches_the_loop():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(4)
    config = transformers.ViTConfig(
        image_size=8,
        patch_size=4,
        num_channels=3,
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=16,
        num_labels=3,
        hidden_dropout_prob=0.3,
        attention_probs_dropout_prob=0.0,  # drawn inside attention's kernel: not pinnable here
    )
    model = transformers.ViTForImageClassification(config).to(torch.float64).train()
    x, y = torch.randn(5, 3, 8, 8), torch.randint(0, 3, (5,))
    assert_exact_with_dropout(
        model,
        lambda: model(pixel_values=x, labels=y).loss,
        lambda i: model(pixel_values=x[i : i + 1], labels=y[i : i + 1]).loss,
        5,
    )
