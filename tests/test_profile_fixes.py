"""Cost profiles: the derived selective recompute's peak, the softmax precision a profile was
measured with, numbers too large for a profile, and a calibration priced at the recompute level
each executed op ran."""
import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

from dynapipe.config import load_model_config
from dynapipe.cost.base import MIB, StageLayout
from dynapipe.cost.profile import ProfileCostModel
from dynapipe.errors import DynaPipeError
from profile_widths import TINY_WIDTHS

TINY = load_model_config("gpt-tiny")  # fp32, hidden 64, 4 heads, dropout 0.1
MBS, SEQ = [1, 2, 4], [64, 128, 256]
ONE_LAYER = StageLayout(0, 0, 1, False, False)


def _profile(**top) -> dict:
    """A synthetic fp32 CPU profile of gpt-tiny (ms and MiB growing with the tokens)."""
    b, s = np.meshgrid(MBS, SEQ, indexing="ij")
    layer = {"fw_ms": (0.01 * b * s).tolist(), "bw_ms": (0.02 * b * s).tolist(),
             "stored_mib": (1e-3 * b * s + 1e-5 * b * s * s).tolist(), "peak_mib": (5e-4 * b * s).tolist()}
    small = {k: (1e-3 * b * s).tolist() for k in ("fw_ms", "bw_ms", "stored_mib", "peak_mib")}
    return {"format": "dynapipe-profile", "version": 2, "kind": "decoder-only", "device": "cpu", "dtype": "fp32",
            "mbs": MBS, "seqlen": SEQ, "model": dict(TINY_WIDTHS), "ops": {"layer": layer, "embedding": small,
                                                                           "output": small}, **top}


def _measure(path, *flags) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "dynapipe", "profile", "--output", str(path), "--model", "gpt-tiny", "--repeats", "1",
           "--threads", "1", "--no-progress", *flags]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """Real profiles of gpt-tiny (one thread): fp32 at every recompute level over the audit's
    shapes, and bf16 with --apply-query-key-layer-scaling (the softmax then runs in fp32)."""
    d = tmp_path_factory.mktemp("profiles")
    paths = {"fp32": d / "fp32.json", "qk": d / "qk.json"}
    procs = {"fp32": _measure(paths["fp32"], "--mbs", "1,4", "--seqlens", "128,256"),
             "qk": _measure(paths["qk"], "--mbs", "1", "--seqlens", "32,64", "--bf16",
                            "--apply-query-key-layer-scaling")}
    for key, proc in procs.items():
        _, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, (key, err[-3000:])
    return {k: json.loads(p.read_text()) for k, p in paths.items()}


def test_the_derived_selective_peak_is_the_measured_levels(measured):
    # Without the level's tables the peak kept the no-recompute value: at 256 tokens a fifth of
    # the measured one (0.81 against 4.19 MiB at mbs 1), and `plan --recompute selective` fitted
    # micro-batches the measured profile refused.
    data = measured["fp32"]
    derived = json.loads(json.dumps(data))
    for op in ("layer_selective", "layer_full"):
        del derived["ops"][op]
    cm = ProfileCostModel(TINY, derived, num_stages=1)
    b, s = (np.asarray(v, dtype=np.float64) for v in np.meshgrid(data["mbs"], data["seqlen"], indexing="ij"))
    peak = cm.layout_cost(ONE_LAYER, b, s, None, "selective").peak_mib
    ratio = peak / np.asarray(data["ops"]["layer_selective"]["peak_mib"])
    # At 256 tokens the measured peak (mbs 4: 5% above, for the bias of packed rows' masks);
    # never below it; at 128 tokens, where the no-recompute peak is elsewhere, above it.
    assert np.all(ratio[:, 1] >= 0.99) and np.all(ratio[:, 1] <= 1.06), ratio
    assert np.all(ratio >= 0.99) and np.all(ratio <= 1.5), ratio
    # The stored memory was derived right before; it still is.
    stored = cm.layout_cost(ONE_LAYER, b, s, None, "selective").stored_mib
    assert stored == pytest.approx(np.asarray(data["ops"]["layer_selective"]["stored_mib"]), rel=0.01)


def test_the_derived_selective_peak_adds_what_the_recomputed_core_saves_again():
    cm = ProfileCostModel(TINY, _profile(), num_stages=1)
    b, s = np.float64(2), np.float64(128)
    none, sel = (cm.layout_cost(ONE_LAYER, b, s, None, lv) for lv in ("none", "selective"))
    # What the level does not store, the recomputed core's output (b x s x h fp32) and the mask
    # the core builds again: at mbs 2 the bias of packed rows' [2, 1, s, s] mask (fp32), which
    # outgrows an unpacked row's causal mask and its bias (s x s x (1 + 4) bytes).
    rebuilt = (none.stored_mib - sel.stored_mib) + (b * s * 64 * 4 + s * s * 2 * 4) / MIB
    assert sel.peak_mib == pytest.approx(none.peak_mib + rebuilt)
    one = [cm.layout_cost(ONE_LAYER, np.float64(1), s, None, lv) for lv in ("none", "selective")]
    assert one[1].peak_mib == pytest.approx(one[0].peak_mib + (one[0].stored_mib - one[1].stored_mib)
                                            + (s * 64 * 4 + s * s * 5) / MIB)
    # Fused attention keeps no scores and builds no mask: only the core's output is computed again.
    fused = ProfileCostModel(dataclasses.replace(TINY, fused_attention=True), _profile(), num_stages=1)
    f_none, f_sel = (fused.layout_cost(ONE_LAYER, b, s, None, lv) for lv in ("none", "selective"))
    assert f_sel.peak_mib == pytest.approx(f_none.peak_mib + b * s * 64 * 4 / MIB)
    # A measured level's own tables are taken as measured.
    data = _profile()
    data["ops"]["layer_selective"] = {**data["ops"]["layer"], "peak_mib": [[7.0] * 3] * 3}
    assert ProfileCostModel(TINY, data, 1).layout_cost(ONE_LAYER, b, s, None, "selective").peak_mib == 7.0


def test_profiles_record_the_softmax_precision_they_were_measured_with(measured):
    assert measured["fp32"]["model"]["attention_softmax_in_fp32"] is False
    qk = measured["qk"]  # --apply-query-key-layer-scaling forces the fp32 softmax on
    assert qk["dtype"] == "bf16" and qk["model"]["attention_softmax_in_fp32"] is True
    bf16 = dataclasses.replace(TINY, dtype="bf16")
    assert ProfileCostModel(dataclasses.replace(bf16, attention_softmax_in_fp32=True), qk, 1)
    with pytest.raises(DynaPipeError) as e:
        ProfileCostModel(bf16, qk, 1, source="qk.json")
    assert str(e.value) == (
        "qk.json: the profile was measured with the attention softmax in fp32 (--attention-softmax-in-fp32), this "
        "run trains with the attention softmax in bf16 (Megatron's default); its stored activations and times "
        "price another layer. Measure a profile with the run's setting (`python -m dynapipe profile ... without "
        "--attention-softmax-in-fp32 or --apply-query-key-layer-scaling`) or use the analytic cost model.")


@pytest.mark.parametrize("recorded, run_fp32, dtype, fused, refused", [
    (False, True, "bf16", False, "measured with the attention softmax in bf16 (Megatron's default), this run "
                                 "trains with the attention softmax in fp32"),
    (True, False, "fp16", False, "measured with the attention softmax in fp32 (--attention-softmax-in-fp32), this "
                                 "run trains with the attention softmax in fp16"),
    (None, True, "bf16", False, "the profile does not record the precision of its attention softmax"),
    (None, False, "bf16", False, None),  # an older profile, the default setting: accepted
    (True, True, "bf16", False, None),
    (True, False, "fp32", False, None),  # fp32: the softmax is fp32 either way
    (None, True, "fp32", False, None),
    (True, False, "bf16", True, None),  # fused attention keeps no score matrix
])
def test_a_profile_of_another_softmax_precision_is_refused(recorded, run_fp32, dtype, fused, refused):
    data = _profile(dtype=dtype)
    if recorded is not None:
        data["model"] = {**TINY_WIDTHS, "attention_softmax_in_fp32": recorded}
    model = dataclasses.replace(TINY, dtype=dtype, attention_softmax_in_fp32=run_fp32, fused_attention=fused)
    if refused is None:
        assert ProfileCostModel(model, data, 1)
        return
    with pytest.raises(DynaPipeError) as e:
        ProfileCostModel(model, data, 1, source="p.json")
    message = str(e.value)
    assert message.startswith("p.json: ") and refused in message and "\n" not in message
    assert "Measure a profile with the run's setting" in message


@pytest.mark.parametrize("edit, needle", [
    (lambda p: p.update(mbs=[1, 2, 2 ** 70]), "'mbs' must be a non-empty list of positive numbers of at most 2**53"),
    (lambda p: p.update(seqlen=[64, 128, 10 ** 400]), "'seqlen' must be a non-empty list of positive numbers"),
    (lambda p: p.update(stage_overhead_ms=2 ** 70),
     "'stage_overhead_ms' 1180591620717411303424 is over 2**53 ms; give the fixed cost per stage op in ms."),
    (lambda p: p.update(stage_overhead_ms=10 ** 400), "'stage_overhead_ms' 1000000000000000000000000000000000000..."),
    (lambda p: p.update(tp=2 ** 70), "'tp' 1180591620717411303424 must be a positive integer of at most 2**53"),
    (lambda p: p["ops"]["layer"]["fw_ms"][0].__setitem__(0, 10 ** 400), "ops.layer.fw_ms holds values over 2**53"),
    (lambda p: p["ops"]["layer"]["peak_mib"][0].__setitem__(0, 2 ** 70), "ops.layer.peak_mib holds values over 2**53"),
    (lambda p: p["ops"]["layer"].update(bw_weight_ms=[[10 ** 400] * 3] * 3), "ops.layer.bw_weight_ms must be a 3x3"),
])
def test_numbers_too_large_for_a_profile_are_refused_naming_the_field(tmp_path, capsys, edit, needle):
    # A hand-edited 2**70 crashed with "TypeError: ufunc 'isfinite' not supported", and an int
    # beyond float64 with an OverflowError, instead of naming the field.
    from dynapipe.cli import main

    data = _profile()
    edit(data)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    assert main(["cost", "--model", "gpt-tiny", "--device", "cpu", "--stages", "2", "--profile", str(path),
                 "--shape", "1,128"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {path}: ") and needle in err and "\n" not in err
    from dynapipe.cost import build_cost_model
    from dynapipe.config import load_device_config

    with pytest.raises(DynaPipeError, match="2\\*\\*53|must be a 3x3"):
        build_cost_model(TINY, load_device_config("cpu"), 2, profile=str(path))


def _trace(tmp_path, levels):
    """One rank's trace of iteration 1: a forward and a backward of a 2 x 128 micro-batch per
    entry of ``levels`` (the level its backward records; None: none recorded), each taking 1 ms."""
    events = []
    for mb, level in enumerate(levels):
        for cat in ("forward", "backward"):
            args = {"iteration": 1, "mb": mb, "mbs": 2, "seqlen": 128, **({"recompute": level} if level else {})}
            events.append({"ph": "X", "cat": cat, "tid": 0, "ts": 0, "dur": 1e3, "args": args})
    (tmp_path / "rank000.json").write_text(json.dumps({"traceEvents": events}))
    return str(tmp_path)


def test_calibration_prices_each_op_at_the_recompute_level_it_ran(tmp_path):
    # Every backward used to be priced at no recompute: the refit then scaled the backward tables
    # by the recomputed forward of a run of --dynapipe-recompute full or selective.
    from megatron_integration.bench_calibrate import executed_ops

    cm = ProfileCostModel(TINY, _profile(), num_stages=2)
    bw = {lv: float(cm.stage_cost(2, 128, stage=0, recompute=lv).bw_ms) for lv in ("none", "selective", "full")}
    assert bw["none"] < bw["selective"] < bw["full"]
    fw = float(cm.stage_cost(2, 128, stage=0).fw_ms)
    # The run's level prices ops whose trace records none; a recorded one wins.
    ops = executed_ops(_trace(tmp_path, [None, "selective"]), cm, [1], recompute="full")
    assert sorted(ops.predicted_ms[ops.backward].tolist()) == pytest.approx([bw["selective"], bw["full"]])
    assert ops.predicted_ms[~ops.backward].tolist() == pytest.approx([fw, fw])
    ops = executed_ops(_trace(tmp_path, [None]), cm, [1])  # the default: a run without recomputation
    assert ops.predicted_ms[ops.backward].tolist() == pytest.approx([bw["none"]])


def test_calibration_refuses_ops_whose_recompute_level_is_unknown(tmp_path):
    from megatron_integration.bench_calibrate import executed_ops, refit_from_run

    cm = ProfileCostModel(TINY, _profile(), num_stages=2)
    trace = _trace(tmp_path, [None])
    for call in (lambda: executed_ops(trace, cm, [1], recompute=None),
                 lambda: refit_from_run([{}], trace, "unread.json", cm, [1], str(tmp_path / "out.json"), None)):
        with pytest.raises(DynaPipeError) as e:
            call()
        message = str(e.value)
        assert "--dynapipe-recompute" in message and "--calibrate-iters 0" in message and "\n" not in message
    assert not (tmp_path / "out.json").exists()
    # Recorded on every op, the levels of an auto run are known.
    ops = executed_ops(_trace(tmp_path, ["full"]), cm, [1], recompute=None)
    assert ops.predicted_ms[ops.backward].tolist() == pytest.approx([float(cm.stage_cost(
        2, 128, stage=0, recompute="full").bw_ms)])
