"""Strategies know no model: ``meshwise.parallel`` imports no ``meshwise.models``, and a user's own
(non-GPT) model gets recomputation, context parallelism's attention hook and tensor parallelism from its
own members and its own :class:`ParallelPlan`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import torch
from torch import Tensor, nn

import meshwise
from meshwise.parallel.plan import ParallelPlan, TensorParallelPlan
from meshwise.parallel.protocols import expert_layers, recomputable_blocks, split_attentions
from meshwise.parallel.recompute import apply_recompute
from meshwise.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from meshwise.runtime.spawn import spawn

PARALLEL = Path(meshwise.__file__).parent / "parallel"


def _imported_modules(source: str, package: str) -> list[str]:
    """Every module an ``import``/``from … import`` in ``source`` (a module of ``package``) names,
    relative imports resolved."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0]
                base = f"{parent}.{base}" if base else parent
            names += [base] + [f"{base}.{alias.name}" for alias in node.names]
    return names


def _package_of(path: Path) -> str:
    return ".".join(("meshwise", *path.relative_to(PARALLEL.parent).parent.parts))


def _is_model(name: str) -> bool:
    return name == "meshwise.models" or name.startswith("meshwise.models.")


def test_no_module_under_parallel_imports_a_model() -> None:
    files = sorted(PARALLEL.rglob("*.py"))
    assert len(files) > 30  # the walk found the package
    offenders = [
        f"{path.relative_to(PARALLEL)}: {name}"
        for path in files
        for name in _imported_modules(path.read_text(), _package_of(path))
        if _is_model(name)
    ]
    assert offenders == []


def test_the_import_walk_sees_every_spelling() -> None:
    """The check above can fail: each way of importing a model is caught."""
    for source in (
        "import meshwise.models.gpt",
        "from meshwise.models.moe import MixtureOfExperts",
        "from meshwise import models",
        "from ...models import gpt",
        "def f():\n    from meshwise.models import gpt_plan",
    ):
        assert any(map(_is_model, _imported_modules(source, "meshwise.parallel.zero"))), source
    sibling = _imported_modules("from ..plan import ParallelPlan", "meshwise.parallel.zero")
    assert sibling == ["meshwise.parallel.plan", "meshwise.parallel.plan.ParallelPlan"]


# --- a user's own model: a residual MLP stack, no attention class of ours, no GPT -------------------------


class Mixer(nn.Module):
    """A user's token mixer with a replaceable core (a SplitAttention by its members)."""

    run_core = None

    def __init__(self, width: int) -> None:
        super().__init__()
        self.dropout = 0.0
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        return self.core(q, k, v) if self.run_core is None else self.run_core(self.core, q, k, v)

    def core(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v


class Layer(nn.Module):
    """A user's residual layer (a RecomputableBlock by its members)."""

    run_body = None

    def __init__(self, width: int) -> None:
        super().__init__()
        self.mix = Mixer(width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        return self.body(x) if self.run_body is None else self.run_body(self.body, x)

    def body(self, x: Tensor) -> Tensor:
        self.calls += 1
        x = x + self.mix(x)
        return x + self.down(torch.relu(self.up(x)))


class UserModel(nn.Module):
    def __init__(self, width: int = 8, layers: int = 2) -> None:
        super().__init__()
        self.stack = nn.ModuleList(Layer(width) for _ in range(layers))

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.stack:
            x = layer(x)
        return x


def _tensor_parallel(model: nn.Module, comm, sequence_parallel: bool) -> nn.Module:
    for layer in model.stack:  # type: ignore[union-attr]
        layer.up = ColumnParallelLinear.from_linear(layer.up, comm)
        layer.down = RowParallelLinear.from_linear(layer.down, comm)
    return model


def _mean_square(output: Tensor, targets: Tensor) -> Tensor:
    return (output - targets).square().mean()


USER_PLAN = ParallelPlan(
    layers="stack",
    first=(),
    last=(),
    enter=lambda model, x: x,
    leave=lambda model, x: x,
    loss=_mean_square,
    activation_shape=lambda shape: shape,
    tensor_parallel=TensorParallelPlan(
        convert=_tensor_parallel,
        loss=lambda output, targets, comm, reduction: _mean_square(output, targets),
        check=lambda tp, sp, seq: None,
    ),
)


def _model() -> UserModel:
    torch.manual_seed(0)
    return UserModel()


def _gradients(model: nn.Module, x: Tensor) -> dict[str, Tensor]:
    model.zero_grad()
    model(x).square().sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def test_the_strategies_find_a_user_models_parts_by_their_members() -> None:
    model = _model()
    assert recomputable_blocks(model) == list(model.stack)
    assert split_attentions(model) == [layer.mix for layer in model.stack]
    assert expert_layers(model) == []
    assert USER_PLAN.layer_modules(model) == list(model.stack)


def test_a_user_model_recomputes_exactly() -> None:
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(1))
    plain, full, selective = _model(), _model(), _model()
    apply_recompute(recomputable_blocks(full), "full")
    apply_recompute(recomputable_blocks(selective), "selective")
    assert all(layer.mix.run_core is not None for layer in selective.stack)
    expected = _gradients(plain, x)
    for model in (full, selective):
        got = _gradients(model, x)
        for name, grad in expected.items():  # the same ops in the same order: bit for bit
            assert torch.equal(got[name], grad), name
    assert [layer.calls for layer in full.stack] == [2, 2]  # the body ran again in backward
    assert [layer.calls for layer in plain.stack] == [1, 1]
    apply_recompute(recomputable_blocks(full), "none")
    assert all(layer.run_body is None for layer in full.stack)


def _input() -> Tensor:
    return torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(2))


def _tensor_parallel_rank() -> dict[str, list]:
    world = meshwise.init("gloo", device="cpu", timeout=60)
    try:
        model = USER_PLAN.tensor_parallel.convert(_model(), world.comm, False)  # type: ignore[union-attr]
        output = model(_input())
        output.square().sum().backward()
        # plain lists: a tensor would travel as shared memory that dies with the rank
        return {"output": output.detach().tolist(), "mix.q": model.stack[0].mix.q.weight.grad.tolist()}
    finally:
        meshwise.shutdown()


def test_a_user_model_is_tensor_parallel_through_its_own_plan() -> None:
    reference = _model()
    output = reference(_input())
    output.square().sum().backward()
    expected = {"output": output.detach(), "mix.q": reference.stack[0].mix.q.weight.grad}
    for rank in spawn(_tensor_parallel_rank, 2, timeout=100):
        for name, value in expected.items():
            # fp32, the row-parallel sum of two halves in another order: a few ulps of values of order 10
            torch.testing.assert_close(torch.tensor(rank[name]), value, rtol=1e-5, atol=1e-5)
