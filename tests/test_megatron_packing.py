"""Packing under ``--use-dynapipe`` isolates samples like Megatron's packing baseline.

PP2 gloo jobs (fp32, dropout 0) train the same global batches with megatron-core's
padding 1F1B and with the DynaPipe executor running ``--dynapipe-batching packing``.
With samples isolated (the block-diagonal mask built on both stages, positions
restarting at every sample) the logged ``lm loss`` is the padding loss (~1e-5); a
packed sample attending to its row neighbours would change it. (Megatron's own
packing with ``--reset-attention-mask`` against padding: test_megatron_baselines.py.)
Both runs train in one job with the PP2 runs of test_megatron_dynapipe.py when both files run.
"""
import re

import pytest

from test_megatron_dynapipe import run

PACK = "--dynapipe-batching packing --reset-position-ids --reset-attention-mask"


def _logged_losses(rank: dict) -> list[float]:
    return [float(m.group(1)) for l in rank["log_lines"] for m in [re.search(r"lm loss: (\S+) \|", l)] if m]


@pytest.mark.megatron_runs(("", 2), ("--use-dynapipe " + PACK, 2))
def test_dynapipe_packing_logs_the_padding_loss(request):
    padding = run("", 2, request)
    packed = run("--use-dynapipe " + PACK, 2, request)
    assert packed["method"] == "dynapipe" and padding["method"] == "padding"
    assert len(packed["losses"]) == 3
    assert packed["losses"] == pytest.approx(padding["losses"], abs=1e-5, rel=1e-5)
    logged = _logged_losses(packed)
    assert logged == pytest.approx(padding["losses"], abs=1e-5, rel=1e-5) and len(logged) == 3
    # Same samples trained; packed rows of --seq-length compute fewer padded tokens than padding.
    assert packed["real_tokens"] == padding["real_tokens"]
    assert packed["loss_tokens"] == padding["loss_tokens"]
    assert sum(packed["padded_tokens"]) < sum(padding["padded_tokens"])
