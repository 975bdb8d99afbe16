"""``meshwise train gpt --ep N``: the real trainer on a MoE GPT with its experts spread over ep ranks
(alone, and composed with dp, tp ± sp and pp under 1F1B and zero-bubble schedules) equals the same model
on one process at every step — the loss, every parameter, and the router statistics (tokens per expert,
dropped, auxiliary losses) — dropless and with a capacity factor, and the model ``--sample`` gathers is
the reference's; a skewed router trains and reports its imbalance; checkpoints resume across ep sizes;
bad settings are one line before launch.

Under pp every stage's gradients — dense over dp·ep·cp, experts over dp·cp — are averaged by the
pipeline's stage reducers alone (``replica_groups``; no flat reduction after the step is left), so the
ep2·pp2 rows are what checks that averaging.

The one-process reference is written here from plain pieces: the whole global batch in micro-batches of
the ranks' size (a capacity applies per forward pass, so this is the model that drops the same tokens),
each micro-batch's loss with the auxiliary losses' gradient (``with_auxiliary_losses``), the trainer's
AdamW groups, schedule and clipping. Tolerances (fp32) as in tests/test_gpt_layouts.py: the loss to
2e-5, parameters to 5e-5 at lr 1e-3 (5 % of one Adam update); the token counts exactly.
"""

from __future__ import annotations

import os
from dataclasses import asdict

import pytest
import torch

import meshwise
from gpt_reference import assert_resumed, resume_run
from meshwise.cli import main
from meshwise.data.windows import train_batch
from meshwise.models.gpt import GPT, language_model_loss
from meshwise.models.moe import moe_layers, with_auxiliary_losses
from meshwise.parallel.expert_parallel import is_expert_parameter, moe_report
from meshwise.parallel.tensor_parallel import full_tensors
from meshwise.runtime.spawn import spawn
from meshwise.train.gpt import GPTTrainConfig
from meshwise.train.gpt.loop import GPTTrainer
from meshwise.train.gpt.moe import router_report
from meshwise.train.gpt.parallelize import build_optimizer
from meshwise.train.gpt.resolve import resolve

STEPS = 3
SEQ = 16
MICRO = 2  # sequences per forward pass, on every layout and in the reference
LOSS_TOLERANCE = 2e-5
PARAM_TOLERANCE = 5e-5
AUX_TOLERANCE = 1e-5


def _config(text: str, **flags) -> GPTTrainConfig:
    settings = {
        "nproc": 2,
        "config": "gpt-moe-tiny",
        "layers": 2,
        "data": text,
        "seq_len": SEQ,
        "global_batch": 8,
        "micro_batch": MICRO,
        "steps": 20,
        "warmup": 1,
        "lr": 1e-3,
        "backend": "gloo",
    }
    return GPTTrainConfig.from_flags(**(settings | flags))


def _reference_step(
    reference: GPT, optimizer: torch.optim.Optimizer, trainer: GPTTrainer, step: int
) -> float:
    """One step of the one-process MoE GPT on the whole global batch; returns the mean micro-batch loss."""
    config = trainer.config
    lr = config.optimizer.lr_at(step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad()
    inputs, targets = train_batch(trainer.splits, SEQ, config.data.global_batch, config.data.seed, step, 0, 1)
    micro = list(zip(inputs.split(MICRO), targets.split(MICRO), strict=True))
    losses = []
    for x, y in micro:
        loss = with_auxiliary_losses(language_model_loss(reference(x), y), reference)
        (loss / len(micro)).backward()
        losses.append(loss.item())
    torch.nn.utils.clip_grad_norm_(reference.parameters(), config.optimizer.grad_clip)
    optimizer.step()
    return sum(losses) / len(losses)


def _held_parameters(trainer: GPTTrainer) -> dict[str, torch.Tensor]:
    """This rank's parameters under the plain names, whole: gathered over tp when it cuts them without pp,
    or over the replicas when ZeRO shards them (those gathers also collect every expert); with pp and tp a
    stage's own shards whole; else the ones the rank holds (its experts, its stage's layers)."""
    runner = trainer.step_runner
    if trainer.mesh.shape.pp == 1 and (trainer.config.mesh.zero or trainer.mesh.shape.tp > 1):
        return dict(runner.sampling_model().named_parameters())  # collective over tp and ep
    if (
        trainer.config.mesh.zero
    ):  # a stage's ZeRO: its parameters whole (ZeRO-3: collective over the replicas)
        with runner.zero.gathered():
            runner.zero.wait_gathered()
            return {name: p.detach().clone() for name, p in runner.model.named_parameters()}
    if trainer.mesh.shape.tp > 1:
        return full_tensors(runner.model, trainer.mesh.tp)  # the stage's shards whole (collective over tp)
    return {name: param for name, (param, _) in runner.placements.items()}


def _compare(text: str, flags: dict) -> dict:
    config = _config(text, **flags)
    world = meshwise.init("gloo", timeout=90, mesh=config.mesh_shape(int(os.environ["WORLD_SIZE"])))
    try:
        trainer = GPTTrainer(world, resolve(config))
        torch.manual_seed(config.data.seed)
        reference = GPT(trainer.model_config)
        optimizer = build_optimizer(reference, config.optimizer)
        worst = {"loss": 0.0, "params": 0.0, "aux": 0.0, "counts_equal": True, "experts": 0}
        for step in range(STEPS):
            stats = trainer.train_step(step)
            loss = _reference_step(reference, optimizer, trainer, step)
            worst["loss"] = max(worst["loss"], abs(stats.loss - loss))
            ours = router_report(trainer.step_runner.model, trainer.mesh, trainer.model_config.layers)
            theirs = moe_report(reference)
            assert ours is not None and theirs is not None
            mine, ref = asdict(ours), asdict(theirs)
            counts = ("tokens_min", "tokens_mean", "tokens_max", "dropped", "assignments")
            worst["counts_equal"] &= all(mine[k] == ref[k] for k in counts)
            worst["aux"] = max(worst["aux"], *(abs(mine[k] - ref[k]) for k in ("balance_loss", "z_loss")))
            worst["dropped"] = ref["dropped"]
            plain = reference.state_dict()  # the tied head under both of its names (a last stage holds one)
            held = _held_parameters(trainer)
            diffs = [(p.detach() - plain[n].detach()).abs().max().item() for n, p in held.items()]
            worst["params"] = max([worst["params"], *diffs])
            worst["experts"] = len(
                {n.split(".experts.")[1].split(".")[0] for n in held if is_expert_parameter(n)}
            )
        worst |= _sampled(trainer, reference)
        worst["local experts"] = len(moe_layers(trainer.step_runner.model)[0].experts)
        if config.mesh.zero:  # the ranks each kind of flat group is sharded over; the memory report
            runner = trainer.step_runner
            zero = runner.zero if config.mesh.pp > 1 else runner.model  # a stage's ZeRO, or the model's
            worst["shard ranks"] = {
                ("experts" if of else "dense"): group.comm.world_size
                for group, of in zip(zero.groups, zero.replica_of, strict=True)
            }
            if config.mesh.pp == 1:
                worst["memory"] = runner.summary_lines()
        return worst
    finally:
        meshwise.shutdown()


def _sampled(trainer: GPTTrainer, reference: GPT) -> dict:
    """What ``--sample`` generates with (collective: under pp·ep the stages' weights and every expert
    gathered on the job's rank 0): on rank 0 the plain model — every expert under its plain name — equal
    to the reference, and the same continuation sampled from both with one seed."""
    model = trainer.step_runner.sampling_model()
    if next(model.parameters()).device.type == "meta":
        return {}
    plain = dict(reference.named_parameters())
    ours = dict(model.named_parameters())
    prompt = torch.zeros(1, 1, dtype=torch.long)
    texts = [
        m.eval().generate(prompt, 6, generator=torch.Generator().manual_seed(3)).tolist()
        for m in (model, reference)
    ]
    reference.train()
    return {
        "sample_names_equal": set(ours) == set(plain),
        "sample_params": max((ours[n].detach() - plain[n].detach()).abs().max().item() for n in plain),
        "sample_equal": texts[0] == texts[1],
    }


#: row name → (ranks, flags of `meshwise train gpt`)
LAYOUTS: dict[str, tuple[int, dict]] = {
    "ep2": (2, {"ep": 2}),
    "ep2 capacity 1.0": (2, {"ep": 2, "capacity_factor": 1.0}),
    "ep2·dp2": (4, {"nproc": 4, "ep": 2, "capacity_factor": 1.0}),
    "ep2·tp2": (4, {"nproc": 4, "ep": 2, "tp": 2}),
    "ep2·tp2 sp": (4, {"nproc": 4, "ep": 2, "tp": 2, "sp": True, "capacity_factor": 1.0}),
    "ep2·pp2": (4, {"nproc": 4, "ep": 2, "pp": 2, "capacity_factor": 1.0}),
    "ep2·pp2 zb": (4, {"nproc": 4, "ep": 2, "pp": 2, "schedule": "zb"}),
    # the compositions without ep: experts whole on every tp rank; a stage adding its aux gradient itself
    "tp2": (2, {"ep": 1, "tp": 2}),
    "tp2 sp": (2, {"ep": 1, "tp": 2, "sp": True, "capacity_factor": 1.0}),
    "pp2": (2, {"ep": 1, "pp": 2, "capacity_factor": 1.0}),
    "pp2 zb": (2, {"ep": 1, "pp": 2, "schedule": "zb", "capacity_factor": 1.0}),
    "dp2·pp2": (4, {"nproc": 4, "ep": 1, "pp": 2}),
    "tp2·pp2 sp": (4, {"nproc": 4, "ep": 1, "tp": 2, "pp": 2, "sp": True, "capacity_factor": 1.0}),
}


def _check(results: list[dict], experts_per_rank: int, dropping: bool) -> None:
    for result in results:
        assert result["loss"] < LOSS_TOLERANCE, result
        assert result["params"] < PARAM_TOLERANCE, result
        assert result["aux"] < AUX_TOLERANCE and result["counts_equal"], result
        assert (result["dropped"] > 0) == dropping, result  # a capacity of 1.0 drops some, dropless none
        assert result["experts"] in (experts_per_rank, 4), result  # its own block, or gathered over tp
        assert result["local experts"] == experts_per_rank, result
    sampled = results[0]  # the job's rank 0 holds the model --sample generates with
    assert sampled["sample_names_equal"] and sampled["sample_equal"], sampled
    assert sampled["sample_params"] < PARAM_TOLERANCE, sampled


#: rows added with the compositions they check, on 4 ranks: slow (the suite's budget on 2 cores)
SLOW = {"ep2·pp2 zb", "dp2·pp2", "ep2·tp2 sp", "tp2·pp2 sp"}


@pytest.mark.parametrize(
    ("ranks", "flags"),
    [
        pytest.param(ranks, flags, id=name, marks=[pytest.mark.slow] if name in SLOW else [])
        for name, (ranks, flags) in LAYOUTS.items()
    ],
)
def test_expert_parallel_layout_trains_as_one_process_does(text: str, ranks: int, flags: dict) -> None:
    results = spawn(_compare, ranks, args=(text, flags | {"nproc": ranks}), timeout=115)
    _check(results, 4 // flags["ep"], "capacity_factor" in flags)


@pytest.mark.slow
def test_ep4_one_expert_per_rank_trains_as_one_process_does(text: str) -> None:
    flags = {"nproc": 4, "ep": 4, "capacity_factor": 1.0}
    _check(spawn(_compare, 4, args=(text, flags), timeout=115), 1, True)


# ------------------------------------------------------------------------------------------ skewed router
def _skewed(text: str, capacity_factor: float | None) -> dict:
    """Every token routed to expert 0 (a hook adds 100 to its router logit) on ep2: steps run, the loss
    stays finite, and the report shows the imbalance (and the drops under a capacity)."""
    config = _config(text, ep=2, capacity_factor=capacity_factor)
    world = meshwise.init("gloo", timeout=90, mesh=config.mesh_shape(2))
    try:
        trainer = GPTTrainer(world, resolve(config))
        bias = torch.zeros(4)
        bias[0] = 100.0
        for layer in moe_layers(trainer.step_runner.model):
            layer.router.register_forward_hook(lambda _module, _inputs, logits: logits + bias)
        losses = [trainer.train_step(step).loss for step in range(2)]
        report = router_report(trainer.step_runner.model, trainer.mesh, trainer.model_config.layers)
        assert report is not None
        return {"losses": losses, "report": asdict(report), "imbalance": report.imbalance}
    finally:
        meshwise.shutdown()


@pytest.mark.parametrize("capacity_factor", [None, 1.0], ids=["dropless", "capacity 1.0"])
def test_a_skewed_router_trains_and_reports_the_imbalance(text: str, capacity_factor: float | None) -> None:
    result = spawn(_skewed, 2, args=(text, capacity_factor), timeout=110)[0]
    assert all(torch.isfinite(torch.tensor(result["losses"])))
    report = result["report"]
    # 2 steps × 8 sequences × 16 tokens, top-2: each token's first choice is expert 0
    tokens, layers = 2 * 8 * SEQ, 2
    assert report["assignments"] == layers * tokens * 2
    assert report["tokens_max"] >= tokens and report["tokens_min"] <= (tokens * 2 - tokens) / 3 + 1
    assert result["imbalance"] >= 1.9  # expert 0 has all first choices: ≥ 2× the mean of 4 experts
    if capacity_factor is None:
        assert report["dropped"] == 0
    else:  # ⌈1.0·32·2/4⌉ = 16 slots per forward of 2·16 tokens: expert 0 drops half its 32 first choices
        assert report["dropped"] >= layers * 2 * 4 * (MICRO * SEQ - 16)


# ---------------------------------------------------------------------------------------------- resume
def _train(text: str, root: str, flags: dict, resume: bool) -> dict:
    """Layout A: RESUME_STEPS steps, a checkpoint after RESUME_AT; or layout B: resume from it."""
    return resume_run(_config(text, checkpoint=f"{root}/ckpt", resume=resume, capacity_factor=1.0, **flags))


RESUMES = {
    "ep2 → dp2": ({"ep": 2}, {}),
    "dp2 → ep2": ({}, {"ep": 2}),
    "ep2·dp2 → ep4": ({"nproc": 4, "ep": 2}, {"nproc": 4, "ep": 4}),
}


@pytest.mark.parametrize(("first", "then"), RESUMES.values(), ids=RESUMES.keys())
def test_a_checkpoint_resumes_exactly_across_ep_sizes(text: str, tmp_path, first: dict, then: dict) -> None:
    root = str(tmp_path)
    a = spawn(_train, first.get("nproc", 2), args=(text, root, first, False), timeout=110)[0]
    b = spawn(_train, then.get("nproc", 2), args=(text, root, then, True), timeout=110)[0]
    assert_resumed(a, b, LOSS_TOLERANCE, PARAM_TOLERANCE)


# ------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"experts": 6, "nproc": 4, "ep": 4}, r"--experts 6 is not divisible by --ep 4"),
        ({"experts": 4, "top_k": 5, "ep": 2}, r"--top-k 5 must be between 1 and the number of experts \(4\)"),
        ({"ep": 2, "capacity_factor": 0.0}, "--capacity-factor must be a positive number"),
        ({"config": "gpt-tiny", "ep": 2}, r"--ep 2 spreads experts over ranks: give the model experts"),
        ({"ep": 0}, "--ep must be at least 1"),
        ({"ep": 2, "export_hf": "out"}, "cannot train with --export-hf .*GPT-2 weights have no experts"),
        ({"ep": 2, "global_batch": 3, "micro_batch": None}, "not divisible by dp·ep = 2"),
    ],
)
def test_bad_expert_parallel_setting_is_one_clear_error(text: str, overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve(_config(text, **overrides))


def test_bad_ep_from_the_command_line_exits_2_before_launch(text: str, capsys) -> None:
    argv = ["train", "gpt", "-np", "2", "--config", "gpt-moe-tiny", "--experts", "3", "--ep", "2"]
    assert main([*argv, "--data", text]) == 2
    err = capsys.readouterr().err
    assert "--experts 3 is not divisible by --ep 2" in err and "Traceback" not in err
