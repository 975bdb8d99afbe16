"""``train gpt --profile``'s per-layer memory report: bytes each block saved for backward, measured, beside
the per-layer formula of its recomputation mode (:mod:`meshwise.parallel.recompute.formulas`).

The first profiled step is recorded with saved-tensor hooks (:class:`~meshwise.parallel.recompute.
SavedBytes`), each block's saves attributed to it per micro-batch, on every rank; rank 0 gathers the rows
(one per block, from the first rank that runs it — the ranks of a tp or dp group hold the same amounts).
Under bf16/fp16 autocast, LayerNorm and softmax statistics stay fp32 while matmul outputs are 16-bit, so
the formula, which assumes one value size, is approximate there; in fp32 it is exact up to LayerNorm's
per-token statistics.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshwise.models.gpt import Block
from meshwise.models.gpt_activations import dropout_mask_bytes
from meshwise.parallel.recompute import SavedBytes
from meshwise.parallel.recompute.formulas import attention_keeps_scores, layer_saved_bytes
from meshwise.train.gpt.resolve import GPTRun
from meshwise.world import World


class LayerMemory:
    """Records one step's saves per block of ``model`` (this rank's) and reports them against the formula."""

    def __init__(self, model: nn.Module, run: GPTRun) -> None:
        self.run = run
        self.blocks = {
            name.rsplit("blocks.", 1)[-1]: module
            for name, module in model.named_modules()
            if isinstance(module, Block)
        }
        self.measurement = SavedBytes(exclude=model.parameters())
        self.recorded = False

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Measure the step inside (the first call only: one step says it all)."""
        if self.recorded:
            yield
            return
        self.recorded = True
        handles = self.measurement.per_layer(list(self.blocks.items()))
        try:
            with self.measurement.recording():
                yield
        finally:
            handles.remove()

    def rows(self) -> list[dict[str, Any]]:
        """This rank's blocks: measured bytes per micro-batch and the formula's, with what fed them."""
        model = self.run.model_config
        dropout = model.dropout > 0
        measured = self.measurement.bytes_per_call()
        value = torch.tensor([], dtype=self.run.config.model.torch_dtype).element_size()
        mask = dropout_mask_bytes() if dropout else 1
        scores = attention_keeps_scores(model.dropout)
        tp, sp = self.run.config.mesh.tp, self.run.config.mesh.sp
        rows = []
        for name, block in self.blocks.items():
            if name not in self.measurement.shapes:
                continue
            batch, seq = self.measurement.shapes[name][:2]
            seq *= tp if sp else 1  # the formula takes the whole sequence; under --sp a block sees s/t
            # the recomputation this block runs under, from its hooks (--recompute-layers mixes modes)
            mode = "full" if block.run_body is not None else "selective" if block.attn.run_core else "none"
            formula = layer_saved_bytes(
                seq, batch, model.hidden, model.heads, t=tp, sp=sp, mode=mode, value_bytes=value,
                mask_bytes=mask, dropout=dropout, scores=scores,
            )  # fmt: skip
            rows.append(
                {"block": int(name), "mode": mode, "batch": batch, "seq": seq,
                 "measured": measured.get(name, 0.0), "formula": formula}
            )  # fmt: skip
        return rows

    def gather(self, world: World) -> list[dict[str, Any]] | None:
        """Collective: every rank's rows on rank 0, one per block (None elsewhere)."""
        gathered: list = [None] * world.world_size if world.is_main else []
        dist.gather_object(self.rows(), gathered if world.is_main else None, dst=0)
        if not world.is_main:
            return None
        by_block = {}
        for rank_rows in gathered:
            for row in rank_rows:
                by_block.setdefault(row["block"], row)
        return [by_block[b] for b in sorted(by_block)]


def memory_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The report's table: per block, mode, measured and formula MiB per micro-batch, and their ratio."""
    title = "Activation memory saved for backward (per block, per micro-batch; formula: Korthikanti et al.)"
    header = f"  {'block':>5}  {'mode':<10}{'b × s':>12}{'measured MiB':>15}{'formula MiB':>14}{'ratio':>8}"
    lines = ["", title, header]
    for row in rows:
        ratio = row["measured"] / row["formula"] if row["formula"] else float("nan")
        shape = f"{row['batch']} × {row['seq']}"
        lines.append(
            f"  {row['block']:>5}  {row['mode']:<10}{shape:>12}{row['measured'] / 2**20:>15.2f}"
            f"{row['formula'] / 2**20:>14.2f}{ratio:>8.3f}"
        )
    total = sum(row["measured"] for row in rows)
    lines.append(f"  all blocks: {total / 2**20:.2f} MiB per micro-batch in flight")
    return lines
