"""``meshwise info``: what this process sees (launcher, rank layout, backends, devices, topology, /dev/shm).

Run it plainly to check a machine, or under the launcher (``srun -n 2 meshwise info``, ``meshwise run -n 2
--no-python meshwise info``) to see the layout each rank would get. ``--json`` prints the same as data.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from meshwise.cli.outputs import check_output
from meshwise.sysinfo import collect


def add_parser(subparsers: argparse._SubParsersAction, name: str, help_text: str) -> None:
    parser = subparsers.add_parser(name, help=help_text, description=help_text.capitalize() + ".")
    parser.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="FILE",
        help="write the report as JSON to FILE (default: standard output) instead of the table",
    )
    parser.add_argument(
        "--calibration-file",
        metavar="PATH",
        help="report this cost-model file as the one auto would price with (default: the built-in one)",
    )
    parser.set_defaults(func=handler)


def _size(value: int | None) -> str:
    if value is None:
        return "unknown"
    return f"{value / 2**30:.1f} GiB"


def render(report: dict[str, Any]) -> str:
    """The human-readable report."""
    versions = report["versions"]
    lines = [
        f"host        {report['host']}",
        f"versions    python {versions['python']}, torch {versions['torch']}, "
        f"CUDA {versions['cuda'] or 'none'}",
    ]
    launch = report["launch"]
    if "error" in launch:
        lines.append(f"launcher    ERROR: {launch['error']}")
    else:
        lines.append(
            f"launcher    {launch['launcher']}: rank {launch['rank']} of {launch['world_size']}, "
            f"local rank {launch['local_rank']} of {launch['local_world_size']}, "
            f"node {launch['node_rank']} of {launch['num_nodes']}"
        )
        if launch["master_addr"] or launch["master_port"]:
            lines.append(f"rendezvous  {launch['master_addr']}:{launch['master_port']}")
        if launch["job_id"]:
            lines.append(f"job         {launch['job_id']} (restart {launch['restart_count']})")
    auto = report.get("auto")
    if auto is not None:
        if "error" in auto:
            lines.append(f"auto        ERROR: {auto['error']}")
        else:
            line = f"auto        backend {auto['backend']} on {auto['device']}"
            levels = auto["levels"]
            if levels["inter-node"] != "-":  # several nodes: which transport serves each level
                line += f": intra-node {levels['intra-node']}, inter-node {levels['inter-node']}"
            lines.append(line)
    lines.append("backends")
    for name, entry in report["backends"].items():
        mark = "yes" if entry["available"] else "no "
        lines.append(f"  {name:<6} {mark}  {entry['note']}")
    lines.append("devices")
    for dev in report["devices"]:
        extra = f", {dev['cores']} cores" if "cores" in dev else f", sm {dev['capability']}"
        lines.append(f"  {dev['device']:<8} {dev['name']} ({_size(dev['memory_bytes'])}{extra})")
    shm = report["shm"]
    lines.append(
        f"/dev/shm    {_size(shm['free_bytes'])} free of {_size(shm['total_bytes'])}"
        if shm
        else "/dev/shm    absent"
    )
    cal = report["calibration"]
    if "error" in cal:
        lines.append(f"calibration ERROR: {cal['error']}")
    else:
        written = "present" if cal["calibrate_file_exists"] else "absent"
        lines.append(f"calibration {cal['source']} (what algo=auto prices with)")
        lines.append(
            f"            {cal['calibrate_writes']}: {written} (`bench --calibrate` writes it; read only "
            "when passed as --calibration-file)"
        )
    if report["topology"]:
        lines.append("GPU topology (nvidia-smi topo -m)")
        lines.extend(f"  {line}" for line in report["topology"].splitlines())
    return "\n".join(lines)


def handler(args: argparse.Namespace) -> int:
    try:
        check_output("--json", args.json)
    except ValueError as exc:
        print(f"meshwise info: error: {exc}", file=sys.stderr)
        return 2
    report = collect(args.calibration_file)
    if args.json is None:
        print(render(report))
    elif args.json == "-":
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)
    return 1 if "error" in report["launch"] or "error" in report["calibration"] else 0
