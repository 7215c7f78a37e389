"""scripts/build_demo_corpus.py on a small slice of the standard library."""

import hashlib
import importlib.util
import platform
from pathlib import Path

import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers")

from jaxspec.tokenizer import KimiTokenizer, read_tiktoken_file  # noqa: E402

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "build_demo_corpus.py"
ARGS = ["--max-files", "40", "--vocab", "600"]
OUTPUT_FILES = (
    "corpus.json",
    "tiktoken.model",
    "tokenizer_config.json",
    "bpe_tokenizer.json",
    "train.npy",
    "heldout.npy",
)


def load_script():
    spec = importlib.util.spec_from_file_location("build_demo_corpus", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def script():
    return load_script()


@pytest.fixture(scope="module")
def build(script, tmp_path_factory):
    out = tmp_path_factory.mktemp("demo_corpus")
    manifest = script.main(["--out", str(out), *ARGS])
    return out, manifest


def corpus_text(script, rel_path):
    return (script.stdlib_root() / rel_path).read_bytes().decode("utf-8")


def test_split_is_by_file_and_stable(script, build):
    _, manifest = build
    train, heldout = manifest["files"]["train"], manifest["files"]["heldout"]
    assert len(train) + len(heldout) == 40
    assert heldout, "the quick subset keeps at least one held-out file"
    assert not set(train) & set(heldout)
    for path in train + heldout:
        first_byte = hashlib.sha256(path.encode("utf-8")).digest()[0]
        assert (first_byte < 13) == (path in heldout)
        parts = path.split("/")
        assert parts[-1].endswith(".py")
        assert not {"test", "tests", "idle_test", "site-packages"} & set(parts[:-1])

    files, _ = script.read_corpus(script.stdlib_root())
    first, second = script.split_corpus(files), script.split_corpus(list(reversed(files)))
    assert {name: sorted(f.path for f in split) for name, split in first.items()} == {
        name: sorted(f.path for f in split) for name, split in second.items()
    }
    subset = script.limit_files(first, 40)
    assert {name: [f.path for f in split] for name, split in subset.items()} == manifest["files"]


def test_manifest_records_version_and_counts(script, build):
    _, manifest = build
    assert manifest["python_version"] == platform.python_version()
    assert manifest["tokenizer"]["pretokenizer"] == "kimi"
    assert manifest["verification"]["mismatched_files"] == []
    assert manifest["verification"]["round_trip_failures"] == []
    for name in ("train", "heldout"):
        stats = manifest["splits"][name]
        texts = [corpus_text(script, path) for path in manifest["files"][name]]
        assert stats["files"] == len(texts)
        assert stats["chars"] == sum(map(len, texts))
        assert stats["tokens"] == stats["text_tokens"] + len(texts)


def test_kimi_tokenizer_round_trips_and_matches_tokenizers(script, build):
    out, manifest = build
    kimi = KimiTokenizer.from_dir(out)
    bpe = tokenizers.Tokenizer.from_file(str(out / "bpe_tokenizer.json"))
    texts = [corpus_text(script, path) for path in manifest["files"]["heldout"]]
    texts.append("def 函数(x):  # naïve café 😀 DON'T\r\n\t\treturn x  \n")
    for text in texts:
        ids = kimi.encode(text)
        assert kimi.decode(ids) == text
        assert ids == bpe.encode(text, add_special_tokens=False).ids
        assert max(ids) < kimi.num_base_tokens


def test_special_ids_follow_base_ranks(build):
    out, manifest = build
    n = len(read_tiktoken_file(out / "tiktoken.model"))
    assert n == manifest["tokenizer"]["num_base_tokens"] == 600
    kimi = KimiTokenizer.from_dir(out)
    assert kimi.num_base_tokens == n
    assert kimi.vocab_size == manifest["tokenizer"]["vocab_size"] == n + 256
    assert (kimi.bos_id, kimi.eos_id) == (n, n + 1)
    expected = {
        "<|im_end|>": 2,
        "<|im_user|>": 3,
        "<|im_assistant|>": 4,
        "<|im_system|>": 10,
        "<|im_middle|>": 17,
    }
    for name, offset in expected.items():
        assert kimi.special_ids[name] == n + offset
    assert kimi.stop_ids() == [n + 1, n + 2]


def test_arrays_decode_to_the_corpus(script, build):
    out, manifest = build
    kimi = KimiTokenizer.from_dir(out)
    for name in ("train", "heldout"):
        ids = np.load(out / f"{name}.npy")
        assert ids.dtype == np.uint16
        assert ids.size == manifest["splits"][name]["tokens"]
        texts = [corpus_text(script, path) for path in manifest["files"][name]]
        assert kimi.decode(ids) == "".join(text + "[EOS]" for text in texts)
        ends = np.flatnonzero(ids == kimi.eos_id)
        assert ends.size == len(texts) and ends[-1] == ids.size - 1
        starts = np.concatenate([[0], ends[:-1] + 1])
        for text, start, end in zip(texts, starts, ends):
            assert kimi.decode(ids[start:end]) == text


def test_build_is_deterministic(script, build, tmp_path):
    out, _ = build
    script.main(["--out", str(tmp_path), *ARGS])
    for name in OUTPUT_FILES:
        assert (tmp_path / name).read_bytes() == (out / name).read_bytes(), name
