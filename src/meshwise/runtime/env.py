"""Launch environment detection: who started this process, and where does it sit in the job.

A pure function of an environment mapping, so every launcher's contract is unit-testable without
processes. Precedence when several launchers' variables are present:

1. **torchrun** (RANK / LOCAL_RANK): it runs *inside* srun and mpirun allocations and rewrites the
   layout, so the outer launcher's variables describe torchrun's agent, not this worker.
2. **Open MPI** (OMPI_COMM_WORLD_*): mpirun inside an sbatch allocation inherits the batch step's
   SLURM_PROCID=0 on every rank, so SLURM variables must not win over it.
3. **PMI / PMIx** (PMI_RANK, PMIX_RANK, PMI_SIZE, MPI_LOCALRANKID): MPICH/Hydra, Intel MPI, PMIx
   servers. When srun is the PMI server (``srun --mpi=pmix``) its own variables agree and add the node
   list and job id; the layout is then reported as ``slurm``.
4. **SLURM task** (SLURM_PROCID ... inside an srun step, i.e. SLURM_STEP_ID set). The batch script itself
   (no step) is one process, not rank 0 of the allocation.
5. **local**: nothing set, a single process.

Variables that several launchers can describe (a rank in two families, a user-exported WORLD_SIZE as in
the common sbatch recipe) must agree, or :class:`LaunchEnvError` names both. MASTER_ADDR / MASTER_PORT,
when exported, always win; otherwise SLURM jobs rendezvous on the first host of the node list and on
port ``29500 + job_id % 20000`` (29500-49499), so every task of a job derives the same port and two jobs
sharing a node rarely collide.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from meshwise.runtime.hostlist import HostlistError, expand_hostlist, expand_task_counts

#: first port of the job-id derived range, and its width: ports 29500..49499.
JOB_PORT_BASE = 29500
JOB_PORT_SPAN = 20000


class LaunchEnvError(ValueError):
    """The launcher's variables are incomplete, conflicting or out of range."""


#: ``meshwise run`` gives its workers TORCHELASTIC_RUN_ID values with this prefix; a torchrun started
#: inside them sets its own, so the prefix tells who really started a torchrun-contract rank.
MESHWISE_RUN_ID_PREFIX = "meshwise-"


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, as its launcher described it."""

    launcher: str  # "torchrun" | "openmpi" | "pmi" | "slurm" | "local"
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    master_addr: str | None
    master_port: int | None
    job_id: str | None = None
    restart_count: int = 0
    #: False when the launcher did not say which ranks share a node (PMI without MPI_LOCAL* variables):
    #: local_rank/local_world_size are placeholders until the MPI bootstrap groups ranks by host name.
    local_layout_known: bool = True
    #: nodes in the job when the launcher says so (SLURM's node list, torchrun's GROUP_WORLD_SIZE, the MPI
    #: bootstrap's host names); None when only the local world size hints at it.
    node_count: int | None = None
    #: the program that started the ranks when it is not the one whose contract they follow
    #: (``meshwise run`` speaks torchrun's): messages name it, logic keys on ``launcher``.
    started_by: str | None = None

    @property
    def launcher_name(self) -> str:
        """Who started the ranks, for messages: "meshwise run", "torchrun", "openmpi", …"""
        return self.started_by or self.launcher

    @property
    def num_nodes(self) -> int:
        """Nodes in the job: as the launcher said, else assuming equal ranks per node (uneven SLURM
        layouts such as ``2(x2),1`` are why the launcher's word wins)."""
        if self.node_count is not None:
            return self.node_count
        return max(1, -(-self.world_size // self.local_world_size))


def job_port(job_id: str) -> int:
    """The rendezvous port every task of a job derives from its id (29500 + id % 20000)."""
    digits = "".join(c for c in job_id if c.isdigit())
    if not digits:
        raise LaunchEnvError(f"job id {job_id!r} has no digits to derive a port from; export MASTER_PORT")
    return JOB_PORT_BASE + int(digits) % JOB_PORT_SPAN


def resolve_ipv4(host: str) -> str:
    """``host`` as a dotted IPv4 address, so the rendezvous never picks an unreachable IPv6 route."""
    try:
        infos = socket.getaddrinfo(host, None, family=socket.AF_INET, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise LaunchEnvError(
            f"MASTER_ADDR {host!r} does not resolve to an IPv4 address ({exc}); export MASTER_ADDR as an "
            "IPv4 address reachable from every node"
        ) from None
    return str(infos[0][4][0])


def _int(env: Mapping[str, str], name: str) -> int:
    value = env[name]
    try:
        return int(value)
    except ValueError:
        raise LaunchEnvError(f"{name}={value!r} is not an integer") from None


def _opt_int(env: Mapping[str, str], name: str) -> int | None:
    return _int(env, name) if name in env else None


def _first(env: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    return next((n for n in names if n in env), None)


def _require(env: Mapping[str, str], launcher: str, names: tuple[str, ...]) -> None:
    missing = [n for n in names if n not in env]
    if missing:
        present = [n for n in names if n in env]
        raise LaunchEnvError(
            f"{launcher} variables are incomplete: {', '.join(present) or 'none'} set but "
            f"{', '.join(missing)} missing"
        )


def _agree(env: Mapping[str, str], names: tuple[str, ...], what: str) -> int | None:
    """The common value of ``names`` that are set; an error naming both when two disagree."""
    seen = [(n, _int(env, n)) for n in names if n in env]
    for name, value in seen[1:]:
        if value != seen[0][1]:
            raise LaunchEnvError(
                f"conflicting {what}: {seen[0][0]}={seen[0][1]} but {name}={value}; unset the stale one "
                "(a launcher's variables leaked into another launcher's job)"
            )
    return seen[0][1] if seen else None


def _master(env: Mapping[str, str], default_addr: str | None = None) -> tuple[str | None, int | None]:
    """Exported MASTER_ADDR / MASTER_PORT, which win over anything a launcher's layout implies."""
    return env.get("MASTER_ADDR") or default_addr, _opt_int(env, "MASTER_PORT")


def _validate(layout: LaunchEnv, env: Mapping[str, str]) -> LaunchEnv:
    where = f"{layout.launcher_name} layout"
    if layout.world_size < 1:
        raise LaunchEnvError(f"{where}: world size {layout.world_size} must be at least 1")
    if not 0 <= layout.rank < layout.world_size:
        raise LaunchEnvError(f"{where}: rank {layout.rank} is outside 0..{layout.world_size - 1}")
    if not 1 <= layout.local_world_size <= layout.world_size:
        raise LaunchEnvError(
            f"{where}: local world size {layout.local_world_size} must be within 1..{layout.world_size}"
        )
    if not 0 <= layout.local_rank < layout.local_world_size:
        raise LaunchEnvError(
            f"{where}: local rank {layout.local_rank} is outside 0..{layout.local_world_size - 1}"
        )
    if not 0 <= layout.node_rank < layout.num_nodes:
        raise LaunchEnvError(f"{where}: node rank {layout.node_rank} is outside 0..{layout.num_nodes - 1}")
    if layout.master_port is not None and not 0 < layout.master_port < 65536:
        raise LaunchEnvError(f"{where}: master port {layout.master_port} is outside 1..65535")
    exported = _opt_int(env, "WORLD_SIZE")
    if layout.launcher != "torchrun" and exported is not None and exported != layout.world_size:
        raise LaunchEnvError(
            f"{where}: WORLD_SIZE={exported} was exported but the launcher started {layout.world_size} "
            "ranks; export WORLD_SIZE to match (e.g. WORLD_SIZE=$SLURM_NTASKS) or unset it"
        )
    return layout


def _torchrun(env: Mapping[str, str]) -> LaunchEnv:
    _require(env, "torchrun", ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    world = _int(env, "WORLD_SIZE")
    missing = [n for n in ("MASTER_ADDR", "MASTER_PORT") if n not in env]
    if world > 1 and missing:
        raise LaunchEnvError(
            f"torchrun variables are incomplete: WORLD_SIZE={world} (several ranks must meet) but "
            f"{', '.join(missing)} missing"
        )
    local_world = _int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else world
    rank = _int(env, "RANK")
    ours = env.get("TORCHELASTIC_RUN_ID", "").startswith(MESHWISE_RUN_ID_PREFIX)
    return LaunchEnv(
        launcher="torchrun",
        started_by="meshwise run" if ours else None,
        rank=rank,
        local_rank=_int(env, "LOCAL_RANK"),
        world_size=world,
        local_world_size=local_world,
        node_rank=_int(env, "GROUP_RANK") if "GROUP_RANK" in env else rank // max(1, local_world),
        master_addr=env.get("MASTER_ADDR"),
        master_port=_opt_int(env, "MASTER_PORT"),
        job_id=env.get("TORCHELASTIC_RUN_ID"),
        restart_count=_opt_int(env, "TORCHELASTIC_RESTART_COUNT") or 0,
        node_count=_opt_int(env, "GROUP_WORLD_SIZE"),
    )


def _openmpi(env: Mapping[str, str]) -> LaunchEnv:
    names = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK")
    _require(env, "Open MPI", names)
    rank = _agree(env, ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"), "ranks") or 0
    world = _int(env, "OMPI_COMM_WORLD_SIZE")
    local_world = _opt_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE")
    if local_world is None:
        local_world = world
    elif local_world < 1:
        raise LaunchEnvError(f"Open MPI layout: OMPI_COMM_WORLD_LOCAL_SIZE={local_world} must be at least 1")
    addr, port = _master(env)
    return LaunchEnv(
        launcher="openmpi",
        rank=rank,
        local_rank=_int(env, "OMPI_COMM_WORLD_LOCAL_RANK"),
        world_size=world,
        local_world_size=local_world,
        node_rank=rank // local_world,  # block mapping, mpirun's default (--map-by slot)
        master_addr=addr,
        master_port=port,
        job_id=env.get("PMIX_NAMESPACE") or env.get("OMPI_MCA_orte_ess_jobid"),
    )


def _slurm_step(env: Mapping[str, str]) -> bool:
    return "SLURM_PROCID" in env and _first(env, ("SLURM_STEP_ID", "SLURM_STEPID")) is not None


def _slurm(env: Mapping[str, str]) -> LaunchEnv:
    nodelist_var = _first(env, ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"))
    counts_var = _first(env, ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"))
    ntasks_var = _first(env, ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"))
    found = {
        "SLURM_JOB_NODELIST": nodelist_var,
        "SLURM_TASKS_PER_NODE": counts_var,
        "SLURM_NTASKS": ntasks_var,
    }
    missing = [name for name, var in found.items() if var is None]
    missing += [name for name in ("SLURM_LOCALID", "SLURM_NODEID", "SLURM_JOB_ID") if name not in env]
    if missing or nodelist_var is None or counts_var is None or ntasks_var is None:
        raise LaunchEnvError(
            f"SLURM variables are incomplete: SLURM_PROCID set (an srun task) but {', '.join(missing)} "
            "missing"
        )
    try:
        hosts = expand_hostlist(env[nodelist_var])
        counts = expand_task_counts(env[counts_var])
    except HostlistError as exc:
        raise LaunchEnvError(f"SLURM layout: {exc}") from None
    world = _int(env, ntasks_var)
    node = _int(env, "SLURM_NODEID")
    if len(counts) != len(hosts):
        raise LaunchEnvError(
            f"SLURM layout: {counts_var}={env[counts_var]!r} covers {len(counts)} nodes but "
            f"{nodelist_var} names {len(hosts)}"
        )
    if sum(counts) != world:
        raise LaunchEnvError(
            f"SLURM layout: {counts_var}={env[counts_var]!r} sums to {sum(counts)} tasks but "
            f"{ntasks_var}={world}"
        )
    if not 0 <= node < len(hosts):
        raise LaunchEnvError(f"SLURM layout: SLURM_NODEID={node} is outside 0..{len(hosts) - 1}")
    job = env["SLURM_JOB_ID"]
    addr, port = _master(env, hosts[0])
    return LaunchEnv(
        launcher="slurm",
        rank=_int(env, "SLURM_PROCID"),
        local_rank=_int(env, "SLURM_LOCALID"),
        world_size=world,
        local_world_size=counts[node],
        node_rank=node,
        master_addr=addr,
        master_port=port if port is not None else job_port(job),
        job_id=job,
        restart_count=_opt_int(env, "SLURM_RESTART_COUNT") or 0,
        node_count=len(hosts),
    )


def _pmi(env: Mapping[str, str]) -> LaunchEnv:
    rank = _agree(env, ("PMI_RANK", "PMIX_RANK"), "ranks")
    if rank is None:
        raise LaunchEnvError(
            "PMI variables are incomplete: PMI_SIZE set but PMI_RANK (or PMIX_RANK) missing; unset the "
            "stale PMI_SIZE, or start the job with mpiexec/srun"
        )
    if _slurm_step(env):
        layout = _slurm(env)
        if layout.rank == rank and _opt_int(env, "PMI_SIZE") in (None, layout.world_size):
            return layout  # srun is the PMI server: its variables add the node list and job id
    size_var = _first(env, ("PMI_SIZE", "WORLD_SIZE"))
    if size_var is None:
        raise LaunchEnvError(
            "PMI variables are incomplete: PMIX_RANK/PMI_RANK set but PMI_SIZE missing (PMIx does not export "
            "the world size); launch with mpiexec/srun, or export WORLD_SIZE"
        )
    world = _int(env, size_var)
    local_rank = _opt_int(env, "MPI_LOCALRANKID")
    local_world = _opt_int(env, "MPI_LOCALNRANKS")
    if local_world is not None and local_world < 1:
        raise LaunchEnvError(f"PMI layout: MPI_LOCALNRANKS={local_world} must be at least 1")
    if local_rank is None and local_world is not None:
        local_rank = rank % local_world  # block mapping
    if local_rank is not None and local_world is None:
        raise LaunchEnvError(
            "PMI variables are incomplete: MPI_LOCALRANKID set but MPI_LOCALNRANKS missing; set both, or "
            "neither (then the MPI bootstrap groups ranks by host name)"
        )
    known = local_world is not None or world == 1
    if local_rank is None or local_world is None:  # alone, or a placeholder until the MPI bootstrap
        local_rank, local_world = 0, 1
    addr, port = _master(env)
    return LaunchEnv(
        launcher="pmi",
        rank=rank,
        local_rank=local_rank,
        world_size=world,
        local_world_size=local_world,
        node_rank=rank // local_world,
        master_addr=addr,
        master_port=port,
        job_id=env.get("PMIX_NAMESPACE") or env.get("PMI_JOBID"),
        local_layout_known=known,
    )


def _local(env: Mapping[str, str]) -> LaunchEnv:
    """One process: it needs no rendezvous, so stray MASTER_* variables are not used."""
    return LaunchEnv("local", 0, 0, 1, 1, 0, None, None, job_id=env.get("SLURM_JOB_ID"))


def detect_launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """The layout described by ``environ`` (default: this process's environment)."""
    env = os.environ if environ is None else environ
    if "RANK" in env or "LOCAL_RANK" in env:
        return _validate(_torchrun(env), env)
    if any(name.startswith("OMPI_COMM_WORLD_") for name in env):
        return _validate(_openmpi(env), env)
    if any(name in env for name in ("PMI_RANK", "PMIX_RANK", "PMI_SIZE")):
        return _validate(_pmi(env), env)
    if _slurm_step(env):
        return _validate(_slurm(env), env)
    return _validate(_local(env), env)


#: launchers whose ranks can join an MPI job (mpirun/mpiexec of Open MPI, srun or hydra through PMI)
MPI_LAUNCHERS = ("openmpi", "pmi")


def check_mpi_launch(command: str, environ: Mapping[str, str] | None = None) -> None:
    """Refuse ``--backend mpi`` in a process no MPI launcher started, *before* MPI is initialised: a
    singleton MPI_Init would fail with a traceback and leave Open MPI's shared-memory files behind."""
    if detect_launch_env(environ).launcher not in MPI_LAUNCHERS:
        raise ValueError(
            "--backend mpi needs ranks started by an MPI launcher, e.g. "
            f"`mpirun -np 4 meshwise {command} --backend mpi`; without one use --backend gloo or shm"
        )


@dataclass(frozen=True)
class RankPlan:
    """Where a ``-np``-taking command runs: on ranks a launcher already started, or on ranks it spawns."""

    world_size: int
    launched: bool  # True: this process is one of the launcher's ranks; False: spawn world_size locally
    layout: LaunchEnv


def plan_ranks(requested: int | None, default: int, environ: Mapping[str, str] | None = None) -> RankPlan:
    """Reconcile a command's ``-np`` with the launcher's layout: ``-np`` must agree with it or be omitted."""
    layout = detect_launch_env(environ)
    if layout.launcher != "local" or layout.world_size > 1:
        if requested not in (None, layout.world_size):
            raise ValueError(
                f"-np {requested} conflicts with the {layout.world_size} ranks {layout.launcher_name} "
                "started; drop -np when running under a launcher"
            )
        return RankPlan(layout.world_size, True, layout)
    if requested is not None and requested < 1:
        raise ValueError(f"-np must be at least 1, got {requested}")
    return RankPlan(requested or default, False, layout)
