"""Builds the data for the built-in demo model: a corpus of Python standard
library sources, a byte-level BPE tokenizer in Kimi's file format, and the
corpus as token arrays.

    python scripts/build_demo_corpus.py --out DIR [--vocab 4096] [--max-files N]

Corpus: every ``*.py`` file of the running interpreter's standard library,
except ``site-packages``, test directories (``test``, ``tests``,
``idle_test``: odd encodings, huge generated files), files that are not valid
UTF-8 and files over 200 kB. A file is held out when the first byte of the
SHA-256 of its path relative to the stdlib root is below 13 (about 5%), so the
split is the same on every machine with the same Python version.

Tokenizer: byte-level BPE trained with ``tokenizers`` on the train split,
pre-tokenized with Kimi's pattern (``jaxspec.tokenizer.KIMI_PAT_STR``), then
exported as ranks that tiktoken (and so ``KimiTokenizer``) merges the same way.
The script checks that both encode the held-out files to identical ids.

Writes into DIR:

* ``tiktoken.model``, ``tokenizer_config.json`` -- load with
  ``KimiTokenizer.from_dir(DIR)``; special ids follow the base ranks in Kimi's
  layout (``[BOS]`` = N, ``[EOS]`` = N+1, ``<|im_end|>`` = N+2, ...).
* ``bpe_tokenizer.json`` -- the trained BPE as a ``tokenizers`` file whose ids
  equal the tiktoken ranks (for cross-checks).
* ``train.npy``, ``heldout.npy`` -- token ids of each split, every file
  followed by the EOS id; uint16 when the vocabulary fits, else int32.
* ``corpus.json`` -- manifest: Python version, selection rules, file lists,
  character and token counts, tokenizer facts, verification result.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
import sysconfig
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import regex
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from checkpoints_convert.tokenizer_files import (  # noqa: E402
    KIMI_SPECIAL_OFFSETS,
    write_tiktoken_file,
    write_tokenizer_config,
)
from jaxspec.tokenizer import (  # noqa: E402
    CONFIG_FILE,
    KIMI_PAT_STR,
    NUM_SPECIAL_TOKENS,
    TIKTOKEN_FILE,
    KimiTokenizer,
)

MANIFEST_FILE = "corpus.json"
HF_TOKENIZER_FILE = "bpe_tokenizer.json"
SPLITS = ("train", "heldout")

EXCLUDED_DIRS = ("site-packages", "test", "tests", "idle_test")
MAX_FILE_BYTES = 200_000
HELDOUT_BELOW = 13  # first SHA-256 byte < 13 -> held out: 13/256 ~ 5%


# Pre-tokenizer candidates, tried in order. KimiTokenizer always splits with
# Kimi's pattern, so only the first two give ids identical to it: the second
# is Kimi's pattern with its class intersections ("letter but not Han")
# written as lookaheads, for regex engines without '&&'. The last is a
# GPT-style code-friendly fallback whose pieces differ from Kimi's.
_NOT_HAN_UPPERISH = r"(?:(?!\p{Han})[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}])"
_NOT_HAN_LOWERISH = r"(?:(?!\p{Han})[\p{Ll}\p{Lm}\p{Lo}\p{M}])"
KIMI_LOOKAHEAD_PAT_STR = KIMI_PAT_STR.replace(
    r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]", _NOT_HAN_UPPERISH
).replace(r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]", _NOT_HAN_LOWERISH)
GPT_STYLE_PAT_STR = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PATTERN_CANDIDATES = (
    ("kimi", KIMI_PAT_STR),
    ("kimi-lookahead", KIMI_LOOKAHEAD_PAT_STR),
    ("gpt-style", GPT_STYLE_PAT_STR),
)

# Text that exercises every branch of Kimi's pattern; a candidate counts as
# Kimi-equivalent only if it cuts this exactly like the reference engine.
_PATTERN_PROBE = (
    "def f(x, *args):\n    return x**2  # don't\tstop\r\n\n"
    "class HTTPServer(iPhone): DON'T WE'LL 'S ĲÉcole naïve Straße λx 12345 1.5e-3\n"
    "你好世界，“引号”。漢字かなカナ한국어 e\u0301 \u00a0\u3000 \u2028 x  \n  \n"
)


class SourceFile(NamedTuple):
    path: str  # relative to the stdlib root, '/'-separated
    text: str


# -- corpus ------------------------------------------------------------------


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def is_heldout(rel_path: str) -> bool:
    """Stable, machine-independent split by file: hash of the relative path."""
    return hashlib.sha256(rel_path.encode("utf-8")).digest()[0] < HELDOUT_BELOW


def candidate_paths(root: Path) -> list[str]:
    """Relative paths of the stdlib's .py files outside excluded directories, sorted."""
    paths = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if any(part in EXCLUDED_DIRS for part in rel.parts[:-1]) or not path.is_file():
            continue
        paths.append(rel.as_posix())
    return sorted(paths)


def read_corpus(root: Path) -> tuple[list[SourceFile], dict[str, int]]:
    """Reads the candidate files; returns the kept ones and counts of skipped ones."""
    files: list[SourceFile] = []
    skipped = {"too_large": 0, "not_utf8": 0}
    for rel in tqdm(candidate_paths(root), desc="read stdlib", unit="file"):
        raw = (root / rel).read_bytes()
        if len(raw) > MAX_FILE_BYTES:
            skipped["too_large"] += 1
            continue
        try:
            text = raw.decode("utf-8")  # bytes as they are: no newline translation
        except UnicodeDecodeError:
            skipped["not_utf8"] += 1
            continue
        files.append(SourceFile(rel, text))
    return files, skipped


def split_corpus(files: list[SourceFile]) -> dict[str, list[SourceFile]]:
    return {
        "train": [f for f in files if not is_heldout(f.path)],
        "heldout": [f for f in files if is_heldout(f.path)],
    }


def _evenly_spaced(items: list, count: int) -> list:
    return [items[(i * len(items)) // count] for i in range(count)] if count < len(items) else list(items)


def limit_files(splits: dict[str, list[SourceFile]], max_files: int) -> dict[str, list[SourceFile]]:
    """A deterministic subset of at most ``max_files`` files for quick runs.

    Files keep their split; the held-out share is kept (at least one held-out
    file), and files are spread over the whole tree rather than taken from
    its first directories.
    """
    total = sum(len(files) for files in splits.values())
    if max_files >= total:
        return splits
    held = splits["heldout"]
    held_count = min(len(held), max(1, round(max_files * len(held) / total))) if held else 0
    return {
        "train": _evenly_spaced(splits["train"], max_files - held_count),
        "heldout": _evenly_spaced(held, held_count),
    }


# -- tokenizer ---------------------------------------------------------------


def byte_level_chars() -> dict[str, int]:
    """Char -> byte for the byte-level alphabet of ``tokenizers`` (GPT-2's).

    Printable Latin-1 bytes stand for themselves; every other byte is shown
    as U+0100 + n, n counting those bytes in byte order. Token strings of a
    byte-level BPE are spelled in these chars, so this undoes the spelling.
    """
    printable = {
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    }
    chars: dict[str, int] = {}
    shifted = 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + shifted)] = byte
            shifted += 1
    return chars


def choose_pattern() -> tuple[str, str]:
    """First pre-tokenizer pattern that ``tokenizers`` accepts (and, for the
    Kimi variants, that splits the probe text exactly like Kimi's pattern)."""
    from tokenizers import Regex, pre_tokenizers

    reference = regex.compile(KIMI_PAT_STR, flags=regex.V1).findall(_PATTERN_PROBE)
    for name, pattern in PATTERN_CANDIDATES:
        try:
            split = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
        except Exception as err:  # tokenizers raises a plain Exception for regex syntax errors
            print(f"pre-tokenizer {name!r} rejected by tokenizers: {err}", file=sys.stderr)
            continue
        pieces = [piece for piece, _ in split.pre_tokenize_str(_PATTERN_PROBE)]
        if name.startswith("kimi") and pieces != reference:
            print(f"pre-tokenizer {name!r} splits differently from Kimi's pattern; skipped", file=sys.stderr)
            continue
        if not name.startswith("kimi"):
            print(
                f"WARNING: training with the {name!r} pattern; KimiTokenizer splits with Kimi's, "
                "so encodings will differ",
                file=sys.stderr,
            )
        return name, pattern
    raise RuntimeError("tokenizers accepted none of the pre-tokenizer patterns")


def new_byte_level_bpe(pattern: str):
    """An untrained byte-level BPE: ``pattern`` pieces, then bytes as GPT-2 chars."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def train_bpe(texts: list[str], vocab_size: int, pattern: str):
    from tokenizers import pre_tokenizers, trainers

    tokenizer = new_byte_level_bpe(pattern)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, seen or not
        special_tokens=[],
        show_progress=True,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tokenizer


def _merge_pairs(model: dict) -> list[tuple[str, str]]:
    # tokenizers writes merges as "a b" strings (older) or [a, b] lists (newer).
    return [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]


def tiktoken_ranks(tokenizer) -> tuple[dict[bytes, int], int]:
    """Token bytes -> rank for tiktoken, from a trained byte-level BPE.

    Single bytes take ranks 0..255 (by byte value); every merge product then
    takes the next rank in merge order. tiktoken merges the adjacent pair
    whose concatenation has the lowest rank; with these ranks that is the
    pair whose merge was learned first, which is the BPE's own rule. The two
    rules can only disagree when a token is reachable from a pair the BPE
    never merged (e.g. a token learned twice, from different pairs), so the
    build checks equality on the held-out files instead of assuming it.

    Returns the ranks and the number of merges whose product already had a
    rank (recorded in the manifest).
    """
    chars = byte_level_chars()

    def to_bytes(token: str) -> bytes:
        return bytes(chars[c] for c in token)

    model = json.loads(tokenizer.to_str())["model"]
    ranks = {bytes([b]): b for b in range(256)}
    repeated = 0
    for left, right in _merge_pairs(model):
        merged = to_bytes(left) + to_bytes(right)
        if merged in ranks:
            repeated += 1
            continue
        ranks[merged] = len(ranks)
    vocab_bytes = {to_bytes(token) for token in model["vocab"]}
    if vocab_bytes != set(ranks):
        raise RuntimeError(f"BPE vocabulary ({len(vocab_bytes)} tokens) and merge products ({len(ranks)}) disagree")
    return ranks, repeated


def renumbered_bpe(tokenizer, ranks: dict[bytes, int]):
    """The same BPE with token ids equal to the tiktoken ranks.

    Only the ids change: merges, their order and every other setting are
    kept, so the pieces and merges are untouched and ids compare directly.
    """
    from tokenizers import Tokenizer

    chars = byte_level_chars()
    spelled = {byte: char for char, byte in chars.items()}
    state = json.loads(tokenizer.to_str())
    state["model"]["vocab"] = {"".join(spelled[b] for b in token): rank for token, rank in ranks.items()}
    return Tokenizer.from_str(json.dumps(state))


def kimi_specials(num_base: int) -> dict[int, str]:
    return {num_base + offset: name for offset, name in KIMI_SPECIAL_OFFSETS.items()}


def export_tokenizer(out: Path, ranks: dict[bytes, int], hf_tokenizer) -> KimiTokenizer:
    write_tiktoken_file(out / TIKTOKEN_FILE, ranks)
    write_tokenizer_config(out / CONFIG_FILE, kimi_specials(len(ranks)), bos="[BOS]", eos="[EOS]")
    hf_tokenizer.save(str(out / HF_TOKENIZER_FILE))
    return KimiTokenizer.from_dir(out)


def verify_encodings(kimi: KimiTokenizer, hf_tokenizer, files: list[SourceFile], name: str = "held-out") -> dict:
    """Compares KimiTokenizer with the trained BPE file by file, and checks
    that KimiTokenizer round-trips each file."""
    texts = [f.text for f in files]
    hf_ids = [enc.ids for enc in hf_tokenizer.encode_batch(texts, add_special_tokens=False)]
    mismatched, not_round_trip = [], []
    for source, expected in tqdm(zip(files, hf_ids), total=len(files), desc=f"verify {name}", unit="file"):
        ids = kimi.encode(source.text)
        if ids != expected:
            mismatched.append(source.path)
            print(f"MISMATCH {source.path}: {_first_difference(kimi, ids, expected)}", file=sys.stderr)
        if kimi.decode(ids) != source.text:
            not_round_trip.append(source.path)
            print(f"ROUND TRIP FAILED {source.path}", file=sys.stderr)
    return {
        "files": len(files),
        "mismatched_files": mismatched,
        "round_trip_failures": not_round_trip,
    }


def _first_difference(kimi: KimiTokenizer, ids: list[int], expected: list[int]) -> str:
    at = next((i for i, (a, b) in enumerate(zip(ids, expected)) if a != b), min(len(ids), len(expected)))

    def shown(seq: list[int]) -> list[bytes]:
        return [kimi.token_bytes(token) for token in seq[at : at + 4]]

    return f"token {at}: tiktoken {shown(ids)} vs tokenizers {shown(expected)}"


# -- token arrays --------------------------------------------------------------


def encode_split(kimi: KimiTokenizer, files: list[SourceFile], name: str) -> np.ndarray:
    """All files of a split as one id array, each file followed by EOS."""
    dtype = np.uint16 if kimi.vocab_size <= 1 << 16 else np.int32
    ids: list[int] = []
    for source in tqdm(files, desc=f"encode {name}", unit="file"):
        ids.extend(kimi.encode(source.text))
        ids.append(kimi.eos_id)
    return np.asarray(ids, dtype=dtype)


# -- driver --------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="output directory (created if missing)")
    parser.add_argument(
        "--vocab", type=int, default=4096, help="BPE vocabulary size, 256 byte tokens included (default 4096)"
    )
    parser.add_argument("--max-files", type=int, default=None, help="use at most N files (quick runs)")
    args = parser.parse_args(argv)
    if args.vocab < 257:
        parser.error(f"--vocab: expected at least 257 (256 byte tokens + 1 merge), found {args.vocab}")
    if args.max_files is not None and args.max_files < 2:
        parser.error(f"--max-files: expected at least 2 (one file per split), found {args.max_files}")
    return args


def split_stats(files: list[SourceFile], tokens: np.ndarray) -> dict:
    return {
        "files": len(files),
        "chars": sum(len(f.text) for f in files),
        "bytes": sum(len(f.text.encode("utf-8")) for f in files),
        "tokens": int(tokens.size),  # EOS separators included
        "text_tokens": int(tokens.size) - len(files),
    }


def print_summary(manifest: dict, seconds: float) -> None:
    print(f"\n{'split':<8} {'files':>6} {'chars':>12} {'tokens':>11} {'chars/token':>12}")
    for name in SPLITS:
        stats = manifest["splits"][name]
        ratio = stats["chars"] / max(stats["text_tokens"], 1)
        print(f"{name:<8} {stats['files']:>6,} {stats['chars']:>12,} {stats['tokens']:>11,} {ratio:>12.2f}")
    tok = manifest["tokenizer"]
    check = manifest["verification"]
    print(
        f"\nvocab {tok['num_base_tokens']} BPE + {NUM_SPECIAL_TOKENS} special = {tok['vocab_size']}, "
        f"pattern {tok['pretokenizer']!r}, arrays {manifest['arrays']['dtype']}; "
        f"held-out check: {len(check['mismatched_files'])} mismatched / "
        f"{len(check['round_trip_failures'])} round-trip failures in {check['files']} files; "
        f"Python {manifest['python_version']}; {seconds:.1f}s"
    )


def main(argv: list[str] | None = None) -> dict:
    """Runs the whole build; returns the manifest (also written to OUT/corpus.json)."""
    args = parse_args(argv)
    start = time.perf_counter()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    files, skipped = read_corpus(stdlib_root())
    splits = split_corpus(files)
    if args.max_files is not None:
        splits = limit_files(splits, args.max_files)

    pattern_name, pattern = choose_pattern()
    trained = train_bpe([f.text for f in splits["train"]], args.vocab, pattern)
    ranks, repeated_merges = tiktoken_ranks(trained)
    hf_tokenizer = renumbered_bpe(trained, ranks)
    kimi = export_tokenizer(out, ranks, hf_tokenizer)
    verification = verify_encodings(kimi, hf_tokenizer, splits["heldout"])

    arrays = {name: encode_split(kimi, splits[name], name) for name in SPLITS}
    for name, ids in arrays.items():
        np.save(out / f"{name}.npy", ids)

    manifest = {
        "python_version": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "selection": {
            "source": "sysconfig.get_paths()['stdlib'], *.py",
            "excluded_dirs": list(EXCLUDED_DIRS),
            "max_file_bytes": MAX_FILE_BYTES,
            "heldout_rule": f"sha256(relative path, utf-8)[0] < {HELDOUT_BELOW}",
            "max_files": args.max_files,
            "skipped": skipped,
        },
        "splits": {name: split_stats(splits[name], arrays[name]) for name in SPLITS},
        "tokenizer": {
            "requested_bpe_vocab": args.vocab,
            "num_base_tokens": len(ranks),
            "vocab_size": kimi.vocab_size,
            "bos_id": kimi.bos_id,
            "eos_id": kimi.eos_id,
            "pretokenizer": pattern_name,
            "pattern": pattern,
            "repeated_merges": repeated_merges,
            "files": [TIKTOKEN_FILE, CONFIG_FILE, HF_TOKENIZER_FILE],
        },
        "verification": verification,
        "arrays": {
            "dtype": str(arrays["train"].dtype),
            "layout": "each file's ids followed by eos_id, files in 'files' order",
            "files": {name: f"{name}.npy" for name in SPLITS},
        },
        "files": {name: [f.path for f in splits[name]] for name in SPLITS},
    }
    manifest_text = json.dumps(manifest, indent=2, ensure_ascii=False) + "\n"
    (out / MANIFEST_FILE).write_text(manifest_text, encoding="utf-8")
    print_summary(manifest, time.perf_counter() - start)
    return manifest


if __name__ == "__main__":
    main()
