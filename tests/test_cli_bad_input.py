"""Bad command-line input is refused with one line naming the flag, the value and the fix:
batching flags the method does not read, placements as typed, ``--plan-out`` leftovers,
``trace --replica``, ``--seed`` and ``--png``, output paths checked before any planning,
``--dp`` above the batch's samples, sequence lengths sequence parallelism cannot split,
config and mixture names, mixed plan sets, the advisor's memory, list and token
arguments, ``profile``'s output, threads and grid."""
from __future__ import annotations

import os

import pytest

from dynapipe.cli import main
from dynapipe.errors import DynaPipeError

GPT7B = ["--model", "gpt-7b", "--device", "a100-40gb"]


def _lengths(tmp_path, text="100\n7\n2048\n513\n64\n1000\n9\n300\n1500\n"):
    p = tmp_path / "lengths.txt"
    p.write_text(text)
    return str(p)


def _refused(capsys, argv, message):
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 2 and out == "", err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err, err
    return err


@pytest.mark.parametrize("extra, message", [
    (["--micro-batch-size", "4"], "--micro-batch-size 4: --batching dynapipe sizes every micro-batch itself"),
    (["--max-tokens", "4096"], "--max-tokens 4096: --batching dynapipe does not read it"),
    (["--max-tokens", "0"], "--max-tokens 0: must be a positive integer"),
    (["--batching", "packing", "--max-tokens", "4096"], "--max-tokens 4096: --batching packing does not read it"),
    (["--batching", "padding", "--max-tokens", "4096"], "--batching padding does not read it"),
    (["--batching", "token-budget", "--max-tokens", "-1"], "--max-tokens -1: must be a positive integer"),
    (["--batching", "padding", "--micro-batch-size", "0"], "--micro-batch-size 0: must be a positive integer"),
    (["--batching", "token-budget", "--max-tokens", "8192", "--micro-batch-size", "2"],
     "--micro-batch-size 2: --batching token-budget reads it only to default --max-tokens"),
])
@pytest.mark.parametrize("command", ["plan", "trace"])
def test_batching_flags_the_method_does_not_read_are_refused(tmp_path, capsys, command, extra, message):
    out = ["--out", str(tmp_path / "t.json")] if command == "trace" else []
    _refused(capsys, [command, "--lengths", _lengths(tmp_path), *GPT7B, "--stages", "4", *out, *extra], message)
    assert not (tmp_path / "t.json").exists()


def test_memory_advice_names_the_flag_the_method_reads(tmp_path, capsys):
    lengths = _lengths(tmp_path, "2048\n" * 100)
    err = _refused(capsys, ["plan", "--lengths", lengths, *GPT7B, "--stages", "4", "--batching", "padding",
                            "--micro-batch-size", "100"], "no schedule fits")
    assert "a smaller --micro-batch-size" in err and "--max-tokens" not in err
    err = _refused(capsys, ["plan", "--lengths", lengths, *GPT7B, "--stages", "4", "--batching", "token-budget",
                            "--max-tokens", "100000"], "no schedule fits")
    assert "a smaller --max-tokens" in err and "--micro-batch-size" not in err


def test_the_sizes_a_method_reads_still_plan(tmp_path, capsys):
    for extra in (["--batching", "padding", "--micro-batch-size", "2"], ["--batching", "token-budget"],
                  ["--batching", "token-budget", "--micro-batch-size", "2"],
                  ["--batching", "token-budget", "--max-tokens", "8192"]):
        assert main(["plan", "--lengths", _lengths(tmp_path), *GPT7B, "--stages", "4", "--seq-length", "2048",
                     "--output", str(tmp_path / "p.json"), *extra]) == 0, extra
        capsys.readouterr()


@pytest.mark.parametrize("spec, message", [
    ("4,4,4,4|4,4,4", "--placement '4,4,4,4|4,4,4': chunk 1 ('4,4,4') names 3 stages; --stages is 4"),
    ("8,8,8,8|0,0,0,0", "--placement '8,8,8,8|0,0,0,0': stage 0 of chunk 1 holds no layer"),
    ("8+0,8,8,8", "--placement '8+0,8,8,8': model 'gpt-7b' is decoder-only, so '8+0'"),
    ("", "--placement '': empty; give even, auto, interleaved (T5) or layers per stage such as 8,8,8,8"),
    (" ", "--placement ' ': empty"),
    ("8,8,8,8,0", "--placement '8,8,8,8,0' names 5 stages; --stages is 4"),
    ("8,8,8,7", "--placement '8,8,8,7' holds 31 layers; model 'gpt-7b' has 32"),
    ("0,16,8,8", "--placement '0,16,8,8': stage 0 holds no layer"),
])
@pytest.mark.parametrize("command", ["plan", "trace"])
def test_placement_errors_describe_the_text_as_typed(tmp_path, capsys, command, spec, message):
    out = ["--out", str(tmp_path / "t.json")] if command == "trace" else []
    err = _refused(capsys, [command, "--lengths", _lengths(tmp_path), *GPT7B, "--stages", "4", *out,
                            "--placement", spec], message)
    assert "stage 4" not in err and "0+8" not in err


def test_t5_placement_errors_quote_the_text_as_typed():
    from dynapipe.config import load_model_config
    from dynapipe.cost.placement import StagePlacement

    t5 = load_model_config("t5-11b")
    with pytest.raises(DynaPipeError, match=r"placement '6\+0, 6\+0,6\+0,6\+0\|0\+6,0\+6,0\+12,0\+0': stage 3 "
                                            r"of chunk 1 holds no layer"):
        StagePlacement.parse("6+0, 6+0,6+0,6+0|0+6,0+6,0+12,0+0", t5, 4)


def _plan_out(tmp_path, capsys, plan_dir, *extra):
    rc = main(["plan", "--lengths", _lengths(tmp_path), *GPT7B, "--output", str(tmp_path / "p.json"),
               "--plan-out", str(plan_dir), *extra])
    err = capsys.readouterr().err
    assert rc == 0, err


def test_plan_out_replaces_an_earlier_layouts_plan_files_and_keeps_other_files(tmp_path, capsys):
    plan_dir = tmp_path / "plans"
    _plan_out(tmp_path, capsys, plan_dir, "--stages", "8", "--dp", "2")
    assert len(os.listdir(plan_dir)) == 16
    (plan_dir / "notes.txt").write_text("mine")
    (plan_dir / "replica009-stage009.plan.bak").write_text("mine too")
    _plan_out(tmp_path, capsys, plan_dir, "--stages", "4")
    assert sorted(os.listdir(plan_dir)) == ["notes.txt", "replica000-stage000.plan", "replica000-stage001.plan",
                                            "replica000-stage002.plan", "replica000-stage003.plan",
                                            "replica009-stage009.plan.bak"]
    assert (plan_dir / "notes.txt").read_text() == "mine"
    assert main(["validate", str(plan_dir)]) == 0
    assert "valid: 4 plans (1 replica(s) x 4 stages)" in capsys.readouterr().out


def test_plan_out_with_a_folder_where_a_plan_goes_writes_no_plan(tmp_path, capsys):
    plan_dir = tmp_path / "plans"
    _plan_out(tmp_path, capsys, plan_dir, "--stages", "4")
    before = {n: (plan_dir / n).read_bytes() for n in os.listdir(plan_dir)}
    (plan_dir / "replica000-stage001.plan").unlink()
    (plan_dir / "replica000-stage001.plan").mkdir()
    where = plan_dir / "replica000-stage001.plan"
    _refused(capsys, ["plan", "--lengths", _lengths(tmp_path, "9\n8\n7\n"), *GPT7B, "--stages", "4",
                      "--plan-out", str(plan_dir)], f"cannot write {str(where)!r} (a folder or link is in the way")
    # Nothing of the new set was written: the other files are the earlier set's, and no temp file is left.
    assert sorted(os.listdir(plan_dir)) == sorted(before)
    assert all((plan_dir / n).read_bytes() == b for n, b in before.items() if n != where.name)


def test_plan_out_and_validate_refuse_a_file(tmp_path, capsys):
    f = tmp_path / "plans"
    f.write_text("not a directory")
    _refused(capsys, ["plan", "--lengths", _lengths(tmp_path), *GPT7B, "--stages", "4", "--plan-out", str(f)],
             f"--plan-out {str(f)!r} is a file, not a directory")
    _refused(capsys, ["validate", str(f)], f"plan directory {str(f)!r} is a file, not a directory")
    _refused(capsys, ["validate", str(tmp_path / "nowhere")], "does not exist")


def _no_planning(monkeypatch):
    """Make planning in ``trace`` fail the test: a refusal must come before it."""
    import dynapipe.cli.trace as trace

    def planned(*_a, **_k):
        raise AssertionError("trace planned before refusing its arguments")

    monkeypatch.setattr(trace, "plan_micro_batches", planned)
    monkeypatch.setattr(trace, "schedule_batch_plan", planned)


@pytest.mark.parametrize("extra, message", [
    (["--replica", "3"], "--replica 3: only --png reads it"),
    (["--replica", "0"], "--replica 0: only --png reads it"),
    (["--png", "PNG", "--dp", "2", "--replica", "2"], "--replica 2 is not one of the 2 replica(s); use 0 to 1"),
    (["--png", "PNG", "--replica", "-1"], "--replica -1 is not one of the 1 replica(s)"),
])
def test_trace_replica_is_checked_before_planning(tmp_path, capsys, monkeypatch, extra, message):
    _no_planning(monkeypatch)
    extra = [str(tmp_path / "t.png") if a == "PNG" else a for a in extra]
    _refused(capsys, ["trace", "--lengths", _lengths(tmp_path), *GPT7B, "--stages", "4",
                      "--out", str(tmp_path / "t.json"), *extra], message)
    assert not (tmp_path / "t.json").exists()


@pytest.mark.parametrize("out, png, message", [
    ("t.json", "t.txt", "--png 'DIR/t.txt' does not end in .png, the only format it writes; use 'DIR/t.png'"),
    ("t.json", "t", "--png 'DIR/t' does not end in .png, the only format it writes; use 'DIR/t.png'"),
    ("t.json", "sub", "--png 'DIR/sub' is a directory; give a file path ending in .png"),
    ("t.png", "t.png", "--output and --png name the same file 'DIR/t.png', which --png would overwrite"),
    ("t.json", "lengths.txt/t.png", "'DIR/lengths.txt' is a file, not a folder"),
    ("sub", "t.png", "--output 'DIR/sub' is a directory"),
])
def test_trace_outputs_are_checked_before_planning(tmp_path, capsys, monkeypatch, out, png, message):
    _no_planning(monkeypatch)
    (tmp_path / "sub").mkdir()
    lengths = _lengths(tmp_path)
    _refused(capsys, ["trace", "--lengths", lengths, *GPT7B, "--stages", "4", "--out", str(tmp_path / out),
                      "--png", str(tmp_path / png)], message.replace("DIR", str(tmp_path)))
    assert sorted(os.listdir(tmp_path)) == ["lengths.txt", "sub"] and not os.listdir(tmp_path / "sub")


def test_trace_png_goes_exactly_where_asked_in_a_new_folder(tmp_path, capsys):
    png = tmp_path / "new" / "t.png"
    assert main(["trace", "--lengths", _lengths(tmp_path), *GPT7B, "--stages", "4", "--output",
                 str(tmp_path / "t.json"), "--png", str(png)]) == 0
    assert f"picture to {png}" in capsys.readouterr().err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and os.listdir(png.parent) == ["t.png"]


def test_trace_seed_only_with_samples(tmp_path, capsys):
    lengths = _lengths(tmp_path)
    _refused(capsys, ["trace", "--lengths", lengths, *GPT7B, "--stages", "4", "--out", str(tmp_path / "t.json"),
                      "--seed", "5"], f"--seed 5: only --samples reads it (--lengths {lengths} gives the lengths)")
    _refused(capsys, ["trace", "--lengths", lengths, *GPT7B, "--stages", "4", "--out", str(tmp_path / "t.json"),
                      "--seed", "0"], "--seed 0: only --samples reads it")
    assert not (tmp_path / "t.json").exists()


def test_outputs_are_checked_before_any_plan_file_is_written(tmp_path, capsys):
    lengths = _lengths(tmp_path)
    plans = tmp_path / "po"
    _refused(capsys, ["plan", "--lengths", lengths, *GPT7B, "--stages", "4", "--plan-out", str(plans),
                      "--output", str(tmp_path / "lengths.txt" / "x.json")], "is a file, not a folder")
    _refused(capsys, ["plan", "--lengths", lengths, *GPT7B, "--stages", "4", "--plan-out", str(plans),
                      "--output", str(tmp_path)], f"--output {str(tmp_path)!r} is a directory")
    _refused(capsys, ["plan", "--lengths", lengths, *GPT7B, "--stages", "4", "--output", str(tmp_path / "p.json"),
                      "--plan-out", str(tmp_path / "lengths.txt" / "po")], "is a file, not a folder")
    assert sorted(os.listdir(tmp_path)) == ["lengths.txt"]


def test_an_output_never_overwrites_the_input(tmp_path, capsys):
    lengths = _lengths(tmp_path)
    before = open(lengths).read()
    _refused(capsys, ["plan", "--lengths", lengths, *GPT7B, "--stages", "4", "--output", lengths],
             f"--lengths and --output name the same file {lengths!r}, which --output would overwrite")
    _refused(capsys, ["trace", "--lengths", lengths, *GPT7B, "--stages", "4", "--out", lengths],
             f"--lengths and --output name the same file {lengths!r}")
    _refused(capsys, ["plan", "--lengths", lengths, *GPT7B, "--stages", "4", "--output", str(tmp_path / "p"),
                      "--plan-out", str(tmp_path / "p")], "--output and --plan-out name the same file")
    assert open(lengths).read() == before and os.listdir(tmp_path) == ["lengths.txt"]


def test_outputs_never_overwrite_an_input_through_a_hard_link_or_a_config_file(tmp_path, capsys):
    lengths = _lengths(tmp_path)
    linked = tmp_path / "linked.txt"
    os.link(lengths, linked)
    model = tmp_path / "mine.yaml"
    model.write_text(open(os.path.join(os.path.dirname(__file__), "..", "configs", "models", "gpt-tiny.yaml")).read())
    before = {p: open(p).read() for p in (lengths, str(model))}
    _refused(capsys, ["plan", "--lengths", lengths, *GPT7B, "--stages", "4", "--output", str(linked)],
             "--lengths and --output name the same file")
    _refused(capsys, ["plan", "--lengths", lengths, "--model", str(model), "--device", "cpu", "--stages", "2",
                      "--output", str(model)], "--model and --output name the same file")
    _refused(capsys, ["trace", "--lengths", lengths, "--model", str(model), "--device", "cpu", "--stages", "2",
                      "--out", str(model)], "--model and --output name the same file")
    _refused(capsys, ["advise", "--model", str(model), "--device", "cpu", "--cluster", "a100-8x", "--gpus", "2",
                      "--mixture", "flan-mixture", "--json", str(model)], "--model and --json name the same file")
    assert {p: open(p).read() for p in before} == before


@pytest.mark.parametrize("argv, message", [
    (["plan", "--output", ""], "--output '': an empty path"),
    (["plan", "--output", "x.json", "--plan-out", ""], "--plan-out '': an empty path"),
    (["trace", "--out", ""], "--output '': an empty path"),
    (["trace", "--out", "t.json", "--png", ""], "--png '': an empty path"),
    (["trace", "--out", "t.json", "--png", "-"], "--png -: this output cannot go to stdout"),
    (["plan", "--output", "p.json", "--stages", "0"], "--stages 0: must be at least 1"),
    (["plan", "--output", "PO/replica000-stage000.plan", "--plan-out", "PO"],
     "would sit among the --plan-out"),
])
def test_empty_stdout_and_plan_set_outputs_are_refused_before_planning(tmp_path, capsys, monkeypatch, argv,
                                                                       message):
    monkeypatch.chdir(tmp_path)
    argv = [a.replace("PO", str(tmp_path / "po")) for a in argv]
    _refused(capsys, argv[:1] + ["--lengths", _lengths(tmp_path), *GPT7B, "--stages", "4"] + argv[1:], message)
    assert sorted(os.listdir(tmp_path)) == ["lengths.txt"]


def test_advise_outputs_are_files_and_a_config_name_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a regression would write a file named "-" here, not in the repository
    adv = ["advise", "--device", "cpu", "--cluster", "a100-8x", "--gpus", "2", "--mixture", "flan-mixture"]
    _refused(capsys, adv + ["--model", "gpt-tiny", "--output", "-"], "--output -: this output cannot go to stdout")
    bad = tmp_path / "bad.yaml"
    bad.write_text(open(os.path.join(os.path.dirname(__file__), "..", "configs", "models", "gpt-tiny.yaml")).read()
                   .replace("name: gpt-tiny", 'name: "gpt-tiny\\nlaunch: {nnodes: 9}"'))
    _refused(capsys, adv + ["--model", str(bad)], "holds a line break or another control character")
    _refused(capsys, adv + ["--model", "gpt-tiny", "--tp-sizes", "\u0662"], "expected comma-separated integers")


def test_a_failed_write_leaves_the_earlier_file_whole(tmp_path, monkeypatch):
    from dynapipe import output_paths

    target = tmp_path / "out.txt"
    target.write_text("earlier\n")

    class Full:
        def __init__(self, path, mode):
            self.f = open(path, mode)

        def __enter__(self):
            return self

        def write(self, data):
            self.f.write(data[:3])
            raise OSError(28, "No space left on device")

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(output_paths, "open", Full, raising=False)
    with pytest.raises(DynaPipeError, match="No space left on device; an earlier file there, if any, is unchanged"):
        output_paths.write_output(str(target), "new contents\n", "--output")
    assert target.read_text() == "earlier\n" and os.listdir(tmp_path) == ["out.txt"]


def test_plan_output_may_go_into_a_new_folder(tmp_path, capsys):
    out = tmp_path / "new" / "p.json"
    assert main(["plan", "--lengths", _lengths(tmp_path), *GPT7B, "--stages", "4", "--output", str(out),
                 "--plan-out", str(tmp_path / "po")]) == 0
    capsys.readouterr()
    assert out.exists() and len(os.listdir(tmp_path / "po")) == 4


@pytest.mark.parametrize("dp", [10, 4000, 100000])
def test_dp_above_the_samples_is_refused(tmp_path, capsys, dp):
    _refused(capsys, ["plan", "--lengths", _lengths(tmp_path), *GPT7B, "--stages", "4", "--dp", str(dp)],
             f"--dp {dp} exceeds the 9 sample(s) of the global batch, so {dp - 9} replica(s) would get no sample; "
             f"use --dp 9 or less")


def test_dp_up_to_the_samples_still_plans_with_its_warning(tmp_path, capsys):
    # DynaPipe splits its micro-batches until each of the 9 replicas has one.
    assert main(["plan", "--lengths", _lengths(tmp_path), *GPT7B, "--stages", "4", "--dp", "9",
                 "--output", str(tmp_path / "p.json")]) == 0
    err = capsys.readouterr().err
    assert "9 samples -> 9 micro-batches" in err and "get no micro-batch" not in err
    # Packing's rows of --seq-length, one a micro-batch, leave 7 of them without one: said, not hidden.
    assert main(["plan", "--lengths", _lengths(tmp_path), *GPT7B, "--stages", "8", "--dp", "9",
                 "--batching", "packing", "--micro-batch-size", "1", "--output", str(tmp_path / "q.json")]) == 0
    err = capsys.readouterr().err
    assert "9 samples -> 2 micro-batches" in err and "warning: 7 replica(s) get no micro-batch" in err


@pytest.mark.parametrize("command", ["plan", "trace"])
def test_sequence_parallel_needs_a_length_the_tp_ranks_split(tmp_path, capsys, command):
    out = ["--out", str(tmp_path / "t.json")] if command == "trace" else []
    _refused(capsys, [command, "--lengths", _lengths(tmp_path), *GPT7B, "--stages", "4", *out, "--tp", "2",
                      "--sequence-parallel", "--seq-length", "1023"],
             "--seq-length 1023 is not a multiple of 2; use --seq-length 1024 or 1022")
    assert not (tmp_path / "t.json").exists()
    _refused(capsys, ["cost", *GPT7B, "--stages", "4", "--tp", "2", "--sequence-parallel", "--shape", "1,1023"],
             "--shape '1,1023': --sequence-parallel splits every sequence over the 2 tensor-parallel ranks")


@pytest.mark.parametrize("argv, message", [
    (["--model", "nosuch", "--device", "a100-40gb"],
     "--model: config file 'nosuch' does not exist; give a YAML path or a shipped model name: gpt-13b, gpt-7b, "
     "gpt-tiny, t5-11b"),
    (["--model", "gpt-7b", "--device", "a100"], "--device: config file 'a100' does not exist; give a YAML path or "
                                                "a shipped device name: a100-40gb, cpu, h100-80gb, h200"),
    ([*GPT7B, "--cluster", "a100-40gb"],
     "--cluster: config file 'a100-40gb' does not exist ('a100-40gb' is a shipped device config, not a cluster "
     "one); give a YAML path or a shipped cluster name: a100-8x, cpu-local, h100-8x, h200-8x"),
])
def test_unknown_config_names_name_the_flag_and_the_shipped_configs(tmp_path, capsys, argv, message):
    _refused(capsys, ["plan", "--lengths", _lengths(tmp_path), "--stages", "4", *argv], message)


def test_synth_takes_a_shipped_mixture_name_as_advise_does(tmp_path, capsys):
    out = tmp_path / "l.txt"
    assert main(["synth", "--samples", "5", "--mixture", "flan-mixture", "--output", str(out)]) == 0
    assert main(["synth", "--samples", "5", "--output", str(tmp_path / "default.txt")]) == 0
    assert out.read_text() == (tmp_path / "default.txt").read_text()
    for command in (["synth", "--samples", "5"], ADVISE[:-2]):
        _refused(capsys, [*command, "--mixture", "nosuch"],
                 "--mixture: mixture file 'nosuch' does not exist; give a YAML path or a shipped mixture name: "
                 "flan-mixture")


def test_validate_names_the_files_of_a_mixed_plan_set_and_the_fix(tmp_path, capsys):
    first, second = tmp_path / "a", tmp_path / "b"
    _plan_out(tmp_path, capsys, first, "--stages", "4")
    rc = main(["plan", "--lengths", _lengths(tmp_path, "30\n40\n"), *GPT7B, "--stages", "4",
               "--output", str(tmp_path / "p.json"), "--plan-out", str(second)])
    err = capsys.readouterr().err
    assert rc == 0, err
    os.replace(second / "replica000-stage001.plan", first / "replica000-stage001.plan")
    err = _refused(capsys, ["validate", str(first)], f"{first / 'replica000-stage001.plan'}: global_loss_tokens=70 "
                                                     f"differs from global_loss_tokens=5541 of "
                                                     f"{first / 'replica000-stage000.plan'}")
    assert f"re-run `python -m dynapipe plan ... --plan-out {first}`" in err


ADVISE = ["advise", "--model", "gpt-tiny", "--device", "cpu", "--cluster", "cpu-local", "--gpus", "2",
          "--mixture", "flan-mixture"]


@pytest.mark.parametrize("extra, message", [
    (["--memory-limit-mb", "10"], "--memory-limit-mb 10 leaves nothing for the plans once the 512 MiB device "
                                  "'cpu' reserves (reserved_mib) are taken off; give more than 512 MiB"),
    (["--tp-sizes", "1,,2"], "--tp-sizes: '1,,2': an entry is empty"),
    (["--vpp-sizes", "2,"], "--vpp-sizes: '2,': an entry is empty"),
    (["--tokens-per-iteration", "10"], "--tokens-per-iteration 10 is below one sample at the clip (1024 tokens, "
                                       "from the model's max_seq_length 1024); give at least 1024"),
    (["--tokens-per-iteration", "100", "--seq-length", "128"], "(128 tokens, from --seq-length 128); give at "
                                                                "least 128"),
])
def test_advise_refuses_budgets_and_lists_it_cannot_honour(capsys, extra, message):
    from dynapipe.config import load_device_config

    assert load_device_config("cpu").reserved_mib == 512  # the figure the first message names
    _refused(capsys, [*ADVISE, *extra], message)


def test_advise_library_refuses_a_limit_below_the_reserved_memory():
    from dynapipe.advise import advise
    from dynapipe.config import load_device_config, load_model_config
    import numpy as np

    with pytest.raises(DynaPipeError, match="memory_limit_mib=500 leaves nothing"):  # 512 MiB reserved
        advise([np.array([64, 64])], load_model_config("gpt-tiny"), load_device_config("cpu"), 2,
               memory_limit_mib=500)


@pytest.mark.parametrize("extra, message", [
    (["--output", "DIR"], "is a directory; give a file path for the profile JSON"),
    # A folder in the way of the one to create (a missing one is created, as every command's).
    (["--output", "FILE/sub/p.json"], "is a file, not a folder, so nothing can be written under it"),
    # The model config it reads is never written over.
    (["--output", "OUT", "--model", "OUT"], "--model and --output name the same file"),
    (["--output", "OUT", "--threads", "-1"], "--threads -1: must be at least 1"),
    (["--output", "OUT", "--threads", "0"], "--threads 0: must be at least 1"),
    (["--output", "OUT", "--tensor-model-parallel-size", "0"], "--tensor-model-parallel-size 0: must be at least 1"),
    (["--output", "OUT", "--seqlens", ""], "--seqlens '': an empty entry"),
    (["--output", "OUT", "--seqlens", "64,,128"], "--seqlens '64,,128': an empty entry"),
    (["--output", "OUT", "--mbs", "1,"], "--mbs '1,': an empty entry"),
    # A T5 profile of a GPT's widths would never price anything.
    (["--output", "OUT", "--t5"], "--t5 with --model gpt-tiny, a decoder-only model config"),
    (["--output", "OUT", "--mbs", "1", "--seqlens", "64,100000"],
     "--seqlens reaches 100000 tokens, beyond the max_seq_length 1024 of --model gpt-tiny"),
    (["--output", "OUT", "--lr", "5"], "--lr 5.0 is a training flag that profile does not read"),
    (["--output", "OUT", "--global-batch-size", "7"], "--global-batch-size 7 is a training flag"),
    (["--output", "OUT", "--pipeline-model-parallel-size", "2"], "--pipeline-model-parallel-size 2 is a training"),
    (["--output", "OUT", "--mock-data"], "--mock-data is a training flag"),
    (["--output", "OUT", "--recompute-activations"], "--recompute-activations is a training flag"),
    (["--output", "OUT", "--no-check-for-nan-in-loss-and-grad"], "--no-check-for-nan-in-loss-and-grad is a training"),
    # Layouts the profile does not measure (it picks its own backend and measures one TP group).
    (["--output", "OUT", "--context-parallel-size", "2"], "--context-parallel-size 2 is a training flag"),
    (["--output", "OUT", "--expert-model-parallel-size", "4"], "--expert-model-parallel-size 4 is a training flag"),
    (["--output", "OUT", "--distributed-backend", "nccl"], "--distributed-backend nccl is a training flag"),
    (["--output", "OUT", "--distributed-timeout-minutes", "0"],
     "--distributed-timeout-minutes 0: must be a positive number of minutes"),
    # A grid nobody typed is named by what set it.
    (["--output", "OUT", "--seq-length", "4096"],
     "--seq-length 4096 (the --seqlens grid's top) reaches 4096 tokens, beyond the max_seq_length 1024"),
])
def test_profile_refuses_before_measuring(tmp_path, capsys, monkeypatch, extra, message):
    pytest.importorskip("torch")
    import megatron_integration.profiler as profiler

    def measured(*a, **k):
        raise AssertionError("measured before refusing")
    monkeypatch.setattr(profiler, "profile_model", measured)
    (tmp_path / "FILE").write_text("a file where a folder would go")
    extra = [str(tmp_path) if a == "DIR" else str(tmp_path / "p.json") if a == "OUT" else
             str(tmp_path / a) if a.startswith("FILE/") else a for a in extra]
    if "--model" in extra:
        import shutil

        shutil.copy(os.path.join(os.path.dirname(__file__), "..", "configs", "models", "gpt-tiny.yaml"),
                    tmp_path / "p.json")
    kept = (tmp_path / "p.json").read_bytes() if (tmp_path / "p.json").exists() else None
    _refused(capsys, ["profile", "--model", "gpt-tiny", "--repeats", "1", "--no-progress", *extra], message)
    assert (tmp_path / "p.json").read_bytes() == kept if kept is not None else not (tmp_path / "p.json").exists()


def test_profile_starts_megatron_as_its_deterministic_mode_and_timeout_say(tmp_path, capsys, monkeypatch):
    """``--deterministic-mode`` and ``--distributed-timeout-minutes`` reach the profiling rank's
    start-up as they reach a training rank's: the profile times the kernels the run trains with."""
    pytest.importorskip("torch")
    import megatron_integration.initialize as initialize

    seen = []
    for name in ("RANK", "WORLD_SIZE"):  # set by the profile's start-up: put back as they were after
        monkeypatch.setenv(name, "0")  # (records the variable, so the undo also removes a new one)
        monkeypatch.delenv(name)

    def started(parallel, seed, deterministic=False, **_):
        seen.append((parallel.timeout_minutes, deterministic))
        raise DynaPipeError("stopped after start-up")
    monkeypatch.setattr(initialize, "initialize_megatron", started)
    argv = ["profile", "--model", "gpt-tiny", "--repeats", "1", "--no-progress", "--output", str(tmp_path / "p.json")]
    _refused(capsys, argv + ["--deterministic-mode", "--distributed-timeout-minutes", "45"], "stopped after start-up")
    _refused(capsys, argv, "stopped after start-up")
    assert seen == [(45.0, True), (10.0, False)]
    # An earlier profile at --output, or a file named as the command in the folder, is no input
    # it would overwrite: only --model and a tokenizer's files are.
    monkeypatch.chdir(tmp_path)
    for name in ("p.json", "profile"):
        (tmp_path / name).write_text("{}")
    _refused(capsys, argv[:-1] + ["profile"], "stopped after start-up")
    _refused(capsys, argv, "stopped after start-up")


@pytest.mark.parametrize("argv, message", [
    # Megatron-LM flags the training scripts refuse with a reason get the same reason here (bench
    # and profile take Megatron arguments); any other unknown flag gets argparse's one line.
    (["bench", "--output", "b.json", "--wandb-project", "p"],
     "error: --wandb-project is a Megatron-LM flag that dynapipe-megatron does not support: use --tensorboard-dir"),
    (["profile", "--output", "p.json", "--fp8-margin=0"],
     "error: --fp8-margin is a Megatron-LM flag that dynapipe-megatron does not support: fp8 training"),
    # Every refused flag, a line each (the first line checked here; the count below).
    (["profile", "--output", "p.json", "--moe-router-topk", "2", "--use-megatron-fsdp"],
     "error: --moe-router-topk is a Megatron-LM flag that dynapipe-megatron does not support: mixture-of-experts"),
    (["synth", "--samples", "4", "--output", "s.txt", "--bogus"],
     "error: python -m dynapipe synth: unrecognized arguments: --bogus; see python -m dynapipe synth --help."),
    (["synth", "--samples", "4", "--output", "s.txt", "--wandb-project", "p"],  # takes no Megatron arguments
     "error: python -m dynapipe synth: unrecognized arguments: --wandb-project p"),
    # Whole flags only, as Megatron-LM's parser: a prefix is not taken for --warmup-iters.
    (["bench", "--output", "b.json", "--warmup-it", "7"],
     "error: python -m dynapipe bench: unrecognized arguments: --warmup-it 7"),
    # --warmup itself is Megatron-LM's deprecated warmup fraction.
    (["bench", "--output", "b.json", "--warmup", "7"],
     "error: --warmup is a Megatron-LM flag that dynapipe-megatron does not support: Megatron-LM's deprecated "
     "spelling of --lr-warmup-fraction"),
    (["synth", "--sample", "4", "--output", "s.txt"],
     "error: python -m dynapipe synth: the following arguments are required: --samples"),
    (["--bogus"], "error: python -m dynapipe: unrecognized arguments: --bogus"),
    # A value left out (the next word is a flag of the command) gets no hint about '-' values.
    (["cost", "--model", "--device", "cpu", "--stages", "2", "--shape", "1,2"],
     "error: python -m dynapipe cost: argument --model: expected one argument; see"),
    # A value that starts with '-' is read as a flag: the fix is named.
    (["cost", "--model", "gpt-7b", "--device", "a100-40gb", "--stages", "4", "--shape", "-1,512"],
     "error: python -m dynapipe cost: argument --shape: expected one argument (a value starting with '-' is "
     "written --shape=VALUE)"),
])
def test_unknown_flags_are_one_line_and_refused_megatron_flags_name_the_reason(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    refused = sum(a.startswith(("--moe-", "--use-megatron-fsdp")) for a in argv)
    assert err.startswith(message) and err.count("\n") == max(refused, 1), err


@pytest.mark.parametrize("extra, message", [
    (["--schedule", "1f1b", "--no-split-backward"], "--no-split-backward takes zb-h1 and interleaved-zb out of "
                                                    "--schedule auto; --schedule 1f1b never splits a backward"),
    (["--schedule", "adaptive", "--no-split-backward"], "--schedule adaptive never splits a backward"),
    (["--stages", "1", "--cluster", "a100-8x"], "--cluster a100-8x prices the links between pipeline stages and "
                                                "inside a tensor-parallel group; --stages 1 with --tp 1 has neither"),
])
@pytest.mark.parametrize("command", ["plan", "trace"])
def test_schedule_options_nothing_reads_are_refused(tmp_path, capsys, command, extra, message):
    out = ["--out", str(tmp_path / "t.json")] if command == "trace" else []
    stages = [] if "--stages" in extra else ["--stages", "4"]
    _refused(capsys, [command, "--lengths", _lengths(tmp_path), *GPT7B, *stages, *out, *extra], message)
    assert not (tmp_path / "t.json").exists()


def test_a_lengths_file_of_the_other_kind_names_the_file_and_the_model(tmp_path, capsys):
    pairs = _lengths(tmp_path, "100 20\n300 40\n")
    for argv in (["plan", "--lengths", pairs, *GPT7B, "--stages", "4"],
                 ["trace", "--lengths", pairs, *GPT7B, "--stages", "4", "--out", str(tmp_path / "t.json")],
                 ["advise", "--model", "gpt-tiny", "--device", "cpu", "--cluster", "cpu-local", "--gpus", "2",
                  "--lengths", pairs, "--tokens-per-iteration", "2048", "--no-progress"]):
        _refused(capsys, argv, f"--lengths {pairs} holds (input, target) pairs, and model")
    single = _lengths(tmp_path, "100\n300\n")
    _refused(capsys, ["plan", "--lengths", single, "--model", "t5-11b", "--device", "a100-40gb", "--stages", "4"],
             "holds one length a sample, and model 't5-11b' is encoder-decoder: give two a sample")


def test_plan_names_the_cost_model_it_used(tmp_path, capsys):
    for extra, used in (([], "analytic"), (["--profile", "analytic"], "analytic")):
        assert main(["plan", "--lengths", _lengths(tmp_path), *GPT7B, "--stages", "4", *extra]) == 0
        assert '"cost_model": "analytic"' in capsys.readouterr().out, extra


def test_advise_refuses_no_sequence_parallel_where_no_layout_could_use_it(capsys):
    base = [*ADVISE, "--tokens-per-iteration", "8192", "--batches", "1", "--no-packing", "--no-progress"]
    _refused(capsys, base + ["--tp-sizes", "1", "--no-sequence-parallel"],
             "--no-sequence-parallel: no layout here could use sequence parallelism (TP sizes 1 at --seq-length 1024)")
    _refused(capsys, base + ["--tp-sizes", "2", "--seq-length", "1023", "--no-sequence-parallel"],
             "(TP sizes 2 at --seq-length 1023); drop it")


def test_t5_auto_placement_for_a_named_schedule_is_of_the_kind_it_runs_on(tmp_path, capsys):
    import json

    from dynapipe.data.synthetic import sample_lengths

    pairs = tmp_path / "pairs.txt"
    pairs.write_text("".join(f"{a} {b}\n" for a, b in sample_lengths(32, 1, 512, True)))
    base = ["plan", "--lengths", str(pairs), "--model", "t5-11b", "--device", "h200", "--stages", "4",
            "--placement", "auto"]
    chunks = {}
    for schedule in ("adaptive", "interleaved", "auto"):
        assert main(base + ["--schedule", schedule]) == 0, schedule
        chunks[schedule] = json.loads(capsys.readouterr().out)["placement"].get("chunks", 1)
    # Interleaving simulates faster here, but adaptive runs on contiguous stages only.
    assert chunks == {"adaptive": 1, "interleaved": 2, "auto": 2}


@pytest.mark.parametrize("output", ["models/gpt-7b.yaml", "clusters/a100-8x.yaml", "data/flan-mixture.yaml"])
def test_an_output_over_a_shipped_config_is_refused(tmp_path, capsys, output):
    # --model gpt-7b names configs/models/gpt-7b.yaml by its short name, and the device picks
    # configs/clusters/a100-8x.yaml: an --output there would be read by every later run.
    from dynapipe.config import CONFIG_DIR

    path = os.path.join(CONFIG_DIR, output)
    with open(path, "rb") as f:
        before = f.read()
    _refused(capsys, ["plan", "--lengths", _lengths(tmp_path), *GPT7B, "--stages", "4", "--output", path],
             f"is configs/{output}, a config file of this project's configs/ folder")
    with open(path, "rb") as f:
        assert f.read() == before


def test_a_plan_directory_cannot_go_to_stdout(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _refused(capsys, ["plan", "--lengths", _lengths(tmp_path), *GPT7B, "--stages", "4", "--plan-out", "-"],
             "--plan-out -: this output is a directory of files and cannot go to stdout")
    assert not os.path.exists(tmp_path / "-")
