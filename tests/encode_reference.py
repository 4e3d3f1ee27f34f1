"""The version-2 body encoder as first written (a Python loop over every tensor list and
column), kept as the reference the array-gathering encoder must match byte for byte."""
from __future__ import annotations

import json

import numpy as np

from dynapipe.errors import PlanError
from dynapipe.plan.binary import _COUNTS, _FIXED, _WIDTH_TYPES, _encode_micro_batches
from dynapipe.plan.instructions import DTYPES
from dynapipe.plan.table import NCOLS, table_of

_DTYPE_INDEX = {d: i for i, d in enumerate(DTYPES)}


def reference_encode_body(plan) -> bytes:
    table = table_of(plan.instructions)
    strings = list(table.strings)
    index = {s: i for i, s in enumerate(strings)}

    def sid(s):
        if type(s) is not str:
            raise PlanError(f"plan of stage {plan.stage}: expected a string, got {s!r}.")
        i = index.get(s)
        if i is None:
            i = index[s] = len(strings)
            strings.append(s)
        return i

    list_lens, items, dims = [], [], []
    for ts in table.tensor_lists:
        list_lens.append(len(ts))
        for t in ts:
            d = _DTYPE_INDEX.get(t.dtype)
            if d is None:
                raise PlanError(f"tensor {t.name!r} has dtype {t.dtype!r}, not one of {DTYPES}.")
            items.append((sid(t.name), d, len(t.shape)))
            dims.extend(t.shape)
    sched, rec = sid(plan.schedule), sid(plan.recompute)
    meta = json.dumps(plan.meta, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode("ascii")
    encoded = [s.encode("utf-8", "surrogatepass") for s in strings]
    mb_bytes, n_samples, n_rows, n_row_items = _encode_micro_batches(plan.micro_batches)
    fixed = _FIXED.pack(plan.iteration, plan.stage, plan.num_stages, plan.replica, plan.num_replicas,
                        plan.loss_tokens, plan.global_loss_tokens)
    counts = _COUNTS.pack(len(strings), sum(map(len, encoded)), len(meta), len(plan.micro_batches), n_samples,
                          n_rows, n_row_items, len(list_lens), len(items), len(dims), len(table),
                          sched << 16 | rec)
    widths, cols = [], []
    for c in range(NCOLS):
        col = table.rows[:, c]
        lo, hi = (int(col.min()), int(col.max())) if col.size else (0, 0)
        w = 1 if -128 <= lo and hi < 128 else 2 if -32768 <= lo and hi < 32768 else 4
        widths.append(w)
        cols.append(col.astype(_WIDTH_TYPES[w]).tobytes())
    return b"".join([fixed, counts, np.array([len(e) for e in encoded], "<u4").tobytes(), *encoded, meta, mb_bytes,
                     np.array(list_lens, "<i4").tobytes(), np.array(items, "<i4").reshape(-1, 3).tobytes(),
                     np.array(dims, "<i8").tobytes(), bytes(widths), *cols])
