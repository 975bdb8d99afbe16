"""Run one layout of ``meshwise train gpt`` for a few steps and collect what it did: per-step losses and
seconds, the peak memory of its fullest rank, and (optionally) its trained weights.

``meshwise plan --validate`` and ``meshwise compare`` both need exactly this, so it is here once. A trial
drives the public command line (``meshwise train gpt … --json F``) in a child process rather than the
trainer's internals, so it measures what a user would run and survives changes inside ``train/gpt``.

Peak memory is what the run itself reports (``peak_memory`` in its JSON, its fullest rank's; what is
counted: :mod:`meshwise.train.gpt.peak_memory`).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

#: validation windows of the one evaluation at the end: few (cheap), yet at least one per rank of any
#: layout here, so that no rank's forwards are all padding (see data.windows.lockstep_val_batches)
EVAL_WINDOWS = 8


@dataclass(frozen=True)
class TrialSpec:
    """One ``meshwise train gpt`` run: model and data fixed, the layout varied."""

    ranks: int
    layout: dict[str, int | str | bool] = field(default_factory=dict)  # train gpt flag dests; sp a switch
    config: str = "gpt-tiny"
    steps: int = 5
    global_batch: int = 8
    seq_len: int | None = None
    seed: int = 0
    model_flags: tuple[str, ...] = ()  # e.g. ("--layers", "1") for the baseline
    export: bool = False  # write the trained weights (Hugging Face GPT-2 safetensors)
    threads: int | None = None  # torch threads per rank (OMP_NUM_THREADS), as a plan was measured with

    def argv(self, json_path: Path, export_dir: Path | None) -> list[str]:
        """The command line after ``meshwise``: each flag with its value (left out where that is None)."""
        flags = {
            "-np": self.ranks,
            "--config": self.config,
            "--steps": self.steps,
            "--global-batch": self.global_batch,
            "--seq-len": self.seq_len,
            "--seed": self.seed,
            "--warmup": 0,
            "--eval-every": self.steps,
            "--eval-windows": EVAL_WINDOWS,
            "--backend": "gloo",
            "--device": "cpu",
            "--json": json_path,
            "--export-hf": export_dir,
        } | {f"--{key.replace('_', '-')}": value for key, value in self.layout.items() if key != "sp"}
        args = [str(part) for flag, value in flags.items() if value is not None for part in (flag, value)]
        return ["train", "gpt", *args, *(["--sp"] if self.layout.get("sp") else []), *self.model_flags]


@dataclass(frozen=True)
class TrialResult:
    spec: TrialSpec
    ok: bool
    error: str  # the run's last stderr line when it failed ("" otherwise)
    losses: tuple[float, ...] = ()
    step_seconds: tuple[float, ...] = ()
    peak_allocated: int = 0  # bytes: the fullest rank's peak allocated during the steps, above its start
    peak_resident: int = 0  # bytes: the same rank's resident high-water mark during the steps, likewise
    setup_allocated: int = 0  # bytes: the peak allocated while the model was built and cut
    weights: str | None = None  # exported safetensors file

    @property
    def step_time(self) -> float:
        """Median step after the first (which pays for warm-up)."""
        steps = self.step_seconds[1:] or self.step_seconds
        return statistics.median(steps) if steps else float("nan")


def run_trial(spec: TrialSpec, workdir: Path, timeout: float = 300.0) -> TrialResult:
    """Run ``spec`` in a child process under ``workdir`` (weights are kept there when exported)."""
    workdir.mkdir(parents=True, exist_ok=True)
    out = Path(tempfile.mkdtemp(prefix="trial-", dir=workdir))
    json_path = out / "run.json"
    export_dir = out / "weights" if spec.export else None
    command = [sys.executable, "-m", "meshwise", *spec.argv(json_path, export_dir)]
    source = str(Path(__file__).resolve().parents[2])  # meshwise's own directory: the child runs this code
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [source, os.environ.get("PYTHONPATH")]))}
    if spec.threads is not None:
        env["OMP_NUM_THREADS"] = str(spec.threads)
    with open(out / "stdout", "w") as stdout, open(out / "stderr", "w") as stderr:
        child = subprocess.Popen(command, stdout=stdout, stderr=stderr, env=env)
        try:
            child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            return TrialResult(spec, False, f"did not finish in {timeout:.0f} s")
    if child.returncode != 0 or not json_path.exists():
        lines = [line for line in (out / "stderr").read_text().splitlines() if line.strip()] or [
            "(no output)"
        ]
        return TrialResult(spec, False, lines[-1])
    run = json.loads(json_path.read_text())
    history = [h for h in run["history"] if h["step"] > run["first_step"]]
    memory = run.get("peak_memory") or {}
    weights = None
    if export_dir is not None:
        weights = next((str(p) for p in sorted(export_dir.glob("*.safetensors"))), None)
    return TrialResult(
        spec,
        True,
        "",
        tuple(h["loss"] for h in history),
        tuple(h["seconds"] for h in history),
        memory.get("allocated") or 0,
        memory.get("resident") or 0,
        memory.get("setup_allocated") or 0,
        weights,
    )
