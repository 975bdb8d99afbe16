"""``meshwise train gpt --tp --sp``: exact resume from a checkpoint of full tensors, and the command line
with ``--comm-stats``. (Parity of tp training with one process is in test_gpt_train.py's matrix.)"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import torch

import meshwise
from meshwise.cli import main
from meshwise.comm.mesh import MeshShape
from meshwise.runtime.spawn import spawn
from meshwise.train.gpt import GPTTrainConfig
from meshwise.train.gpt.loop import GPTTrainer
from meshwise.train.gpt.resolve import resolve

DATA = str(Path(sysconfig.get_paths()["stdlib"]) / "argparse.py")


def _resume(root: str) -> dict[str, object]:
    config = GPTTrainConfig.from_flags(
        config="gpt-tiny", data=DATA, seq_len=32, global_batch=4, steps=6, eval_every=3, warmup=1,
        lr=1e-3, backend="gloo", tp=2, sp=True,
    )  # fmt: skip
    world = meshwise.init("gloo", timeout=60, mesh=MeshShape(tp=2))
    try:
        straight = GPTTrainer(world, resolve(config))
        expected = [straight.train_step(step).loss for step in range(6)]
        interrupted = GPTTrainer(world, resolve(config.with_flags(checkpoint=root)))
        for step in range(3):
            interrupted.history.append(interrupted.train_step(step))
        interrupted.save_checkpoint(3)  # the job dies after this checkpoint
        del interrupted
        resumed = GPTTrainer(world, resolve(config.with_flags(checkpoint=root, resume=True)))
        losses = [resumed.train_step(step).loss for step in range(3, 6)]
        ours = straight.step_runner.full_model().state_dict()  # collective: every rank calls it
        theirs = resumed.step_runner.full_model().state_dict()
        return {
            "first step": resumed.first_step,
            "same losses": losses == expected[3:],
            "same parameters": all(torch.equal(ours[k], theirs[k]) for k in ours),
        }
    finally:
        meshwise.shutdown()


def test_tensor_and_sequence_parallel_training_resumes_exactly(tmp_path) -> None:
    for result in spawn(_resume, 2, args=(str(tmp_path / "ckpt"),), timeout=110):
        assert result == {"first step": 3, "same losses": True, "same parameters": True}


def test_train_gpt_with_tp_and_sp_prints_communication(tmp_path, capsys) -> None:
    """`meshwise train gpt --tp 2 --sp --comm-stats`: trains, and the summary counts each axis's traffic."""
    out = tmp_path / "run.json"
    argv = ["train", "gpt", "-np", "2", "--tp", "2", "--sp", "--config", "gpt-tiny", "--data", DATA,
            "--seq-len", "32", "--global-batch", "4", "--steps", "3", "--eval-every", "3",
            "--eval-windows", "4", "--backend", "gloo", "--comm-stats", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert "Communication (rank 0, per step of 3" in capsys.readouterr().out
    run = json.loads(out.read_text())
    assert run["mesh"] == "dp=1 tp=2 pp=1" and run["final_val_loss"] < run["initial_val_loss"]
    tp = run["comm_stats"]["tp"]
    assert set(run["comm_stats"]) == {"tp"}
    assert tp["reduce_scatter"]["calls"] > 0 and tp["all_gather"]["bytes"] > 0
