"""``meshwise run``: torchrun-compatible launcher (one per node) with fail-fast teardown, or a SLURM script.

meshwise run -np 4 train.py --epochs 3          # 4 local workers, output prefixed [rank N]
meshwise run -n 2 --max-restarts 2 train.py      # restart the whole group up to twice
meshwise run -np 4 --debug train.py              # check every collective across ranks (mismatches)
meshwise run --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 -np 4 train.py   # node 1: --node-rank 1
meshwise run --print-sbatch --nnodes 2 -np 4 --gpus-per-node 4 train.py > job.sbatch
"""

from __future__ import annotations

import argparse
import sys

from meshwise.runtime.launch import LaunchConfigError, launch, python_command
from meshwise.runtime.sbatch import SBATCH_MODES, SbatchSpec, render_sbatch


def add_parser(subparsers: argparse._SubParsersAction, name: str, help_text: str) -> None:
    parser = subparsers.add_parser(
        name,
        help=help_text,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Start N workers with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, "
        "LOCAL_WORLD_SIZE,\nMASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT); when one fails, stop "
        "all and name it.",
        epilog="examples:\n" + __doc__.split("\n\n")[1],
    )
    # torchrun's spellings (--nproc-per-node, --node_rank, ...) are accepted too, so that replacing
    # `torchrun` by `meshwise run` in an existing command line just works.
    parser.add_argument(
        "-np",
        "-n",
        "--nproc",
        "--nproc-per-node",
        "--nproc_per_node",
        dest="nprocs",
        type=int,
        default=1,
        metavar="N",
        help="worker processes on this node (default 1)",
    )
    parser.add_argument("--nnodes", type=int, default=1, help="nodes in the job (default 1)")
    parser.add_argument(
        "--node-rank", "--node_rank", type=int, default=0, help="this node's index, 0..nnodes-1"
    )
    parser.add_argument(
        "--master-addr", "--master_addr", help="address of node 0 (default 127.0.0.1 on one node)"
    )
    parser.add_argument(
        "--master-port",
        "--master_port",
        type=int,
        help="rendezvous port (default: a free port on one node, 29500 on several)",
    )
    parser.add_argument(
        "--max-restarts",
        "--max_restarts",
        type=int,
        default=0,
        help="restart every worker (of every node) up to K times when one fails",
    )
    parser.add_argument(
        "--timeout", type=float, help="terminate the workers after this many seconds (exit 124)"
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        help="debug mode: check every collective across ranks before it runs (meshwise.init(debug=True))",
    )
    parser.add_argument(
        "--flight-dir",
        metavar="DIR",
        help="where ranks dump their flight records and the merged hang report goes "
        "(default: a temporary directory, kept only when a report was written)",
    )
    parser.add_argument("-m", "--module", action="store_true", help="SCRIPT is a module name (python -m)")
    parser.add_argument("--no-python", action="store_true", help="SCRIPT is an executable, not Python")
    parser.add_argument("--no-prefix", action="store_true", help="do not prefix output lines with [rank N]")
    sbatch = parser.add_argument_group("batch script (--print-sbatch: print it instead of running)")
    sbatch.add_argument("--print-sbatch", action="store_true", help="print a SLURM batch script and exit")
    sbatch.add_argument(
        "--sbatch-mode",
        choices=SBATCH_MODES,
        default="tasks",
        help="tasks: one srun task per GPU; torchrun: one torchrun per node",
    )
    sbatch.add_argument("--gpus-per-node", type=int, help="GPUs per node (default: -np; 0 for CPU jobs)")
    sbatch.add_argument("--cpus-per-task", type=int, default=8, help="CPU cores per worker (default 8)")
    sbatch.add_argument("--time", default="01:00:00", help="wall-time limit (default 01:00:00)")
    sbatch.add_argument("--partition", help="SLURM partition")
    sbatch.add_argument("--account", help="SLURM account")
    sbatch.add_argument("--job-name", default="meshwise", help="SLURM job name (default meshwise)")
    parser.add_argument("script", metavar="SCRIPT", help="Python script (or module with -m) to run")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="arguments for SCRIPT")
    parser.set_defaults(func=handler)


def _print_sbatch(args: argparse.Namespace) -> int:
    spec = SbatchSpec(
        script=args.script,
        args=tuple(args.script_args),
        module=args.module,
        python=not args.no_python,
        nodes=args.nnodes,
        tasks_per_node=args.nprocs,
        gpus_per_node=args.nprocs if args.gpus_per_node is None else args.gpus_per_node,
        cpus_per_task=args.cpus_per_task,
        time=args.time,
        job_name=args.job_name,
        partition=args.partition,
        account=args.account,
        mode=args.sbatch_mode,
    )
    sys.stdout.write(render_sbatch(spec))
    return 0


def handler(args: argparse.Namespace) -> int:
    try:
        if args.print_sbatch:
            return _print_sbatch(args)
        if args.no_python:
            if args.module:
                raise LaunchConfigError(
                    "-m (a Python module) and --no-python (an executable) exclude each other"
                )
            cmd = [args.script, *args.script_args]
        else:
            cmd = python_command(args.script, args.script_args, module=args.module)
        return launch(
            cmd,
            args.nprocs,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            master_addr=args.master_addr,
            master_port=args.master_port,
            max_restarts=args.max_restarts,
            timeout=args.timeout,
            prefix_output=not args.no_prefix,
            debug=args.debug,
            flight_dir=args.flight_dir,
        )
    except ValueError as exc:  # LaunchConfigError included: refused before anything started
        print(f"meshwise run: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the command itself could not be started
        print(f"meshwise run: error: cannot start {args.script!r}: {exc}", file=sys.stderr)
        return 127
