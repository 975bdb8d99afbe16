"""Write the multi-node SLURM batch script that the seeds build by hand, correctly every time.

Two layouts, both with the rendezvous the seeds recommend: the first node of the allocation resolved to
IPv4 (a hostname can resolve to an IPv6 address that the other nodes cannot reach) and a port derived
from the job id (29500 + id % 20000, the same rule :func:`meshwise.runtime.env.job_port` applies, so a
meshwise script under srun needs no exports at all):

- ``tasks`` — one srun task per GPU. srun names a task's place SLURM_PROCID / SLURM_LOCALID; a tiny
  ``bash -c`` wrapper re-exports them as RANK / LOCAL_RANK so an unmodified torchrun-style script works.
- ``torchrun`` — one srun task per node running torchrun, which starts the node's workers and meets
  the other nodes through its c10d rendezvous on the master address.

``--kill-on-bad-exit=1`` makes srun end every task when one fails, the batch analogue of ``meshwise
run``'s fail-fast. srun is given ``--cpus-per-task`` again: since SLURM 22.05 it no longer inherits the
batch script's value, and each task (with ``--cpu-bind=cores``) would be pinned to a single core.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from meshwise.runtime.env import JOB_PORT_BASE, JOB_PORT_SPAN

SBATCH_MODES = ("tasks", "torchrun")
#: every srun line: fail fast, and the batch script's CPUs per task (srun >= 22.05 does not inherit them).
_SRUN_FLAGS = '--kill-on-bad-exit=1 --cpus-per-task="$SLURM_CPUS_PER_TASK"'
_TIME = re.compile(r"^(\d+-)?\d{1,2}(:\d{2}){0,2}$")


@dataclass(frozen=True)
class SbatchSpec:
    """What to run and on how much of the cluster."""

    script: str
    args: tuple[str, ...] = ()
    module: bool = False
    python: bool = True
    nodes: int = 1
    tasks_per_node: int = 1
    gpus_per_node: int = 0
    cpus_per_task: int = 8
    time: str = "01:00:00"
    job_name: str = "meshwise"
    partition: str | None = None
    account: str | None = None
    mode: str = "tasks"

    def validate(self) -> None:
        """Errors name the flag to change, before anything is printed."""
        if self.module and not self.python:
            raise ValueError("-m (a Python module) and --no-python (an executable) exclude each other")
        if self.mode not in SBATCH_MODES:
            raise ValueError(f"--sbatch-mode {self.mode!r} is not one of {', '.join(SBATCH_MODES)}")
        for flag, value in (("--nnodes", self.nodes), ("-np", self.tasks_per_node)):
            if value < 1:
                raise ValueError(f"{flag} must be at least 1 for a batch script, got {value}")
        if self.cpus_per_task < 1:
            raise ValueError(f"--cpus-per-task must be at least 1, got {self.cpus_per_task}")
        if self.gpus_per_node < 0:
            raise ValueError(f"--gpus-per-node must be >= 0, got {self.gpus_per_node}")
        if self.gpus_per_node and self.gpus_per_node < self.tasks_per_node:
            raise ValueError(
                f"-np {self.tasks_per_node} workers per node but --gpus-per-node {self.gpus_per_node}: "
                "one GPU per worker needs -np <= --gpus-per-node"
            )
        if not _TIME.match(self.time):
            raise ValueError(
                f"--time {self.time!r} is not a SLURM time such as 30:00, 02:00:00 or 1-00:00:00"
            )


def _header(spec: SbatchSpec, tasks_per_node: int, cpus_per_task: int) -> list[str]:
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={spec.job_name}",
        f"#SBATCH --nodes={spec.nodes}",
        f"#SBATCH --ntasks-per-node={tasks_per_node}",
        f"#SBATCH --cpus-per-task={cpus_per_task}",
    ]
    if spec.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={spec.gpus_per_node}")
    lines += [f"#SBATCH --time={spec.time}", "#SBATCH --output=%x_%j.out"]
    if spec.partition:
        lines.append(f"#SBATCH --partition={spec.partition}")
    if spec.account:
        lines.append(f"#SBATCH --account={spec.account}")
    return lines


def _rendezvous() -> list[str]:
    return [
        "set -eu",
        "",
        "# Load modules / activate the Python environment that has torch (and meshwise) here.",
        "",
        "# Rendezvous on the first node of the allocation, as IPv4, on a port derived from the job id.",
        "MASTER_HOST=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | awk 'NR == 1')",
        "MASTER_ADDR=$(getent ahostsv4 \"$MASTER_HOST\" | awk 'NR == 1 {print $1}')",
        'if [ -z "$MASTER_ADDR" ]; then echo "no IPv4 address for $MASTER_HOST" >&2; exit 1; fi',
        f"export MASTER_ADDR MASTER_PORT=$(({JOB_PORT_BASE} + SLURM_JOB_ID % {JOB_PORT_SPAN}))",
    ]


def render_sbatch(spec: SbatchSpec) -> str:
    """The batch script for ``spec`` (validated first)."""
    spec.validate()
    target = ["-m", spec.script] if spec.module else [spec.script]
    if spec.mode == "tasks":
        lines = _header(spec, spec.tasks_per_node, spec.cpus_per_task) + _rendezvous()
        mapping = (
            "export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID "
            f'LOCAL_WORLD_SIZE={spec.tasks_per_node}; exec "$@"'
        )
        interpreter = ["python", "-u"] if spec.python else []
        command: Sequence[str] = [*interpreter, *target, *spec.args]
        lines += [
            "export WORLD_SIZE=$SLURM_NTASKS OMP_NUM_THREADS=$SLURM_CPUS_PER_TASK",
            "",
            "# One task per worker (per GPU); srun's SLURM_PROCID / SLURM_LOCALID become RANK / LOCAL_RANK.",
            f"srun {_SRUN_FLAGS} --cpu-bind=cores bash -c {shlex.quote(mapping)} task \\",
            f"    {shlex.join(command)}",
        ]
    else:
        cpus = spec.cpus_per_task * spec.tasks_per_node
        lines = _header(spec, 1, cpus) + _rendezvous()
        torchrun = [
            "torchrun",
            '--nnodes="$SLURM_NNODES"',
            f"--nproc-per-node={spec.tasks_per_node}",
            '--rdzv-id="$SLURM_JOB_ID"',
            "--rdzv-backend=c10d",
            '--rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT"',
        ]
        if not spec.python:
            torchrun.append("--no-python")
        lines += [
            f"export OMP_NUM_THREADS={spec.cpus_per_task}",
            "",
            f"# One torchrun per node; each starts {spec.tasks_per_node} workers and meets the others at the "
            "master.",
            f"srun {_SRUN_FLAGS} " + " ".join(torchrun) + " \\",
            f"    {shlex.join([*target, *spec.args])}",
        ]
    return "\n".join(lines) + "\n"
