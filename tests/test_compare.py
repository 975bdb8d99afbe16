"""meshwise compare: layout spelling, the divergence analysis on known differences, and two layouts on
two ranks against one process; and train gpt --auto's choice among its trials."""

from __future__ import annotations

import argparse
import json
import subprocess
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from conftest import meshwise_here
from meshwise.cli import main, train_auto
from meshwise.models.gpt import CONFIGS
from meshwise.plan import ModelSpec, Plan, Precision, Problem, advise
from meshwise.plan.hardware import PRESETS
from meshwise.train import trial
from meshwise.train.compare import compare_runs, parse_layout, weight_divergence
from meshwise.train.trial import TrialResult, TrialSpec, run_trial


@pytest.mark.parametrize(
    ("text", "ranks", "settings"),
    [
        ("dp2", 2, {"dp": 2}),
        ("tp2", 2, {"tp": 2, "dp": 1}),
        ("pp2,m=4", 2, {"pp": 2, "micro_batches": 4, "dp": 1}),
        ("zero3", 2, {"zero": 3, "dp": 2}),
        ("dp2·tp2+sp", 4, {"dp": 2, "tp": 2, "sp": True}),
        ("pp2,m=4,schedule=interleaved,v=2", 2,
         {"pp": 2, "micro_batches": 4, "schedule": "interleaved", "virtual_stages": 2, "dp": 1}),
    ],
)  # fmt: skip
def test_parse_layout(text: str, ranks: int, settings: dict) -> None:
    assert parse_layout(text, 2) == (ranks, settings)


BAD = [("tp3", "does not divide --np 2"), ("dp2,xx", "cannot read 'xx'"), ("pp2,m=0", "a positive integer")]


@pytest.mark.parametrize(("text", "message"), BAD)
def test_bad_layout_is_one_line(capsys, text: str, message: str) -> None:
    assert main(["compare", text]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("meshwise compare: error:") and message in err and "\n" not in err


def test_divergence_names_the_first_step_and_tensor(tmp_path) -> None:
    """A run whose third loss and whose h.2 weight differ is caught at step 3 and h.2 (not h.10, which
    sorts before it alphabetically but comes after it in the model)."""
    weights = {f"h.{i}.w": torch.zeros(3) for i in (1, 2, 10)}
    save_file(weights, tmp_path / "ref.safetensors")
    changed = dict(weights) | {"h.2.w": torch.tensor([0.0, 1e-3, 0.0]), "h.10.w": torch.ones(3)}
    save_file(changed, tmp_path / "other.safetensors")
    spec = TrialSpec(2)
    ref = TrialResult(spec, True, "", (5.0, 4.0, 3.0), weights=str(tmp_path / "ref.safetensors"))
    run = TrialResult(spec, True, "", (5.0, 4.0 + 1e-6, 3.01), weights=str(tmp_path / "other.safetensors"))
    parity = compare_runs("dp2", ref, run, 1e-4)
    assert parity.first_step == 3 and parity.first_tensor == "h.2.w" and not parity.passed
    assert parity.max_delta == pytest.approx((0.0, 1e-6, 0.01))
    assert weight_divergence(str(tmp_path / "ref.safetensors"), str(tmp_path / "ref.safetensors"), 1e-4) == (
        None, 0.0)  # fmt: skip


def _layouts_here(monkeypatch) -> list[list[str]]:
    """Make run_trial run every trial after the first in this process (conftest.meshwise_here), the same
    command line; the first, the one-process reference, stays a child process as run_trial starts it.
    Returns the trials' command lines, as they come."""
    commands: list[list[str]] = []

    def popen(command: list[str], *, stdout, stderr, env):
        commands.append(command)
        if len(commands) == 1:
            return subprocess.Popen(command, stdout=stdout, stderr=stderr, env=env)
        done = meshwise_here(command)
        stdout.write(done.stdout)
        stderr.write(done.stderr)
        return SimpleNamespace(returncode=done.returncode, wait=lambda timeout: done.returncode)

    here = SimpleNamespace(Popen=popen, TimeoutExpired=subprocess.TimeoutExpired)
    monkeypatch.setattr(trial, "subprocess", here)
    return commands


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_layouts_on_two_ranks_match_one_process(tmp_path, capsys, monkeypatch) -> None:
    out = tmp_path / "compare.json"
    commands = _layouts_here(monkeypatch)
    code = main(["compare", "dp2", "tp2", "--steps", "2", "--global-batch", "4", "--json", str(out)])
    data = json.loads(out.read_text())
    assert code == 0, capsys.readouterr()
    assert [command[command.index("-np") + 1] for command in commands] == ["1", "2", "2"]
    assert [row["layout"] for row in data["layouts"]] == ["dp2", "tp2"]
    for row in data["layouts"]:
        assert row["passed"] and len(row["max_delta"]) == 2 and row["tensor_delta"] <= data["tolerance"]


def test_a_trial_past_its_timeout_is_killed_and_says_so(tmp_path) -> None:
    result = run_trial(TrialSpec(ranks=1), tmp_path, timeout=0.01)
    assert not result.ok and result.error == "did not finish in 0 s"


def test_train_gpt_auto_trains_with_the_fastest_trial(monkeypatch) -> None:
    """--auto keeps the layout whose short trial was fastest — here the plan's third pick, not its first —
    and hands its mesh, ZeRO stage and micro-batch to train gpt (trials replaced by known step times, the
    measured host by a preset, so the plan is deterministic)."""

    def fake_measure(plan: Plan, config: str, k: int, steps: int, workdir) -> list:
        return [(c, TrialResult(TrialSpec(2), True, "", step_seconds=(9.0, 3.0 - i)))
                for i, c in enumerate(plan.ranked[:k])]  # fmt: skip

    monkeypatch.setattr(train_auto, "measure", fake_measure)
    monkeypatch.setattr(train_auto, "measure_cpu", lambda ranks, config: PRESETS["a100-80gb"])
    shape = dict.fromkeys(("layers", "hidden", "heads", "vocab", "seq_len", "device", "dp", "micro_batch"))
    args = argparse.Namespace(**shape, config="gpt-tiny", nproc=2, dtype="fp32", global_batch=8, tp=1, pp=1,
                              zero=0, micro_batches=None, sp=False, schedule="1f1b", auto=True)  # fmt: skip
    chosen = train_auto.choose_layout(args)
    problem = Problem(ModelSpec.of(CONFIGS["gpt-tiny"]), PRESETS["a100-80gb"], Precision("fp32"), 8, 2)
    third = advise(problem, {"recompute": "none"}).ranked[2].layout
    assert (chosen.dp, chosen.tp, chosen.pp, chosen.zero, chosen.micro_batch) == (
        third.dp, third.tp, third.pp, third.zero, third.micro_batch)  # fmt: skip
