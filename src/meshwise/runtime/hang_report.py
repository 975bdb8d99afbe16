"""Merge the ranks' flight-recorder dumps into one report: who is behind, and where.

The report leads with the answer ("ranks 0,1,3 wait in all_reduce #57 at train.py:42; rank 2 never
entered it: its last op was #56 ... at model.py:88"), then each rank's last operations and every
thread's Python stack. It reads the JSON written by :mod:`meshwise.comm.flight_recorder` as plain
data (runtime/ sits below comm/), so it is testable from dictionaries alone.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence

#: operations of each rank shown in the detailed part of the report.
RECENT_OPS = 6

_VERB = {"started": ("waits in", "wait in"), "failed": ("failed in",) * 2, "completed": ("completed",) * 2}


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(map(str, ranks))


def _world(dump: Mapping) -> dict | None:
    """The recorder of the world communicator of one rank's dump (split groups come after it)."""
    for recorder in dump.get("recorders", []):
        if recorder.get("group") == "world":
            return recorder
    return None


def _collectives(dump: Mapping) -> list[dict]:
    world = _world(dump)
    return [r for r in (world or {}).get("records", []) if r.get("seq", 0) > 0]


def _op(record: Mapping) -> str:
    return f"{record['call']} #{record['seq']} at {record['site']}"


def summarize(dumps: Mapping[int, Mapping], ranks: Sequence[int]) -> list[str]:
    """The answer in a few sentences: where each of ``ranks`` stands relative to the furthest collective."""
    last = {r: ops[-1] for r, d in dumps.items() if (ops := _collectives(d))}
    silent = [r for r in ranks if r not in dumps]
    idle = [r for r in dumps if r not in last]
    lines = []
    if last:
        front = max(rec["seq"] for rec in last.values())
        at_front: dict[tuple[str, str], list[int]] = {}
        for rank in sorted(last):
            rec = last[rank]
            if rec["seq"] == front:
                at_front.setdefault((rec["state"], rec["call"]), []).append(rank)
        for (state, _call), ranks in sorted(at_front.items(), key=lambda kv: kv[1]):
            rec = last[ranks[0]]
            verb = _VERB.get(state, (state, state))[len(ranks) > 1]
            line = f"{_ranks(ranks)} {verb} {_op(rec)}"
            if state == "started" and "time" in dumps[ranks[0]]:
                line += f" (for {dumps[ranks[0]]['time'] - rec['started']:.1f} s)"
            if state == "failed" and rec.get("error"):
                line += f" ({rec['error'].split('] ', 1)[-1]})"
            lines.append(line)
        if len(at_front) > 1 and len({call for _, call in at_front}) > 1:
            lines.append(f"the ranks called different operations as collective #{front}: a mismatch")
        for rank in sorted(last):
            rec = last[rank]
            if rec["seq"] < front:
                state = "completed" if rec["state"] == "completed" else rec["state"]
                line = f"rank {rank} never entered collective #{front}: its last op was {_op(rec)} ({state})"
                where = main_thread_line(dumps[rank].get("stacks", ""))
                lines.append(line + (f"; it is now at {where}" if where else ""))
    if idle:
        lines.append(f"{_ranks(idle)} recorded no collective yet")
    if silent:
        lines.append(
            f"{_ranks(silent)} sent no records (exited before meshwise.init, or unresponsive: see stacks)"
        )
    return lines or ["no rank recorded any operation"]


def render(dumps: Mapping[int, Mapping], ranks: Sequence[int], reason: str) -> str:
    """The full report: summary, then each rank's recent operations, dump reason and stacks."""
    out = [f"meshwise flight report — {reason}", ""]
    out += [f"  {line}" for line in summarize(dumps, ranks)]
    for rank in ranks:
        dump = dumps.get(rank)
        out += ["", f"== rank {rank}" + ("" if dump else ": no dump")]
        if not dump:
            continue
        out.append(f"   dumped because: {dump.get('reason', '?')}")
        for recorder in dump.get("recorders", []):
            records = recorder.get("records", [])[-RECENT_OPS:]
            out.append(f"   {recorder['group']} (rank {recorder['rank']} of {recorder['world_size']}):")
            for rec in records:
                took = "" if rec.get("ended") is None else f" {1e3 * (rec['ended'] - rec['started']):.1f} ms"
                label = f"#{rec['seq']}" if rec.get("seq") else "p2p"
                out.append(f"     {label:>6} {rec['state']:<9} {rec['call']} at {rec['site']}{took}")
        stacks = dump.get("stacks", "").rstrip()
        if stacks:
            out.append("   stacks:")
            out += [f"     {line}" for line in stacks.splitlines()]
    return "\n".join(out) + "\n"


def main_thread_line(stacks: str) -> str | None:
    """``x.py:5 in f``: the innermost frame of the thread that runs ``<module>``, below any report
    plumbing.

    faulthandler writes one block per thread, innermost frame first; the main thread's block ends in
    the script's ``<module>`` frame.
    """
    for block in stacks.split("\n\n"):
        frames = re.findall(r'File "(.+)", line (\d+) in (\S+)', block)
        if frames and frames[-1][2] == "<module>":
            where = [f for f in frames if not f[0].endswith(_REPORTING)] or frames
            path, line, function = where[0]
            return f"{os.path.basename(path)}:{line} in {function}"
    return None


#: the files that run only while a report is being made (a job deadline's handler asking for the dumps
#: interrupts the main thread wherever it was): never where a rank *is*.
_REPORTING = tuple(
    os.path.join("meshwise", "runtime", name) for name in ("deadline.py", "flight_dumps.py", "hang_report.py")
)
