"""The layout matrix: every way ``meshwise train gpt`` composes dp, ZeRO, tp (+sp) and pp on 4 ranks
trains gpt-tiny exactly as one process does, step by step.

Each row spawns 4 ranks that run the real trainer on the row's mesh and, beside it, a one-process
reference written here from plain pieces (the whole global batch, the same AdamW groups, schedule and
clipping), and compares the global-batch loss and every parameter of the plain model after each step
(gathered as ``--sample`` gathers it: on every rank, or on rank 0 for a pipeline).

Tolerances (fp32): the loss to 2e-5, the parameters to 5e-5 at lr 1e-3 — 5 % of one Adam update.
Adam divides each gradient by its own magnitude, so where per-token contributions nearly cancel, the
summation order of a layout (shards summed by an all-reduce, micro-batches accumulated) shows up in that
coordinate's first update; a layout that is wrong (a missing sum over tp, a tied copy counted twice in
the clip, a shard applied to the wrong rows) is off by a whole update or more.
"""

from __future__ import annotations

import os

import pytest
import torch

import meshwise
from gpt_reference import RESUME_AT, assert_resumed, reference_step, resume_run
from meshwise.data.windows import train_batch
from meshwise.models.gpt import GPT, language_model_loss
from meshwise.runtime.spawn import spawn
from meshwise.train.gpt import GPTTrainConfig
from meshwise.train.gpt.loop import GPTTrainer
from meshwise.train.gpt.parallelize import build_optimizer
from meshwise.train.gpt.resolve import resolve

STEPS = 3
LOSS_TOLERANCE = 2e-5
PARAM_TOLERANCE = 5e-5

#: row name → the flags of `meshwise train gpt` on 4 ranks
LAYOUTS: dict[str, dict] = {
    "dp4": {},
    "tp4": {"tp": 4},
    "pp4": {"pp": 4},
    "dp2·tp2": {"tp": 2},
    "dp2·pp2": {"pp": 2},
    "tp2·pp2": {"tp": 2, "pp": 2},
    "zero3×4": {"zero": 3},
    "zero3·tp2": {"zero": 3, "tp": 2},
    "zero1·tp2·sp": {"zero": 1, "tp": 2, "sp": True},
    "pp2·tp2 interleaved": {"pp": 2, "tp": 2, "schedule": "interleaved", "virtual_stages": 2},
    "zero2·pp2": {"zero": 2, "pp": 2},
    "zero1·pp2 interleaved": {"zero": 1, "pp": 2, "schedule": "interleaved", "virtual_stages": 2},
    "dp2·pp2 interleaved": {"pp": 2, "schedule": "interleaved", "virtual_stages": 2},
    "dp2·pp2 zb": {"pp": 2, "schedule": "zb"},
    "zero3·pp2": {"zero": 3, "pp": 2},
    "zero3·pp2 zb": {"zero": 3, "pp": 2, "schedule": "zb"},
}


def _config(text: str, **flags) -> GPTTrainConfig:
    settings = {
        "nproc": 4,
        "config": "gpt-tiny",
        "data": text,
        "seq_len": 32,
        "global_batch": 8,
        "steps": 20,
        "warmup": 1,
        "lr": 1e-3,
        "backend": "gloo",
    }
    return GPTTrainConfig.from_flags(**(settings | flags))


def _compare(text: str, flags: dict) -> dict[str, float]:
    config = _config(text, **flags)
    world = meshwise.init("gloo", timeout=90, mesh=config.mesh_shape(int(os.environ["WORLD_SIZE"])))
    try:
        trainer = GPTTrainer(world, resolve(config))
        torch.manual_seed(config.data.seed)
        reference = GPT(trainer.model_config)
        optimizer = build_optimizer(reference, config.optimizer)
        worst = {"loss": 0.0, "params": 0.0, "compared": 0.0}
        for step in range(STEPS):
            stats = trainer.train_step(step)
            loss, _ = reference_step(reference, optimizer, trainer, config, step, micro_batch=None)
            worst["loss"] = max(worst["loss"], abs(stats.loss - loss))
            ours = trainer.step_runner.sampling_model()  # collective, as --sample gathers it
            if next(ours.parameters()).device.type != "meta":
                diffs = [
                    (p - q).abs().max().item()
                    for p, q in zip(ours.parameters(), reference.parameters(), strict=True)
                ]
                worst["params"] = max([worst["params"], *diffs])
                worst["compared"] += 1
        return worst
    finally:
        meshwise.shutdown()


@pytest.mark.parametrize("flags", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_every_layout_trains_as_one_process_does(text: str, flags: dict) -> None:
    _check_rows(spawn(_compare, 4, args=(text, flags), timeout=110))


@pytest.mark.slow
@pytest.mark.parametrize("zero", [1, 3])
def test_three_dimensions_on_eight_ranks_train_as_one_process_does(text: str, zero: int) -> None:
    """dp2·tp2·pp2 with ZeRO-1 or ZeRO-3: every strategy at once — each stage's tp shards sharded over
    dp (ZeRO-3: gathered for the pipeline step)."""
    flags = {"nproc": 8, "tp": 2, "pp": 2, "zero": zero}
    _check_rows(spawn(_compare, 8, args=(text, flags), timeout=115))


def _check_rows(results: list[dict]) -> None:
    assert results[0]["compared"] == STEPS  # rank 0 always holds the gathered model
    for result in results:
        assert result["loss"] < LOSS_TOLERANCE, result
        assert result["params"] < PARAM_TOLERANCE, result


# ---------------------------------------------------------------------------------------------- resume
def _train(text: str, root: str, flags: dict, resume: bool) -> dict:
    """Layout A: RESUME_STEPS steps, a checkpoint after RESUME_AT; or layout B: resume from it."""
    return resume_run(_config(text, checkpoint=f"{root}/ckpt", resume=resume, **flags))


RESUMES = {
    "tp2 → dp2": ({"nproc": 2, "tp": 2}, {"nproc": 2}),
    "dp2 → tp2": ({"nproc": 2}, {"nproc": 2, "tp": 2}),
    "zero3 → tp2": ({"nproc": 2, "zero": 3}, {"nproc": 2, "tp": 2}),
    "pp2·dp2 → one process": ({"pp": 2}, {"nproc": 1}),
    "zero3·tp2 → pp2·dp2": ({"zero": 3, "tp": 2}, {"pp": 2}),
    "dp4 → zero1·tp2·sp": ({}, {"zero": 1, "tp": 2, "sp": True}),
    "zero2·pp2 → dp2": ({"zero": 2, "pp": 2}, {"nproc": 2}),
    "tp2 → zero1·pp2·tp2": ({"nproc": 2, "tp": 2}, {"zero": 1, "pp": 2, "tp": 2}),
    "zero3·pp2 → dp2": ({"zero": 3, "pp": 2}, {"nproc": 2}),
    "dp2 → zero3·pp2": ({"nproc": 2}, {"zero": 3, "pp": 2}),
    "tp2·pp2 → tp4": ({"tp": 2, "pp": 2}, {"tp": 4}),
    "tp4 → zero3·tp2": ({"tp": 4}, {"zero": 3, "tp": 2}),
}


@pytest.mark.parametrize(("first", "then"), RESUMES.values(), ids=RESUMES.keys())
def test_a_checkpoint_resumes_exactly_on_another_layout(text: str, tmp_path, first: dict, then: dict) -> None:
    root = str(tmp_path)
    a = spawn(_train, first.get("nproc", 4), args=(text, root, first, False), timeout=110)[0]
    b = spawn(_train, then.get("nproc", 4), args=(text, root, then, True), timeout=110)[0]
    assert_resumed(a, b, LOSS_TOLERANCE, PARAM_TOLERANCE)


def test_a_checkpoint_is_read_by_torch_alone_into_a_plain_gpt(text: str, tmp_path) -> None:
    """``dcp_to_torch_save`` (torch only, no meshwise) turns a zero3 checkpoint of 2 ranks into one file
    whose model state loads into ``GPT`` and holds the run's weights (the next step's loss, recomputed)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    root = str(tmp_path)
    run = spawn(_train, 2, args=(text, root, {"nproc": 2, "zero": 3}, False), timeout=110)[0]
    dcp_to_torch_save(f"{root}/ckpt/step-{RESUME_AT:06d}", f"{root}/plain.pt")
    state = torch.load(f"{root}/plain.pt", weights_only=True)
    config = _config(text)
    run_here = resolve(config)
    model = GPT(run_here.model_config)
    model.load_state_dict(state["model"])
    data = config.data
    inputs, targets = train_batch(run_here.load_data(), 32, data.global_batch, data.seed, RESUME_AT, 0, 1)
    with torch.no_grad():  # the loaded weights give the loss the run computed next from the checkpoint
        loss = language_model_loss(model(inputs), targets).item()
    assert loss == pytest.approx(run["losses"][RESUME_AT], abs=LOSS_TOLERANCE)
    assert set(state["optim"]["state"]) == {n for n, _ in model.named_parameters()}


def test_a_tensor_parallel_checkpoint_holds_each_ranks_own_slice_only(text: str, tmp_path) -> None:
    """--tp 2: each rank writes its own shard of a tp-sharded weight and of its AdamW moments — chunks of
    the local shard's size at that rank's offset, in that rank's file — never a whole tensor gathered
    over tp; a replicated weight is written once, whole. Every tensor's chunks tile it exactly."""
    import torch.distributed.checkpoint as dcp

    root = str(tmp_path)
    spawn(_train, 2, args=(text, root, {"nproc": 2, "tp": 2}, False), timeout=110)
    metadata = dcp.FileSystemReader(f"{root}/ckpt/step-{RESUME_AT:06d}").read_metadata()
    files = {(index.fqn, index.offset): item.relative_path for index, item in metadata.storage_data.items()}

    def chunks(key: str) -> list[tuple[tuple[int, ...], tuple[int, ...], str]]:
        found = metadata.state_dict_metadata[key].chunks
        return sorted((tuple(c.offsets), tuple(c.sizes), files[key, c.offsets]) for c in found)

    for key in ("model.blocks.0.mlp.fc.weight", "optim.state.blocks.0.mlp.fc.weight.exp_avg"):
        (first, size, file0), (second, size1, file1) = chunks(key)  # column-parallel: rows cut in two
        assert size == size1 == (128, 64) and first == (0, 0) and second == (128, 0), chunks(key)
        assert file0 != file1  # each rank its own
    ((offset, size, _),) = chunks("model.blocks.0.ln1.weight")  # replicated over tp: once, whole
    assert offset == (0,) and size == (64,)
    for key, entry in metadata.state_dict_metadata.items():
        if hasattr(entry, "chunks") and entry.size.numel() > 0:
            assert sum(c.sizes.numel() for c in entry.chunks) == entry.size.numel(), key
