"""The software stack: devices vs ranks, NCCL settings, MPI, versions."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from collections.abc import Mapping

import torch
import torch.distributed as dist

from meshwise.doctor.checks import Check
from meshwise.runtime.cores import available_cores

#: NCCL variables that switch a transport off; right for debugging, slow (or broken) when forgotten.
NCCL_DISABLES = {
    "NCCL_P2P_DISABLE": "GPU peer-to-peer (NVLink/PCIe) is off: intra-node traffic goes through host memory",
    "NCCL_SHM_DISABLE": "the shared-memory transport is off: intra-node traffic goes through the network",
    "NCCL_IB_DISABLE": "InfiniBand/RoCE is off: inter-node traffic falls back to TCP sockets",
    "NCCL_NET_GDR_DISABLE": "GPUDirect RDMA is off: inter-node traffic is staged through host memory",
}
#: NCCL variables that force a choice NCCL normally makes per message size.
NCCL_FORCES = ("NCCL_ALGO", "NCCL_PROTO")
OLDEST_TORCH = (2, 4)


def check_devices(ranks: int, env: Mapping[str, str], visible: int | None = None) -> list[Check]:
    """One GPU per local rank (meshwise binds cuda:LOCAL_RANK), and a CUDA torch where GPUs exist."""
    cuda_build = torch.version.cuda is not None
    visible = (torch.cuda.device_count() if torch.cuda.is_available() else 0) if visible is None else visible
    mask = env.get("CUDA_VISIBLE_DEVICES")
    masked = f" (CUDA_VISIBLE_DEVICES={mask})" if mask is not None else ""
    local = int(env.get("LOCAL_WORLD_SIZE", ranks))
    if visible == 0:
        if shutil.which("nvidia-smi") and not cuda_build:
            return [
                Check(
                    "devices",
                    "warn",
                    "nvidia-smi is present but torch is a CPU build: ranks run on CPU",
                    "install a CUDA build of torch (see pytorch.org) to use the GPUs",
                )
            ]
        return [Check("devices", "pass", f"no visible GPU{masked}: {local} ranks run on CPU (gloo or shm)")]
    if local > visible:
        return [
            Check(
                "devices",
                "fail",
                f"{local} local ranks but {visible} visible GPUs{masked}: ranks would share "
                "a GPU or fail to bind one",
                f"use -np {visible}, or make more GPUs visible (CUDA_VISIBLE_DEVICES)",
            )
        ]
    return [Check("devices", "pass", f"{visible} visible GPUs{masked} for {local} local ranks")]


def check_nccl_env(env: Mapping[str, str]) -> list[Check]:
    found = [
        Check(
            name,
            "warn",
            f"{name}={env[name]}: {why}",
            f"unset {name} unless you are isolating a transport bug",
        )
        for name, why in NCCL_DISABLES.items()
        if env.get(name, "0") not in ("0", "")
    ]
    found += [
        Check(
            name,
            "warn",
            f"{name}={env[name]} forces NCCL's choice for every message size",
            f"unset {name}; NCCL's tuner picks per size",
        )
        for name in NCCL_FORCES
        if env.get(name)
    ]
    if env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING") == "0" or env.get("NCCL_ASYNC_ERROR_HANDLING") == "0":
        found.append(
            Check(
                "NCCL error handling",
                "warn",
                "async error handling is off: a hung collective is never aborted",
                "unset TORCH_NCCL_ASYNC_ERROR_HANDLING",
            )
        )
    return found or [
        Check("NCCL environment", "pass", "no variable disables a transport or forces an algorithm")
    ]


def check_mpi(ranks: int, cores: int | None = None) -> list[Check]:
    """mpi4py and mpirun for --backend mpi; Open MPI refuses more ranks than slots without a flag."""
    has_module = importlib.util.find_spec("mpi4py") is not None
    launcher = shutil.which("mpirun") or shutil.which("mpiexec")
    if not has_module and not launcher:
        return [
            Check("MPI", "pass", "not installed (only needed for --backend mpi: pip install 'meshwise[mpi]')")
        ]
    if not has_module or not launcher:
        missing = "mpi4py" if not has_module else "mpirun"
        return [
            Check(
                "MPI",
                "warn",
                f"{missing} is missing, so --backend mpi and mpirun launches cannot work",
                "pip install 'meshwise[mpi]' (brings mpi4py and Open MPI)",
            )
        ]
    try:
        version = subprocess.run([launcher, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        version = ""
    name = version.splitlines()[0].strip() if version else launcher
    cores = available_cores() if cores is None else cores
    if "Open MPI" in version and ranks > cores:
        return [
            Check(
                "MPI",
                "warn",
                f"{name}: {ranks} ranks on {cores} cores exceed Open MPI's slots",
                f"mpirun --oversubscribe -np {ranks} ... (or -np {cores})",
            )
        ]
    return [Check("MPI", "pass", f"{name} with mpi4py")]


def check_versions() -> list[Check]:
    found = []
    parts = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    cuda = torch.version.cuda or "none (CPU build)"
    text = f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {cuda}"
    if torch.cuda.is_available():
        text += f", NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}"
    if parts < OLDEST_TORCH:
        found.append(
            Check("versions", "fail", text, f"pip install 'torch>={'.'.join(map(str, OLDEST_TORCH))}'")
        )
    elif not dist.is_available() or not dist.is_gloo_available():
        found.append(
            Check(
                "versions",
                "fail",
                text + "; torch.distributed/gloo is missing",
                "install an official torch build (it includes gloo)",
            )
        )
    else:
        found.append(Check("versions", "pass", text + ", gloo available"))
    return found
