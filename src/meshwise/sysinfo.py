"""What this process can see, gathered without joining a job: the facts behind ``meshwise info``.

Everything here is read-only and bounded: no process group is created, MPI is not initialised (importing
``mpi4py.MPI`` would call MPI_Init), and ``nvidia-smi`` gets a timeout. A failing probe becomes a
string in the report rather than an exception, because ``info`` is what users run when things are
already broken.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import shutil
import subprocess
from typing import Any

import torch
import torch.distributed as dist

from meshwise.comm.cost import DEFAULT_FILE, Calibration
from meshwise.comm.factory import transport_levels
from meshwise.runtime.cores import available_cores
from meshwise.runtime.env import LaunchEnvError, detect_launch_env
from meshwise.world import pick_device, resolve_backend

_NVIDIA_SMI_TIMEOUT = 10.0


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _devices() -> list[dict[str, Any]]:
    devices: list[dict[str, Any]] = [
        {"device": "cpu", "name": _cpu_model(), "cores": available_cores(), "memory_bytes": _memory_bytes()}
    ]
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            devices.append(
                {
                    "device": f"cuda:{index}",
                    "name": props.name,
                    "memory_bytes": props.total_memory,
                    "capability": f"{props.major}.{props.minor}",
                    "multiprocessors": props.multi_processor_count,
                }
            )
    return devices


def _mpi_note(found: bool) -> str:
    """mpi4py's version and the mpirun on PATH, without initialising MPI (importing mpi4py.MPI would)."""
    if not found:
        return "pip install 'meshwise[mpi]' (mpi4py + Open MPI wheel) or mpi4py for your system MPI"
    mpirun = shutil.which("mpirun") or shutil.which("mpiexec") or "no mpirun/mpiexec on PATH"
    return f"mpi4py {importlib.metadata.version('mpi4py')} (not initialised here); {mpirun}"


def _backends() -> dict[str, dict[str, Any]]:
    cuda = torch.cuda.is_available()
    mpi4py = importlib.util.find_spec("mpi4py") is not None
    return {
        "gloo": {"available": dist.is_gloo_available(), "note": "CPU tensors; any machine"},
        "nccl": {
            "available": dist.is_nccl_available() and cuda,
            "note": "CUDA tensors" if dist.is_nccl_available() else "this torch build has no NCCL",
        },
        "shm": {
            "available": os.path.isdir("/dev/shm"),
            "note": "single-node shared memory" if os.path.isdir("/dev/shm") else "no /dev/shm",
        },
        "mpi": {"available": mpi4py, "note": _mpi_note(mpi4py)},
        "shm+gloo": {
            "available": os.path.isdir("/dev/shm") and dist.is_gloo_available(),
            "note": "several nodes: shared memory inside each, gloo between",
        },
    }


def _topology() -> str | None:
    """``nvidia-smi topo -m`` (NVLink/PCIe paths between GPUs and NICs), when the tool exists."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        done = subprocess.run(
            [exe, "topo", "-m"], capture_output=True, text=True, timeout=_NVIDIA_SMI_TIMEOUT, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"nvidia-smi topo -m failed: {exc}"
    return (
        done.stdout.rstrip() if done.returncode == 0 else f"nvidia-smi topo -m failed: {done.stderr.strip()}"
    )


def _shm() -> dict[str, Any] | None:
    try:
        usage = shutil.disk_usage("/dev/shm")
    except OSError:
        return None
    return {"path": "/dev/shm", "total_bytes": usage.total, "free_bytes": usage.free}


def _calibration(path: str | None) -> dict[str, Any]:
    """Which calibration ``algo="auto"`` prices with given ``--calibration-file path`` (the built-in one
    without), and whether ``meshwise bench --calibrate`` has written its default file, which is only
    used when named."""
    default = DEFAULT_FILE.expanduser()
    found = {"calibrate_writes": str(default), "calibrate_file_exists": default.exists()}
    try:
        return {"source": Calibration.from_option(path).source, **found}
    except (OSError, ValueError) as exc:
        return {"error": str(exc), **found}


def collect(calibration_file: str | None = None) -> dict[str, Any]:
    """The whole report as plain data (what ``meshwise info --json`` prints)."""
    report: dict[str, Any] = {
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "platform": platform.platform(),
        },
        "host": platform.node(),
    }
    try:
        layout = detect_launch_env()
    except LaunchEnvError as exc:
        report["launch"] = {"error": str(exc)}
        layout = None
    else:
        report["launch"] = {
            "launcher": layout.launcher,
            "rank": layout.rank,
            "local_rank": layout.local_rank,
            "world_size": layout.world_size,
            "local_world_size": layout.local_world_size,
            "node_rank": layout.node_rank,
            "num_nodes": layout.num_nodes,
            "master_addr": layout.master_addr,
            "master_port": layout.master_port,
            "job_id": layout.job_id,
            "restart_count": layout.restart_count,
        }
    report["backends"] = _backends()
    if layout is not None:
        try:
            device = pick_device(layout)
            backend = resolve_backend(
                "auto",
                device,
                layout.world_size,
                single_host=layout.num_nodes == 1,
                ranks_per_node=layout.local_world_size,
            )
            report["auto"] = {
                "device": str(device),
                "backend": backend,
                "levels": transport_levels(backend, layout.num_nodes),
            }
        except (RuntimeError, ValueError) as exc:
            report["auto"] = {"error": str(exc)}
    report["devices"] = _devices()
    report["topology"] = _topology()
    report["shm"] = _shm()
    report["calibration"] = _calibration(calibration_file)
    return report
