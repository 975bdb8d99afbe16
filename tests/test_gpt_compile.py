"""``train gpt --compile`` computes what the plain run computes (issue 30, Add): torch.compile of each block
in place, so parameter names — and checkpoints — are unchanged. On a CPU it needs a C++ compiler."""

from __future__ import annotations

import shutil

import pytest

from meshwise.train.gpt import GPTTrainConfig, run_gpt_training

pytestmark = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None and shutil.which("clang++") is None,
    reason="torch.compile on a CPU needs a C++ compiler (the README's requirements name it)",
)


@pytest.mark.slow
@pytest.mark.timeout(400)  # inductor compiles the block's forward and backward once: minutes under load
def test_a_compiled_run_matches_the_plain_one(text):
    settings = {
        "config": "gpt-tiny", "layers": 1, "data": text, "seq_len": 16, "global_batch": 2, "eval_windows": 2,
        "steps": 2, "backend": "gloo",
    }  # fmt: skip
    plain, compiled = (
        run_gpt_training(GPTTrainConfig.from_flags(**settings, compile=c)) for c in (False, True)
    )
    assert plain is not None and compiled is not None
    # the same kernels up to fusion: inductor may reorder fp32 sums inside a fused kernel
    for a, b in zip(plain.history, compiled.history, strict=True):
        assert b.loss == pytest.approx(a.loss, rel=1e-5)
