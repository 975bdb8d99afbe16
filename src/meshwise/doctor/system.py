"""Host resources a job needs: /dev/shm, open files, locked memory, cores."""

from __future__ import annotations

import os
import resource

from meshwise.comm.shm.segment import DEFAULT_SEGMENT_BYTES, ShmSpaceError, free_bytes, plan_layout
from meshwise.doctor.checks import Check
from meshwise.runtime.cores import available_cores

#: /dev/shm below this warns: DataLoader workers hand every batch to the trainer through it.
LOADER_SHM_BYTES = 1 << 30
#: descriptors per rank: a socket per peer and per store client, DataLoader pipes and shared tensors.
FILES_PER_RANK = 1024
#: what NCCL over InfiniBand/RoCE needs pinned; below it registration fails at the first collective.
MEMLOCK_BYTES = 64 << 20


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


def check_shm(
    ranks: int, shm_dir: str = "/dev/shm", free: int | None = None, total: int | None = None
) -> list[Check]:
    """Room for the shm transport's segments (one per rank) and for DataLoader batches."""
    if free is None or total is None:
        try:
            stat = os.statvfs(shm_dir)
        except OSError as exc:
            return [
                Check(
                    "/dev/shm",
                    "fail",
                    f"{shm_dir} is not usable ({exc})",
                    "mount a tmpfs there (containers: docker run --shm-size=2g, or --ipc=host)",
                )
            ]
        free = free_bytes(shm_dir) if free is None else free
        total = stat.f_blocks * stat.f_frsize if total is None else total
    size = f"{shm_dir}: {_mib(total)}, {_mib(free)} free"
    grow = (
        f"docker run --shm-size={max(2, 2 * total // 2**30 + 1)}g (or --ipc=host); Kubernetes: an emptyDir "
        "volume with medium: Memory mounted at /dev/shm"
    )
    try:
        _, shrunk = plan_layout(max(ranks, 1), DEFAULT_SEGMENT_BYTES, free)
    except ShmSpaceError as exc:
        return [
            Check(
                "/dev/shm",
                "fail",
                f"{size}; the shm transport cannot start {ranks} ranks: "
                f"{str(exc).split('] ', 1)[-1].split(':')[0]}",
                f"{grow}; or use --backend gloo",
            )
        ]
    if shrunk:
        return [
            Check(
                "/dev/shm", "warn", f"{size}; shm segments for {ranks} ranks shrink (lower bandwidth)", grow
            )
        ]
    if total < LOADER_SHM_BYTES:
        return [
            Check(
                "/dev/shm",
                "warn",
                f"{size}; DataLoader workers pass batches through it and die with 'bus error' when it fills",
                grow,
            )
        ]
    return [Check("/dev/shm", "pass", f"{size}; enough for {ranks} shm ranks and data loaders")]


def check_open_files(ranks: int, limit: int | None = None) -> list[Check]:
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0] if limit is None else limit
    need = FILES_PER_RANK * max(ranks, 1)
    shown = "unlimited" if soft == resource.RLIM_INFINITY else str(soft)
    if soft != resource.RLIM_INFINITY and soft < need:
        return [
            Check(
                "open files",
                "warn",
                f"ulimit -n is {shown}; {ranks} ranks with data loaders may need {need}",
                f"ulimit -n {need} (or raise nofile in /etc/security/limits.conf / the container's --ulimit)",
            )
        ]
    return [Check("open files", "pass", f"ulimit -n is {shown}")]


def check_locked_memory(limit: int | None = None, rdma: bool | None = None) -> list[Check]:
    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0] if limit is None else limit
    rdma = (
        os.path.isdir("/sys/class/infiniband") and bool(os.listdir("/sys/class/infiniband"))
        if rdma is None
        else rdma
    )
    shown = "unlimited" if soft == resource.RLIM_INFINITY else _mib(soft)
    if rdma and soft != resource.RLIM_INFINITY and soft < MEMLOCK_BYTES:
        return [
            Check(
                "locked memory",
                "fail",
                f"ulimit -l is {shown} and InfiniBand/RoCE devices are present: "
                "NCCL/MPI cannot register buffers",
                "ulimit -l unlimited (containers: --ulimit memlock=-1)",
            )
        ]
    return [
        Check(
            "locked memory",
            "pass",
            f"ulimit -l is {shown}" + ("" if rdma else " (no RDMA devices: not needed)"),
        )
    ]


def check_cores(ranks: int, cores: int | None = None) -> list[Check]:
    cores = available_cores() if cores is None else cores
    if ranks > cores:
        return [
            Check(
                "cores",
                "warn",
                f"{ranks} ranks share {cores} cores: ranks spin and steal each other's time",
                f"use -np {cores} or fewer; benchmarks on oversubscribed cores measure the scheduler",
            )
        ]
    return [Check("cores", "pass", f"{cores} cores for {ranks} ranks")]
