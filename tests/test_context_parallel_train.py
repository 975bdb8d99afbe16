"""``meshwise train gpt --cp N`` trains gpt-tiny exactly as one process does, composed with dp, ZeRO, tp
(+sp), pp and recomputation; checkpoints cross between cp and other layouts; bad input is one line.

Each row spawns the real trainer on its mesh and, beside it, the one-process reference
(tests/gpt_reference.py: the whole global batch, the same AdamW, schedule and clipping), and compares the
global-batch loss and every parameter of the plain model (gathered as ``--sample`` gathers it) after each
step.

Tolerances (fp32), those of the layout matrix (tests/test_gpt_layouts.py): the loss to 2e-5, the
parameters to 5e-5 at lr 1e-3 — 5 % of one Adam update. Context parallelism changes summation orders only
(each query chunk's softmax merged from two fused calls by their log-sum-exps, dK/dV reduce-scattered,
gradients averaged over cp ranks), which moves a gradient by ~1e-7; Adam divides each gradient by its own
magnitude, so where per-token contributions nearly cancel that shows in the coordinate's first update.
A wrong cp (a position offset missed, a chunk attending to the wrong keys, gradients averaged over dp
only, the loss of one chunk) is off by a whole update or more — the loss by far more than 2e-5.
"""

from __future__ import annotations

import pytest
import torch

import meshwise
from gpt_reference import assert_resumed, reference_step, resume_run
from meshwise.cli import main
from meshwise.models.gpt import GPT
from meshwise.runtime.spawn import spawn
from meshwise.train.gpt import GPTTrainConfig
from meshwise.train.gpt.loop import GPTTrainer
from meshwise.train.gpt.parallelize import build_optimizer
from meshwise.train.gpt.resolve import resolve

STEPS = 3
LOSS_TOLERANCE = 2e-5
PARAM_TOLERANCE = 5e-5

#: row name → the flags of `meshwise train gpt` (nproc: the ranks it spawns)
TWO_RANKS: dict[str, dict] = {
    "cp2": {"nproc": 2, "cp": 2},
    "cp2 zero1": {"nproc": 2, "cp": 2, "zero": 1},
    "cp2 recompute full": {"nproc": 2, "cp": 2, "recompute": "full"},
}
FOUR_RANKS: dict[str, dict] = {
    "cp4 selective": {"cp": 4, "recompute": "selective"},
    "cp2·dp2": {"cp": 2},
    "cp2·tp2": {"cp": 2, "tp": 2},
    "cp2·tp2·sp": {"cp": 2, "tp": 2, "sp": True},
    "cp2·pp2": {"cp": 2, "pp": 2},
    "cp2·dp2 zero3": {"cp": 2, "zero": 3},
    "cp2·pp2 zero1": {"cp": 2, "pp": 2, "zero": 1},
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
    run = resolve(_config(text, **flags))
    config = run.config
    world = meshwise.init("gloo", timeout=90, mesh=run.shape)
    try:
        trainer = GPTTrainer(world, run)
        torch.manual_seed(config.data.seed)
        reference = GPT(trainer.model_config)
        optimizer = build_optimizer(reference, config.optimizer)
        worst = {"loss": 0.0, "params": 0.0, "compared": 0.0, "val": 0.0}
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
        worst["val"] = trainer.evaluate()  # every cp rank's chunks summed: the plain model's loss
        if world.is_main:
            worst["val_expected"] = _plain_validation(trainer, trainer.step_runner.sampling_model())
        else:
            trainer.step_runner.sampling_model()
        return worst
    finally:
        meshwise.shutdown()


def _plain_validation(trainer: GPTTrainer, model: GPT) -> float:
    """The one-process evaluation of ``model`` on the trainer's validation windows."""
    from meshwise.data.windows import lockstep_val_batches

    total, count = 0.0, 0
    with torch.no_grad():
        for inputs, targets, counted in lockstep_val_batches(
            trainer.splits, trainer.seq_len, trainer.config.data.eval_windows, trainer.micro_batch, 0, 1
        ):
            if counted:
                logits = model(inputs)
                total += torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"
                ).item()
                count += targets.numel()
    return total / count


def _check_rows(results: list[dict]) -> None:
    assert results[0]["compared"] == STEPS  # rank 0 always holds the gathered model
    assert results[0]["val"] == pytest.approx(results[0]["val_expected"], abs=LOSS_TOLERANCE)
    for result in results:
        assert result["loss"] < LOSS_TOLERANCE, result
        assert result["params"] < PARAM_TOLERANCE, result


@pytest.mark.parametrize("flags", TWO_RANKS.values(), ids=TWO_RANKS.keys())
def test_cp_on_two_ranks_trains_as_one_process_does(text: str, flags: dict) -> None:
    _check_rows(spawn(_compare, 2, args=(text, flags), timeout=110))


@pytest.mark.parametrize("flags", FOUR_RANKS.values(), ids=FOUR_RANKS.keys())
def test_cp_composed_on_four_ranks_trains_as_one_process_does(text: str, flags: dict) -> None:
    _check_rows(spawn(_compare, 4, args=(text, flags), timeout=110))


def _bf16_attention() -> float:
    """cp2 attention on bf16 q, k, v (what --dtype bf16's autocast hands it) against fp32 one-process
    attention of the same values: output and dQ, dK, dV."""
    from meshwise.parallel.context_parallel import context_parallel_attention, split_sequence

    world = meshwise.init("gloo", timeout=60)
    try:
        comm = world.comm
        g = torch.Generator().manual_seed(5)
        q, k, v = (
            torch.randn(2, 2, 16, 8, generator=g).bfloat16().float().requires_grad_() for _ in range(3)
        )
        upstream = torch.randn(2, 2, 16, 8, generator=g).bfloat16().float()
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(upstream)
        mine = [
            split_sequence(t.detach(), 2, comm.rank, dim=2).bfloat16().requires_grad_() for t in (q, k, v)
        ]
        local = context_parallel_attention(*mine, comm)
        local.backward(split_sequence(upstream, 2, comm.rank, dim=2).bfloat16())
        pairs = [(local, out)] + [(m.grad, t.grad) for m, t in zip(mine, (q, k, v), strict=True)]
        return max((a.float() - split_sequence(b, 2, comm.rank, dim=2)).abs().max().item() for a, b in pairs)
    finally:
        meshwise.shutdown()


def test_bf16_attention_keeps_its_log_sum_exp_in_fp32() -> None:
    """bf16's 8-bit mantissa: values of order 1 to 2⁻⁶ (each output rounded once, sums in fp32)."""
    assert all(worst < 2**-6 for worst in spawn(_bf16_attention, 2, timeout=60))


# ---------------------------------------------------------------------------------------------- resume
def _train(text: str, root: str, flags: dict, resume: bool) -> dict:
    """Layout A: RESUME_STEPS steps, a checkpoint after RESUME_AT; or layout B: resume from it."""
    return resume_run(_config(text, checkpoint=f"{root}/ckpt", resume=resume, **flags))


RESUMES = {
    "cp2·dp2 → dp2": ({"cp": 2}, {"nproc": 2}),
    "dp2 → cp2 zero1": ({"nproc": 2}, {"nproc": 2, "cp": 2, "zero": 1}),
}


@pytest.mark.parametrize(("first", "then"), RESUMES.values(), ids=RESUMES.keys())
def test_a_checkpoint_resumes_exactly_across_cp_layouts(text: str, tmp_path, first: dict, then: dict) -> None:
    root = str(tmp_path)
    a = spawn(_train, first.get("nproc", 4), args=(text, root, first, False), timeout=110)[0]
    b = spawn(_train, then.get("nproc", 4), args=(text, root, then, True), timeout=110)[0]
    assert_resumed(a, b, LOSS_TOLERANCE, PARAM_TOLERANCE)


# ---------------------------------------------------------------------------------------------- the CLI
def test_cp_sample_and_export_work_on_the_plain_model(text: str, tmp_path, capsys) -> None:
    """--sample and --export-hf after a cp2 run: rank 0 generates alone with the plain weights."""
    argv = [
        "train",
        "gpt",
        "-np",
        "2",
        "--cp",
        "2",
        "--config",
        "gpt-tiny",
        "--data",
        text,
        "--seq-len",
        "32",
    ]
    argv += ["--steps", "2", "--global-batch", "4", "--eval-windows", "2", "--backend", "gloo"]
    assert main([*argv, "--sample", "8", "--export-hf", str(tmp_path / "hf")]) == 0
    printed = capsys.readouterr().out
    assert "cp 2 (each sequence in 4 chunks)" in printed and "----- sample -----" in printed
    assert (tmp_path / "hf" / "config.json").is_file()


BAD = {
    "seq len not a multiple of 2·cp": (
        ["--cp", "2", "--seq-len", "30"],
        "is not a multiple of 4; use 28 or 32",
    ),
    "longer than the positions": (["--cp", "2", "--seq-len", "128"], "longer than the position table (64)"),
    "cp with experts": (["--cp", "2", "--experts", "4"], "--experts with --cp is not built yet"),
    "more cp ranks than started": (["--cp", "3"], "--cp 3 is larger than the 2 ranks started"),
    "cp with --auto": (["--cp", "2", "--auto"], "--auto plans dp, tp and pp only: drop --cp"),
}


@pytest.mark.parametrize(("flags", "message"), BAD.values(), ids=BAD.keys())
def test_bad_cp_input_is_one_line_before_launch(capsys, flags: list[str], message: str) -> None:
    argv = ["train", "gpt", "-np", "2", "--config", "gpt-tiny", *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
