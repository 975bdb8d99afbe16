"""A training run that fails on one rank is reported once, by the rank it concerns (issue 20).

Ranks run under ``meshwise run``, each its own ``meshwise train`` process, with a failure injected on
rank 1 only: its loss function raises, or returns NaN, from its Nth call on. The report must name rank 1
whichever rank prints it; rank 0 must not add a traceback of its own (its collective fails because rank
1 left), and the job must end without waiting for a communication timeout.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from meshwise.runtime.spawn import spawn
from meshwise.train import TrainConfig, TrainingError
from meshwise.train.errors import diverged_on
from meshwise.train.loop import train_rank_main

# python inject.py RANK KIND CALL meshwise-argv...: rank RANK's cross_entropy fails from call CALL on.
INJECT = """
    import os, sys
    import torch
    from meshwise.cli import main

    rank, kind, at = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    if int(os.environ["RANK"]) == rank:
        real, calls = torch.nn.functional.cross_entropy, [0]

        def faulty(*args, **kwargs):
            calls[0] += 1
            loss = real(*args, **kwargs)
            if calls[0] < at:
                return loss
            if kind == "raise":
                raise RuntimeError(f"injected failure in call {calls[0]}")
            return loss * float("nan")

        torch.nn.functional.cross_entropy = faulty
    sys.exit(main(sys.argv[4:]))
"""


def _launched(tmp_path: Path, *args: str) -> tuple[int, str]:
    script = tmp_path / "inject.py"
    script.write_text(textwrap.dedent(INJECT))
    done = subprocess.run(
        [sys.executable, "-m", "meshwise", "run", "-n", "2", str(script), *args],
        capture_output=True,
        text=True,
        timeout=110,  # far below the 300 s communication timeout: nobody waited for it
    )
    return done.returncode, done.stdout + done.stderr


def test_an_exception_on_rank_1_is_reported_by_rank_1_once(tmp_path):
    mlp = ["train", "mlp", "--backend", "gloo", "--epochs", "1"]
    code, output = _launched(tmp_path, "1", "raise", "3", *mlp)
    assert code == 1, output
    lines = output.splitlines()
    # the traceback, then one line naming the rank and the error, from rank 1 only
    assert "[rank 1] meshwise train: rank 1 failed: RuntimeError: injected failure in call 3" in lines
    assert "[rank 1] Traceback (most recent call last):" in lines
    assert not any(line.startswith("[rank 0] Traceback") for line in lines), output
    # rank 0's all_reduce failed because rank 1 left: one line saying so, and it let rank 1 exit first
    rank0 = [line for line in lines if line.startswith("[rank 0] meshwise train:")]
    assert rank0 == [
        "[rank 0] meshwise train: rank 0 stopped: another rank left the job (its own report says why)"
    ]
    assert "meshwise run: rank 1 failed (exit code 1); terminating ranks 0 (its stderr is above)" in lines


def test_a_gpt_loss_that_turns_nan_on_rank_1_is_named_once_by_rank_0(tmp_path, text):
    gpt = ["train", "gpt", "--config", "gpt-tiny", "--data", text, "--seq-len", "32", "--global-batch", "4",
           "--steps", "4", "--eval-every", "4", "--eval-windows", "2", "--backend", "gloo"]  # fmt: skip
    # call 1 is the memory probe's one-block warm-up (train/gpt/peak_memory.py), call 2 rank 1's share of
    # the first evaluation: step 3 is the first with a NaN loss on rank 1
    code, output = _launched(tmp_path, "1", "nan", "5", *gpt)
    assert code == 1, output
    reports = [line for line in output.splitlines() if "training diverged" in line]
    assert reports[0] == (
        "[rank 0] meshwise train gpt: error: training diverged: the loss became nan at step 3 on rank 1 "
        "(lr 0.002); lower --lr"
    ), output
    # once, by rank 0 (the launcher does not repeat a failed rank's stderr)
    assert len(reports) == 1
    assert "Traceback" not in output


def _nan_on_rank_1(config: TrainConfig):
    """train_rank_main with rank 1's loss NaN from its third call (spawned ranks: patched in the rank)."""
    if int(os.environ["RANK"]) == 1:
        real, calls = torch.nn.functional.cross_entropy, [0]

        def faulty(*args, **kwargs):
            calls[0] += 1
            return real(*args, **kwargs) * (float("nan") if calls[0] >= 3 else 1.0)

        torch.nn.functional.cross_entropy = faulty
    return train_rank_main(config)


def test_every_rank_returns_the_divergence_naming_rank_1_and_its_step():
    config = TrainConfig.from_flags(model="mlp", nproc=2, epochs=1, backend="gloo", timeout=100)
    outcomes = spawn(_nan_on_rank_1, 2, (config,), timeout=100)
    assert all(isinstance(o, TrainingError) and o.exit_code == 1 for o in outcomes)
    assert [o.rank for o in outcomes] == [0, 1]  # only rank 0's copy is printed under a launcher
    assert str(outcomes[0]) == str(outcomes[1])
    assert "the loss became nan in epoch 1, first on rank 1 at step 3 of " in str(outcomes[0])


def test_the_first_ranks_with_a_non_finite_loss_are_named():
    assert diverged_on([0, 0, 0]) == (0, "")
    assert diverged_on([0, 3, 4]) == (3, " on rank 1")
    assert diverged_on([5, 0, 5, 6]) == (5, " on ranks 0, 2")
    assert diverged_on([2, 2]) == (2, "")  # every rank at once: nothing to point at
    assert diverged_on([7]) == (7, "")
