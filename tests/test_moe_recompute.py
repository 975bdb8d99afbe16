"""``meshwise train gpt --experts --recompute full|selective``: the real trainer on gpt-moe-tiny (one
process, ep2, pp2, ep2·pp2) gives the same losses, parameters and router reports with every recompute mode.

Equality is exact (``np.array_equal``, ``==``), not within a tolerance: recomputation changes which
tensors backward reads, never their values — the recomputed forward runs the same operations on the same
inputs and parameters, with the same dropout masks (dropout 0.1 where allowed) and, under ep, the same
all-to-alls, so every saved tensor is bit-identical to its twin and backward does the same arithmetic.
A router counted twice would show in the reports (doubled token and drop counts), an auxiliary loss
entering the gradient twice in the parameters (coefficients 0.01 and 0.001 are on). A capacity factor of
1.0 makes the router drop assignments, so the dropped counts are compared too.
"""

from __future__ import annotations

import os
from dataclasses import asdict

import numpy as np
import pytest
import torch

import meshwise
from meshwise.parallel.recompute.region import recomputed, replay_aware
from meshwise.runtime.spawn import spawn
from meshwise.train.gpt import GPTTrainConfig
from meshwise.train.gpt.loop import GPTTrainer
from meshwise.train.gpt.moe import router_report
from meshwise.train.gpt.resolve import resolve

STEPS = 3
MODES = ("none", "full", "selective")


def _run_modes(text: str, flags: dict) -> dict[str, dict]:
    """Each recompute mode's trainer from the same seed, one after the other in this rank's world: its
    losses, router reports and held parameters after every step."""
    ranks = int(os.environ["WORLD_SIZE"])
    runs: dict[str, dict] = {}
    world = None
    for mode in MODES:
        config = GPTTrainConfig.from_flags(
            nproc=ranks, config="gpt-moe-tiny", layers=2, data=text, seq_len=16, global_batch=8,
            micro_batch=2, steps=20, warmup=1, lr=1e-3, capacity_factor=1.0, recompute=mode,
            backend="gloo", **flags,
        )  # fmt: skip
        if world is None:
            world = meshwise.init("gloo", timeout=90, mesh=config.mesh_shape(ranks))
        trainer = GPTTrainer(world, resolve(config))
        run: dict[str, list] = {"losses": [], "reports": [], "params": []}
        for step in range(STEPS):
            run["losses"].append(trainer.train_step(step).loss)
            report = router_report(trainer.step_runner.model, trainer.mesh, trainer.model_config.layers)
            assert report is not None
            run["reports"].append(asdict(report))
            held = trainer.step_runner.placements.items()
            run["params"].append({name: param.detach().numpy().copy() for name, (param, _) in held})
        runs[mode] = run
    meshwise.shutdown()
    return runs


def _check_equal(runs: dict[str, dict]) -> None:
    base = runs["none"]
    assert any(report["dropped"] > 0 for report in base["reports"])  # the capacity drops: compared too
    for mode in MODES[1:]:
        run = runs[mode]
        assert run["losses"] == base["losses"], mode
        assert run["reports"] == base["reports"], mode
        for step, (ours, theirs) in enumerate(zip(run["params"], base["params"], strict=True)):
            assert ours.keys() == theirs.keys()
            unequal = [name for name in ours if not np.array_equal(ours[name], theirs[name])]
            assert not unequal, (mode, step, unequal)


#: row name → (ranks, flags); pp2: a stage's MoE layers add their auxiliary gradient in their own backward
LAYOUTS: dict[str, tuple[int, dict]] = {
    "one process": (1, {"dropout": 0.1}),
    "ep2": (2, {"ep": 2, "dropout": 0.1}),
    "pp2": (2, {"pp": 2, "dropout": 0.1}),
    "ep2·pp2": (4, {"ep": 2, "pp": 2}),  # the all-to-alls of a stage's recomputation, under 1F1B
}


@pytest.mark.parametrize(("ranks", "flags"), LAYOUTS.values(), ids=LAYOUTS.keys())
def test_moe_recompute_trains_exactly_as_without(text: str, ranks: int, flags: dict) -> None:
    results = spawn(_run_modes, ranks, args=(text, flags), timeout=110)
    for runs in results:
        _check_equal(runs)


class _Counting(torch.nn.Module):
    """Records the ``recomputing`` flag of each of its forwards."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.recomputing = False
        self.seen: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(self.recomputing)
        return self.linear(x).tanh()


def test_a_recomputed_region_flags_its_second_run_and_restores_the_flag() -> None:
    inner = _Counting()
    outer = torch.nn.Sequential(inner)
    x = torch.randn(3, 4, requires_grad=True)
    recomputed(outer, x, owners=[outer]).sum().backward()
    assert inner.seen == [False, True] and inner.recomputing is False
    assert replay_aware([outer, inner]) == [inner]  # each flagged module once, found under its owners
