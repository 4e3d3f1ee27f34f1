"""Session-wide fixtures: the spawned T5 jobs the T5 test modules share (a 2-rank job costs
tens of seconds; it runs once however many modules read it); the ``spawns`` mark that
``make test-fast`` leaves out; and how ``make test``'s pytest-xdist workers share the modules
(the modules reading the shared jobs as one group, sent out first)."""
import functools
import os
import re

import pytest

from t5_job import PACKING, TIMEOUT, TINY

# What a module that starts processes calls or reads (spawned gloo ranks, whether through spawn(),
# a module's own ``_spawn...(`` helper or torch's start_processes(); torchrun, subprocesses, the
# session's shared training jobs). Most of the suite's time is in those modules; the others
# (planner, schedules, plans, cost model, data, command-line checks) run in about two minutes.
_STARTS_PROCESSES = re.compile(r"\b_?spawn\w*\(|\bstart_processes\(|\brun_trainings?\(|\bsubprocess\b|\brun_job\b|"
                               r"\bpp2\b|\bt5_dist\b|\btp2\b|megatron_runs")


# A module that reads a training job other modules read too: the T5 session fixtures below
# (``pp2``, ``t5_dist``) or test_megatron_dynapipe.run's GPT jobs (the ``megatron_runs`` mark).
_READS_SHARED_JOBS = re.compile(r"def \w+\([^)]*\b(?:pp2|t5_dist)\b|megatron_runs\(")


@functools.cache
def _source(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


@functools.cache  # once a module, not once a test
def worker_group(module: str, root: str = ".") -> str:
    """Which pytest-xdist worker group a test module (its path as a node id has it) runs in:
    every module reading the shared training jobs in one (each job then trains once), any
    other module alone (its module-scoped jobs train once)."""
    return "shared-jobs" if _READS_SHARED_JOBS.search(_source(os.path.join(root, module))) else module


def pytest_collection_modifyitems(config, items):
    """Mark every test of a module that starts processes ``spawns`` (``-m "not spawns"``: the
    fast tier). In a pytest-xdist worker, order the tests: the shared jobs' group first, the
    other spawning modules next, the fast modules last (they even out the workers' ends)."""
    root = str(config.rootpath)
    for item in items:
        if _starts_processes(str(item.fspath)):
            item.add_marker(pytest.mark.spawns)
        # A module the source scan misses would train the shared jobs again in its worker.
        if (({"pp2", "t5_dist"} & set(item.fixturenames) or item.get_closest_marker("megatron_runs"))
                and worker_group(item.nodeid.split("::")[0], root) != "shared-jobs"):
            _MISGROUPED.add(item.nodeid)
    if hasattr(config, "workerinput"):

        def rank(item) -> int:
            if worker_group(item.nodeid.split("::")[0], root) == "shared-jobs":
                return 0
            return 1 if item.get_closest_marker("spawns") else 2
        items.sort(key=rank)  # stable: a module's tests keep their order


@functools.cache
def _starts_processes(path: str) -> bool:
    return bool(_STARTS_PROCESSES.search(_source(path)))


_MISGROUPED: set = set()


def pytest_runtest_setup(item):
    if item.nodeid in _MISGROUPED:
        pytest.fail(f"{item.nodeid} reads a shared training job, but its module is not grouped with the "
                    f"others that do (make test's workers would train the job twice): extend "
                    f"_READS_SHARED_JOBS in tests/conftest.py", pytrace=False)


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: plain pytest runs without it
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` with the modules that read the shared jobs grouped as one file, sent
    out in the workers' collection order (``make test`` runs two workers)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    root = str(config.rootpath)

    class SharedJobsScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid.split("::")[0], root)

    config.option.loadscopereorder = False  # the order above, not the largest group first
    return SharedJobsScheduling(config, log)


@pytest.fixture
def gpu_with_te(monkeypatch):
    """Parse as on a GPU machine with Transformer Engine installed, where --transformer-impl's
    default (transformer_engine) is what the stages are built from."""
    import megatron_integration.model as model_specs

    monkeypatch.setattr(model_specs, "te_available", lambda: True)


def write_pairs(path, count: int, input_words: tuple, seed: int) -> None:
    """``count`` JSONL (input, target) pairs of ``input_words`` (low, high) words and 2-8 target words."""
    import json
    import random

    rng = random.Random(seed)
    words = [f"w{i}" for i in range(60)]
    with open(path, "w") as f:
        for _ in range(count):
            f.write(json.dumps({"input": " ".join(rng.choice(words) for _ in range(rng.randint(*input_words))),
                                "target": " ".join(rng.choice(words) for _ in range(rng.randint(2, 8)))}) + "\n")


@pytest.fixture(scope="session")
def t5_dist(tmp_path_factory):
    """Where the pp2 job writes its torch_dist checkpoints: ``full`` (padding, 3 iterations),
    ``cut`` (the same run stopped after 2), ``resumed`` and ``placed`` (``cut`` resumed for the
    third iteration on the even split and on the placement 2+1,0+1), and the non-persistent ones
    (``np_global``, saved by ``np_saved``'s run; ``np_resumed``, the job that resumed from it)."""
    return tmp_path_factory.mktemp("t5dist")


@pytest.fixture(scope="session")
def pp2(tmp_path_factory, t5_dist):
    """One 2-rank job: padding, DynaPipe interrupted after 2 iterations (with a checkpoint) and
    resumed for the third, packing (its executor traces in ``t5_dist / "packing-traces"``); then a 3 + 1 layer model (two iterations) with padding
    and DynaPipe; then span-corrupted indexed data (two iterations) with padding and DynaPipe;
    then padding and DynaPipe (two iterations) on the placement 2+1,0+1; then padding, DynaPipe
    and packing on the interleaved placement; a 3 + 2 layer model interleaved with the decoder's
    embedding in the last chunk; evaluation of every method; then padding through torch_dist
    checkpoints (see ``t5_dist``), interleaved checkpoints in both formats; then bf16 runs of
    every method, padding cut and resumed through torch_dist; fp16 padding and DynaPipe; DynaPipe
    on the zero-bubble schedule, on the even split and on the interleaved placement; packing with
    per-sample attention; DynaPipe with per-sample attention; short JSONL pairs with padding and
    with per-sample packing through the DynaPipe executor and with masked packing; a weighted JSONL blend, uninterrupted and cut after 4 iterations,
    resumed at another --train-iters; padding and DynaPipe skipping an iteration, and DynaPipe
    under --rerun-mode report_stats; last, a non-persistent checkpoint and a resume from it (see
    ``t5_dist``)."""
    from megatron_integration.t5_jobs import run_t5_training
    from t5_span_fixture import write_sentences, write_vocab

    save = tmp_path_factory.mktemp("t5ckpt")
    dyn = TINY + " --use-dynapipe"
    # 3 + 1 layers over 2 stages: stage 1 ends the encoder and holds the decoder.
    mixed = TINY.replace("--encoder-num-layers 2 --decoder-num-layers 2", "--encoder-num-layers 3 "
                         "--decoder-num-layers 1") + " --exit-interval 2"
    # Megatron's T5 dataset over documents of sentences, a WordPiece vocabulary with sentinels.
    data = tmp_path_factory.mktemp("t5span")
    write_vocab(data / "vocab.txt")
    write_sentences(data / "docs", docs=60, seed=3, max_sentence=40)
    # Megatron's T5 dataset over documents of sentences; 20% of them its validation split.
    span = TINY.replace("--mock-data", f"--data-path {data / 'docs'} --split 80,20,0 --eval-interval 2 "
                                       f"--eval-iters 1").replace(
        "--vocab-size 256", f"--tokenizer-type BertWordPieceLowerCase --vocab-file {data / 'vocab.txt'} "
                            f"--vocab-extra-ids 32").replace("--train-iters 3", "--train-iters 2")
    runs = [(TINY + f" --save {t5_dist / 'full'}").split(),
            (dyn + f" --exit-interval 2 --ckpt-format dynapipe --save {save}").split(),
            (dyn + f" --ckpt-format dynapipe --load {save}").split(),
            (TINY + PACKING + f" --dynapipe-trace-dir {t5_dist / 'packing-traces'}").split(), mixed.split(),
            (mixed + " --use-dynapipe").split(),
            span.split(), (span + " --use-dynapipe").split()]
    # A non-even stage placement (stage 0: the encoder and the first decoder layer), padding and
    # DynaPipe, logging Megatron-LM's throughput.
    placed = TINY + " --dynapipe-placement 2+1,0+1 --exit-interval 2 --log-throughput"
    runs += [placed.split(), (placed + " --use-dynapipe").split()]
    # The interleaved placement (two chunks a rank: the encoder, then the decoder), every method.
    interleaved = TINY + " --dynapipe-placement interleaved --exit-interval 2"
    runs += [interleaved.split(), (interleaved + " --use-dynapipe").split(), (interleaved + PACKING).split()]
    # 3 + 2 layers interleaved as 1+0,1+0|1+0,0+2: rank 1's last chunk embeds the decoder and ends the model.
    last_embeds = TINY.replace("--encoder-num-layers 2 --decoder-num-layers 2", "--encoder-num-layers 3 "
                               "--decoder-num-layers 2") + " --dynapipe-placement 1+0,1+0|1+0,0+2 --exit-interval 1"
    runs += [last_embeds.split(), (last_embeds + " --use-dynapipe").split()]
    # Evaluation (a validation and a test split of the mock mixture), every method; DynaPipe interleaved too.
    evaluated = TINY + " --split 80,10,10 --eval-interval 2 --eval-iters 1"
    runs += [evaluated.split(), (evaluated + " --use-dynapipe").split(), (evaluated + PACKING).split(),
             (evaluated + " --use-dynapipe --dynapipe-placement interleaved").split()]
    # torch_dist (Megatron-LM's default format): interrupted after 2, resumed on the even split and on 2+1,0+1.
    runs += [(TINY + f" --exit-interval 2 --save {t5_dist / 'cut'}").split(),
             (TINY + f" --load {t5_dist / 'cut'} --save {t5_dist / 'resumed'}").split(),
             (TINY + f" --dynapipe-placement 2+1,0+1 --load {t5_dist / 'cut'} --save {t5_dist / 'placed'}").split()]
    # Interleaved checkpoints: the even split's resumed interleaved; interleaved ones resumed on the
    # even split (torch_dist) and interleaved again (the per-stage format).
    il = TINY + " --dynapipe-placement interleaved"
    runs += [(il + f" --load {t5_dist / 'cut'} --save {t5_dist / 'il_resumed'}").split(),
             (il + f" --exit-interval 2 --save {t5_dist / 'il_cut'}").split(),
             (TINY + f" --load {t5_dist / 'il_cut'} --save {t5_dist / 'from_il'}").split(),
             (il + f" --exit-interval 2 --ckpt-format dynapipe --save {save / 'il'}").split(),
             (il + f" --ckpt-format dynapipe --load {save / 'il'}").split()]
    # bf16 (Float16Module, fp32 main copies): padding for 3 iterations, the same cut after 2 with a
    # torch_dist checkpoint and resumed for the third; DynaPipe; packing. fp16: padding, DynaPipe.
    bf16 = TINY + " --bf16"
    runs += [bf16.split(), (bf16 + f" --exit-interval 2 --save {t5_dist / 'bf16_cut'}").split(),
             (bf16 + f" --load {t5_dist / 'bf16_cut'}").split(), (bf16 + " --use-dynapipe").split(),
             (bf16 + PACKING).split(), (TINY + " --fp16").split(), (TINY + " --fp16 --use-dynapipe").split()]
    # The zero-bubble schedule (the backward split into input and weight parts), two iterations.
    runs += [(dyn + " --dynapipe-schedule zb-h1 --exit-interval 2").split(),
             (interleaved + " --use-dynapipe --dynapipe-schedule zb-h1").split()]
    # The interleaved placement under --dynapipe-schedule adaptive (the interleaved adaptive schedule on chunks).
    runs += [(interleaved + " --use-dynapipe --dynapipe-schedule adaptive").split()]
    # Packing with each sample's attention (encoder, decoder, cross) computed alone.
    runs += [(TINY + PACKING + f" --dynapipe-packed-attention per-sample --dynapipe-trace-dir "
              f"{t5_dist / 'per-sample-traces'}").split()]
    # DynaPipe's own rows with each sample's attention alone (the padding tails skipped).
    runs += [(dyn + f" --dynapipe-padded-attention per-sample --dynapipe-trace-dir "
                    f"{t5_dist / 'padded-per-sample-traces'}").split()]
    # A weighted blend of JSONL (input, target) pairs: 8 iterations; the same cut after 4 and
    # resumed with --train-iters 16, which would size another blend (constant LR: the losses
    # depend on the data alone). Last, so the tests above index the runs as before.
    pairs = tmp_path_factory.mktemp("t5blend")
    write_pairs(pairs / "short.jsonl", 30, (3, 12), seed=1)
    write_pairs(pairs / "long.jsonl", 10, (30, 60), seed=2)
    # Short JSONL pairs, several to a packed row: padding, and per-sample packing through the
    # DynaPipe executor (its planner packs, its search schedules), two iterations.
    short = (TINY.replace("--mock-data", f"--split 100,0,0 --data-path {pairs / 'short.jsonl'}")
             .replace("--train-iters 3", "--train-iters 2").replace("--vocab-size 256", "--vocab-size 320"))
    runs += [short.split(), (short + PACKING + " --use-dynapipe --dynapipe-packed-attention per-sample").split(),
             (short + PACKING).split()]
    blended = (TINY.replace("--mock-data", f"--split 100,0,0 --lr-decay-style constant --data-path 0.75 "
                                           f"{pairs / 'short.jsonl'} 0.25 {pairs / 'long.jsonl'}")
               .replace("--train-iters 3", "").replace("--vocab-size 256", "--vocab-size 320") + " --use-dynapipe")
    runs += [(blended + " --train-iters 8").split(),
             (blended + f" --train-iters 8 --exit-interval 4 --save {save / 'blend'}").split(),
             (blended + f" --train-iters 16 --exit-interval 8 --load {save / 'blend'} "
                        f"--override-opt_param-scheduler").split()]
    # --iterations-to-skip 2 on padding and DynaPipe (iteration 2's batch consumed untrained); then
    # --rerun-mode report_stats: every iteration computed twice through the T5 stepper (DynaPipe's
    # executor), the same losses as the DynaPipe run above. Last, after the blend's three runs.
    runs += [(TINY + " --iterations-to-skip 2").split(), (dyn + " --iterations-to-skip 2").split(),
             (dyn + " --exit-interval 2 --rerun-mode report_stats").split()]
    # A non-persistent checkpoint after iteration 1 (the persistent ones at 2 and 3); then a job
    # whose --load (its --save) holds none yet, as after a death before the first persistent
    # save, resumes from it and trains iterations 2 and 3.
    np_dir = t5_dist / "np_global"
    np_flags = f" --non-persistent-ckpt-type global --non-persistent-global-ckpt-dir {np_dir}"
    runs += [(TINY + f" --save {t5_dist / 'np_saved'} --save-interval 2 --non-persistent-save-interval 1"
              + np_flags).split(),
             (TINY + f" --load {t5_dist / 'np_resumed'} --save {t5_dist / 'np_resumed'}" + np_flags).split()]
    # About 3 s a run on an idle host: the limit grows with the runs, so a loaded host is not a hang.
    ranks = run_t5_training(runs, 2, timeout_s=max(TIMEOUT, 20 * len(runs)))
    assert [r["losses"] for r in ranks[1]] == [r["losses"] for r in ranks[0]]  # every rank reports the same
    for i, run in enumerate(ranks[0]):  # what differs by rank, and what was run
        run["parameters_by_rank"], run["argv"] = [ranks[r][i]["parameters"] for r in range(2)], runs[i]
    return ranks[0]
