"""Megatron-LM's --tokenizer-type: vocabulary size and EOD from the tokenizer, padded as Megatron pads it."""
import json
import os
import sys

import pytest

from dynapipe.errors import DynaPipeError
from megatron_integration.arguments import parse_training_args

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "gpt2-tiny")
VOCAB, MERGES = os.path.join(FIXTURES, "vocab.json"), os.path.join(FIXTURES, "merges.txt")
BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --micro-batch-size 2 "
        "--global-batch-size 8 --lr 1e-3 --mock-data --train-iters 10")
GPT2 = f"--tokenizer-type GPT2BPETokenizer --vocab-file {VOCAB} --merge-file {MERGES}"


def parse(extra: str, world: int = 1, cuda: bool = False):
    return parse_training_args(f"{BASE} {extra}".split(), world, cuda=cuda)


def test_gpt2_bpe_vocabulary_from_its_files(gpu_with_te):
    from megatron_integration.tokenizer import tokenizer_info
    from megatron_integration.arguments import build_parser

    args = build_parser().parse_args(f"{BASE} {GPT2}".split())
    info = tokenizer_info(args)
    # 21 entries, <|endoftext|> last, as in GPT-2's own files (50,257 entries, EOD 50256).
    assert (info.vocab_size, info.eod) == (21, 20)
    m = parse(GPT2).model
    assert (m.unpadded_vocab_size, m.vocab_size) == (21, 128)
    # Megatron pads to a multiple of --make-vocab-size-divisible-by x TP.
    assert parse(f"{GPT2} --make-vocab-size-divisible-by 8").model.vocab_size == 24
    assert parse(f"{GPT2} --make-vocab-size-divisible-by 8 --tensor-model-parallel-size 2", world=2,
                 cuda=True).model.vocab_size == 32


def test_null_tokenizer_counts_as_the_installed_release():
    pytest.importorskip("megatron.core.tokenizers")
    from megatron_integration.tokenizer import null_info, null_library

    if null_library() == "null":
        # megatron-core 0.16 (and Megatron-LM of its time): ids 0..N-1 and the EOD N, N + 1 in all.
        assert (null_info(50256).vocab_size, null_info(50256).eod) == (50257, 50256)
        m = parse("--tokenizer-type NullTokenizer --vocab-size 50256").model
        assert (m.unpadded_vocab_size, m.vocab_size) == (50257, 50304)
        with pytest.raises(DynaPipeError, match="--null-tokenizer-eod-id 7: megatron-core .*drop it"):
            parse("--tokenizer-type NullTokenizer --vocab-size 50256 --null-tokenizer-eod-id 7")
    else:
        # megatron-core 0.19 and Megatron-LM since: N ids, the EOD the last unless given.
        assert (null_info(50256).vocab_size, null_info(50256).eod) == (50256, 50255)
        assert null_info(50256, eod_id=0).eod == 0
        m = parse("--tokenizer-type NullTokenizer --vocab-size 50257").model
        assert (m.unpadded_vocab_size, m.vocab_size) == (50257, 50304)
        with pytest.raises(DynaPipeError, match="--null-tokenizer-eod-id 50256: outside the vocabulary"):
            parse("--tokenizer-type NullTokenizer --vocab-size 50256 --null-tokenizer-eod-id 50256")
    with pytest.raises(DynaPipeError, match="--null-tokenizer-eod-id is read by --tokenizer-type NullTokenizer only"):
        parse("--null-tokenizer-eod-id 3")
    with pytest.raises(DynaPipeError, match="--null-tokenizer-pad-id 0: this build's datasets never pad"):
        parse("--tokenizer-type NullTokenizer --vocab-size 50256 --null-tokenizer-pad-id 0")


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("extra, needle", [
    ("--tokenizer-type GPT2BPETokenizer", "--tokenizer-type GPT2BPETokenizer needs --vocab-file FILE"),
    (f"--tokenizer-type GPT2BPETokenizer --vocab-file {VOCAB}", "needs --merge-file FILE"),
    (f"--tokenizer-type GPT2BPETokenizer --vocab-file /nonexistent.json --merge-file {MERGES}",
     "--vocab-file '/nonexistent.json': no such file"),
    (f"--tokenizer-type ByteLevel --vocab-file {VOCAB} --merge-file {MERGES}",
     "--vocab-file is read by --tokenizer-type GPT2BPETokenizer / BertWordPieceLowerCase / BertWordPieceCase only "
     "(not ByteLevel)"),
    ("--tokenizer-type NullTokenizer", "--tokenizer-type NullTokenizer needs --vocab-size N"),
    ("--tokenizer-type SentencePieceTokenizer --tokenizer-model m", "--tokenizer-type SentencePieceTokenizer: not supported"),
    ("--tokenizer-type HuggingFaceTokenizer", "needs --tokenizer-model"),
    ("--tokenizer-model gpt2", "--tokenizer-model is read by --tokenizer-type HuggingFaceTokenizer only"),
    (f"{GPT2} --vocab-size 50257", "--vocab-size 50257 disagrees with the GPT2BPETokenizer's 21 ids"),
])
def test_tokenizer_flags_refused_with_the_fix(extra, needle):
    with pytest.raises(DynaPipeError) as e:
        parse(extra)
    assert needle in str(e.value)


def test_the_default_type_is_megatron_lms_when_vocabulary_files_are_given():
    # Megatron-LM's pretrain_gpt.py defaults to GPT2BPETokenizer (its T5 script to
    # BertWordPieceLowerCase); without files, where that default could not build, ByteLevel.
    assert parse(f"--vocab-file {VOCAB} --merge-file {MERGES}").data.tokenizer_type == "GPT2BPETokenizer"
    assert parse("").data.tokenizer_type == "ByteLevel"
    with pytest.raises(DynaPipeError, match="GPT2BPETokenizer needs --merge-file FILE"):
        parse(f"--vocab-file {VOCAB}")


def test_malformed_gpt2_files_are_named(tmp_path):
    no_eod = _write(tmp_path, "v.json", json.dumps({"a": 0, "b": 1}))
    with pytest.raises(DynaPipeError, match="has no '<\\|endoftext\\|>' token"):
        parse(f"--tokenizer-type GPT2BPETokenizer --vocab-file {no_eod} --merge-file {MERGES}")
    not_json = _write(tmp_path, "x.json", "a b c")
    with pytest.raises(DynaPipeError, match="is not a GPT-2 vocabulary JSON"):
        parse(f"--tokenizer-type GPT2BPETokenizer --vocab-file {not_json} --merge-file {MERGES}")
    bad_merges = _write(tmp_path, "m.txt", "#version: 0.2\na b c\n")
    with pytest.raises(DynaPipeError, match="line 'a b c' is not a BPE merge"):
        parse(f"--tokenizer-type GPT2BPETokenizer --vocab-file {VOCAB} --merge-file {bad_merges}")
    binary = tmp_path / "m.bin"
    binary.write_bytes(b"a b\n\xff\xfe c\n")
    with pytest.raises(DynaPipeError, match="is not a GPT-2 merges text file \\(not UTF-8: byte 4\\)"):
        parse(f"--tokenizer-type GPT2BPETokenizer --vocab-file {VOCAB} --merge-file {binary}")


def test_huggingface_tokenizer_without_transformers_is_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    with pytest.raises(DynaPipeError, match="needs the transformers package: pip install transformers"):
        parse("--tokenizer-type HuggingFaceTokenizer --tokenizer-model /some/dir")


def test_huggingface_tokenizer_from_a_local_directory(tmp_path):
    # A real Hugging Face tokenizer directory (tokenizer.json + config) built offline from the
    # GPT-2 fixture files, loaded through megatron-core's HuggingFaceTokenizer.
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE.from_file(VOCAB, MERGES))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    eod = "<|endoftext|>"
    hf = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=eod, bos_token=eod, unk_token=eod)
    hf.save_pretrained(str(tmp_path))
    assert hf("hello the world")["input_ids"][:2] == [14, 17]  # "he" + "llo": the fixture's merges applied
    m = parse(f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {tmp_path}").model
    assert (m.unpadded_vocab_size, m.vocab_size) == (21, 128)
    with pytest.raises(DynaPipeError, match="could not load a Hugging Face tokenizer"):
        parse(f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {tmp_path / 'missing'}")


def test_jsonl_with_another_vocabulary_is_refused_with_the_command_line(tmp_path):
    # JSONL is tokenised byte-level: refused while parsing, not after the model is built and loaded.
    pairs = _write(tmp_path, "docs.jsonl", '{"text": "a b c"}\n')
    with pytest.raises(DynaPipeError, match="--tokenizer-type GPT2BPETokenizer: this build tokenises JSONL byte-level"):
        parse_training_args(f"{BASE} {GPT2} --data-path {pairs}".replace("--mock-data ", "").split(), 1, cuda=False)
    assert parse_training_args(f"{BASE} --data-path {pairs}".replace("--mock-data ", "").split(), 1,
                               cuda=False).data.tokenizer_type == "ByteLevel"
