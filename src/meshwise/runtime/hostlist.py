"""SLURM's compressed list notations, expanded without calling ``scontrol``.

``SLURM_JOB_NODELIST`` names the allocation's hosts as ``node[01-04,07],gpu-a[1-2]-b[3,5]``: hosts
separated by commas (or, as SLURM also accepts, spaces and tabs; repeated separators count as one), each
with any number of bracketed ranges whose zero padding is part of the name.
``SLURM_TASKS_PER_NODE`` counts tasks per host as ``2(x3),1`` (2 tasks on each of 3 hosts, then 1).
Both are needed to find the master host and the local world size from the environment alone, on a
compute node where ``scontrol`` may not even be installed.
"""

from __future__ import annotations

import re
from itertools import product

#: hosts per list accepted before we suspect a typo such as ``node[1-1000000]``.
MAX_HOSTS = 1_000_000

_COUNT = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


class HostlistError(ValueError):
    """A host list or task-count list that SLURM would not have written."""


#: what separates hosts outside brackets (SLURM's hostlist_create uses the same three).
_SEPARATORS = ", \t"


def _split_top_level(text: str) -> list[str]:
    """Split on separators that are not inside brackets, dropping empty pieces as SLURM does."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            if depth:
                raise HostlistError(f"nested '[' at position {i} in host list {text!r}")
            depth = 1
        elif char == "]":
            if not depth:
                raise HostlistError(f"']' without '[' at position {i} in host list {text!r}")
            depth = 0
        elif char in _SEPARATORS and not depth:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise HostlistError(f"unclosed '[' in host list {text!r}")
    parts.append(text[start:])
    return [part for part in parts if part]


def _expand_range(spec: str, where: str) -> list[str]:
    """``01-04,07`` → ``01 02 03 04 07``: the width of the lower bound is kept as zero padding."""
    values: list[str] = []
    for item in spec.split(","):
        low, sep, high = item.partition("-")
        if not low.isdigit() or (sep and not high.isdigit()):
            raise HostlistError(f"range {item!r} in {where!r} is not N or N-M with decimal N, M")
        if not sep:
            values.append(low)
            continue
        start, stop = int(low), int(high)
        if stop < start:
            raise HostlistError(f"range {item!r} in {where!r} runs backwards; write {high}-{low}")
        width = len(low) if low.startswith("0") else 1
        values.extend(str(n).zfill(width) for n in range(start, stop + 1))
    return values


def _expand_host(pattern: str) -> list[str]:
    """One host pattern with any number of bracketed ranges → the cartesian product of its names."""
    pieces: list[list[str]] = []
    rest = pattern
    while rest:
        head, bracket, tail = rest.partition("[")
        if head:
            pieces.append([head])
        if not bracket:
            break
        body, closed, rest = tail.partition("]")
        if not closed or not body:
            raise HostlistError(f"empty or unclosed bracket in host {pattern!r}")
        pieces.append(_expand_range(body, pattern))
    count = 1
    for piece in pieces:
        count *= len(piece)
    if count > MAX_HOSTS:
        raise HostlistError(f"host pattern {pattern!r} expands to {count} names (limit {MAX_HOSTS})")
    return ["".join(parts) for parts in product(*pieces)]


def expand_hostlist(text: str) -> list[str]:
    """Every host named by a SLURM host list, in order: ``node[01-02],gpu7`` → node01, node02, gpu7."""
    parts = _split_top_level(text.strip())
    if not parts:
        raise HostlistError(f"host list {text!r} names no host")
    hosts: list[str] = []
    for part in parts:
        hosts.extend(_expand_host(part))
    return hosts


def expand_task_counts(text: str) -> list[int]:
    """``2(x3),1`` → [2, 2, 2, 1]: tasks on each host, in host-list order."""
    counts: list[int] = []
    for part in text.strip().split(","):
        match = _COUNT.match(part.strip())
        if match is None:
            raise HostlistError(f"task count {part!r} in {text!r} is not N or N(xK)")
        value, repeat = int(match.group(1)), int(match.group(2) or 1)
        if value < 1 or repeat < 1:
            raise HostlistError(f"task count {part!r} in {text!r} must be positive")
        counts.extend([value] * repeat)
    return counts
