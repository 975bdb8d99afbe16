"""What the α-β-γ cost model predicts for a scaling study: compute that divides plus a collective that grows.

T_model(n) = C(n) + A(n), where C is the measured compute time of the baseline scale n0 (its wall time
minus its communication time) divided by n/n0 for strong scaling and kept constant for weak scaling, and
A(n) is the cost model's prediction for an all_reduce of the workload's payload on n ranks with
the algorithm the model itself would choose, priced with the calibration measured nearest n ranks
(``Calibration.for_world``: contention for cores changes α with n). The gap between this line and the
measurements is what the model does not know: launch overheads, imbalance, contention for cores.
"""

from __future__ import annotations

from collections.abc import Sequence

from meshwise.comm.algorithms.choice import choose_algorithm
from meshwise.comm.algorithms.registry import predict_seconds
from meshwise.comm.cost import Calibration
from meshwise.scale.metrics import ScalePoint


def predicted_times(
    mode: str, points: Sequence[ScalePoint], comm_bytes: int, calibration: Calibration
) -> list[float]:
    """Model wall time per point, priced with ``calibration`` (the caller names it: no file is implied)."""

    def comm(ranks: int) -> float:
        if ranks == 1:
            return 0.0
        algo = choose_algorithm("all_reduce", comm_bytes, ranks, calibration)
        world = calibration.for_world(ranks)
        link = world.native if algo == "native" else world.intra
        return predict_seconds("all_reduce", algo, comm_bytes, ranks, link)

    base = points[0]
    measured_comm = (
        (base.comm_fraction or 0.0) * base.wall_seconds if base.comm_fraction is not None else None
    )
    compute = base.wall_seconds - (measured_comm if measured_comm is not None else comm(base.ranks))
    compute = max(compute, 0.0)
    times = []
    for point in points:
        share = compute * base.ranks / point.ranks if mode == "strong" else compute
        times.append(share + comm(point.ranks))
    return times
