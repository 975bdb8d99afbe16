"""Proof that every rank called the same collective with the same dtype, size and root.

Transports such as gloo abort the whole process when a message is larger than the receive posted for it,
so a rank calling all_reduce on 4 elements while its peer passes 8 would die without a word about why.
With ``check_consistency=True`` every collective of an algorithm communicator starts with one small
native all_reduce (MAX of the signature and of its negation gives the range over ranks), and any
disagreement becomes a :class:`CollectiveMismatchError` on every rank, naming what differs.
"""

from __future__ import annotations

import torch

from meshwise.comm.api import SUPPORTED_DTYPES, Collective, CollectiveMismatchError, Communicator, ReduceOp

_COLLECTIVE_CODES = {name: i for i, name in enumerate(Collective)}
_DTYPE_CODES = {dtype: i for i, dtype in enumerate(SUPPORTED_DTYPES)}


def check_agreement(
    comm: Communicator, collective: str, dtype: torch.dtype, size: int = -1, root: int = -1
) -> None:
    """Raise on every rank unless all ranks pass the same arguments (``size=-1``: sizes may differ)."""
    if comm.world_size == 1:
        return
    mine = [_COLLECTIVE_CODES[collective], _DTYPE_CODES[dtype], size, root]
    both = torch.tensor(mine + [-v for v in mine], dtype=torch.int64)
    comm.all_reduce(both, ReduceOp.MAX)
    high, low = both[:4].tolist(), [-v for v in both[4:].tolist()]
    if high != low:
        names = ("collective", "dtype", "size", "root")
        differ = [f"{n} ({lo}..{hi})" for n, lo, hi in zip(names, low, high, strict=True) if lo != hi]
        raise CollectiveMismatchError(
            f"ranks disagree on {', '.join(differ)}; this rank called {collective} with {dtype}, "
            f"size {size}, root {root}",
            rank=comm.rank,
            op=collective,
        )
