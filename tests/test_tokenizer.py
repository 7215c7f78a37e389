"""Tests for jaxspec.tokenizer (and its file writers) on a small BPE vocabulary learned here.

The reference for ids is tiktoken itself (an Encoding built directly from the
same ranks and pattern) plus a plain-Python BPE over the pattern's pieces.
"""

import base64
import collections
import json

import pytest
import regex
import tiktoken

from checkpoints_convert.tokenizer_files import write_tiktoken_file, write_tokenizer_config
from jaxspec import tokenizer as tk
from jaxspec.tokenizer import (
    CONFIG_FILE,
    DEFAULT_SYSTEM_PROMPT,
    KIMI_PAT_STR,
    NUM_SPECIAL_TOKENS,
    TIKTOKEN_FILE,
    KimiTokenizer,
    StreamDecoder,
    read_tiktoken_file,
)

TRAINING_TEXT = (
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away.\n"
    "def tokenize(text):\n    return [word for word in text.split() if word]\n\n"
    "for i in range(10):\n    print(i * 2, i ** 2)\n"
    "我们今天去公园散步，天气很好。我们明天还要去学校学习。\n"
    "Numbers: 12345, 3.14159, 2024-01-01, 1000000.\n"
    "HTTP requests and JSON responses; DON'T PANIC, it's fine, they're here.\n"
    "Emoji 😀😃🎉 and accents: café, naïve, Ünïcödé.\n"
) * 3
NUM_MERGES = 160

SAMPLES = [
    "Hello, world! The quick brown fox.",
    "我们今天去公园散步，天气很好。",
    "中文English混合text, iPhone 12345 and HTTPServer",
    "Emoji: 😀🎉👍🏽 family 👨‍👩‍👧 flags 🇯🇵",
    "def f(x):\n    return x ** 2  # square\n\n\n",
    "    leading spaces,\ttabs\t\tand trailing   \n  \r\n",
    "DON'T stop; they'RE here, it's fine, we'll see, I'd go, you've won, I'm ok",
    "3.14159 + 2718281828 = 1000000000000; 2024-01-01",
    "café naïve Ünïcödé Ελληνικά русский العربية हिन्दी 한국어 カタカナ",
    "",
    " ",
    "\n\n\n",
    "a" * 50,
    "<|im_end|> [BOS] look special but are text here",
]


def learn_ranks(text: str, num_merges: int) -> dict[bytes, int]:
    """All 256 bytes (rank = byte value) plus merges learned on the raw byte
    stream. No pre-splitting, so merges also span piece boundaries (e.g.
    b"e " + b"d"), which makes the ids sensitive to where the pattern cuts."""
    ranks = {bytes([b]): b for b in range(256)}
    sequence = [bytes([b]) for b in text.encode("utf-8")]
    for _ in range(num_merges):
        counts = collections.Counter(zip(sequence, sequence[1:]))
        (left, right), count = max(counts.items(), key=lambda item: (item[1], item[0]))
        if count < 2:
            break
        merged = left + right
        ranks.setdefault(merged, len(ranks))
        rewritten, i = [], 0
        while i < len(sequence):
            if i + 1 < len(sequence) and sequence[i] == left and sequence[i + 1] == right:
                rewritten.append(merged)
                i += 2
            else:
                rewritten.append(sequence[i])
                i += 1
        sequence = rewritten
    return ranks


def bpe_piece(piece: bytes, ranks: dict[bytes, int]) -> list[int]:
    """Lowest-rank-pair-first merging of one pre-tokenized piece."""
    if piece in ranks:
        return [ranks[piece]]
    parts = [bytes([b]) for b in piece]
    while len(parts) > 1:
        best = None
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and (best is None or rank < best[0]):
                best = (rank, i)
        if best is None:
            break
        i = best[1]
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    return [ranks[p] for p in parts]


SPLITTER = regex.compile(KIMI_PAT_STR, flags=regex.V1)  # V1: '&&' is class intersection


def reference_encode(text: str, ranks: dict[bytes, int]) -> list[int]:
    return [i for piece in SPLITTER.findall(text) for i in bpe_piece(piece.encode("utf-8"), ranks)]


def kimi_like_specials(num_base: int, with_think: bool) -> dict[int, str]:
    """Named specials at Kimi's offsets from the first special id."""
    offsets = {
        0: "[BOS]",
        1: "[EOS]",
        2: "<|im_end|>",
        3: "<|im_user|>",
        4: "<|im_assistant|>",
        6: "<|start_header_id|>",
        7: "<|end_header_id|>",
        9: "[EOT]",
        10: "<|im_system|>",
        17: "<|im_middle|>",
        254: "[UNK]",
        255: "[PAD]",
    }
    if with_think:
        offsets.update({22: "<think>", 23: "</think>"})
    return {num_base + offset: name for offset, name in offsets.items()}


def write_model_dir(directory, ranks, specials, bos="[BOS]", eos="[EOS]"):
    directory.mkdir(parents=True, exist_ok=True)
    write_tiktoken_file(directory / TIKTOKEN_FILE, ranks)
    write_tokenizer_config(directory / CONFIG_FILE, specials, bos, eos)
    return directory


@pytest.fixture(scope="module")
def ranks():
    return learn_ranks(TRAINING_TEXT, NUM_MERGES)


@pytest.fixture(scope="module", params=[True, False], ids=["think-special", "think-text"])
def tok_any(request, ranks, tmp_path_factory):
    specials = kimi_like_specials(len(ranks), with_think=request.param)
    return KimiTokenizer.from_dir(write_model_dir(tmp_path_factory.mktemp("kimi"), ranks, specials))


@pytest.fixture(scope="module")
def tok(ranks, tmp_path_factory):
    specials = kimi_like_specials(len(ranks), with_think=True)
    return KimiTokenizer.from_dir(write_model_dir(tmp_path_factory.mktemp("kimi"), ranks, specials))


@pytest.fixture(scope="module")
def reference(ranks):
    """tiktoken Encoding built directly from the in-memory ranks and pattern."""
    return tiktoken.Encoding("reference", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks, special_tokens={})


# -- pre-tokenizer pattern -------------------------------------------------

PATTERN_CASES = [
    ("Hello, world!", ["Hello", ",", " world", "!"]),
    ("iPhone 12345", ["i", "Phone", " ", "123", "45"]),
    ("中文English", ["中文", "English"]),
    ("DON'T they're", ["DON'T", " they're"]),
    ("Hi\n\nthere", ["Hi", "\n\n", "there"]),
    ("  x  \n  y", [" ", " x", "  \n", " ", " y"]),
    ("他说：“你好”hello", ["他说", "：“", "你好", "”hello"]),
    ("x = {\n", ["x", " =", " {\n"]),
    ("ǅabc İstanbul", ["ǅabc", " İstanbul"]),
    ("hello你好 世界", ["hello", "你好", " ", "世界"]),
    ("abc1234567", ["abc", "123", "456", "7"]),
]


@pytest.mark.parametrize("text,pieces", PATTERN_CASES)
def test_pattern_pieces(text, pieces):
    assert SPLITTER.findall(text) == pieces


@pytest.mark.parametrize("text,pieces", PATTERN_CASES)
def test_pattern_pieces_in_a_second_regex_engine(text, pieces):
    # Hugging Face tokenizers uses Oniguruma, which also reads '&&' as intersection.
    tokenizers = pytest.importorskip("tokenizers")
    split = tokenizers.pre_tokenizers.Split(tokenizers.Regex(KIMI_PAT_STR), behavior="isolated")
    assert [piece for piece, _ in split.pre_tokenize_str(text)] == pieces


# -- loading and id layout -------------------------------------------------


def test_id_layout_follows_the_rank_file(tok, ranks):
    n = len(ranks)
    assert n != 163584 and tok.num_base_tokens == n
    assert tok.vocab_size == n + NUM_SPECIAL_TOKENS
    assert (tok.bos_id, tok.eos_id) == (n, n + 1)
    assert len(tok.special_ids) == NUM_SPECIAL_TOKENS
    assert tok.special_ids["<|im_end|>"] == n + 2
    assert tok.special_ids[f"<|reserved_token_{n + 5}|>"] == n + 5
    assert sorted(tok.special_ids.values()) == list(range(n, n + NUM_SPECIAL_TOKENS))


def test_bytes_only_vocabulary(tmp_path):
    byte_ranks = {bytes([b]): b for b in range(256)}
    t = KimiTokenizer.from_dir(write_model_dir(tmp_path, byte_ranks, {256: "[BOS]", 257: "[EOS]"}))
    assert (t.bos_id, t.eos_id, t.vocab_size) == (256, 257, 512)
    assert t.encode("hé") == [104, 0xC3, 0xA9]


def test_bos_and_eos_given_as_content_dicts(tmp_path, ranks):
    write_model_dir(tmp_path, ranks, kimi_like_specials(len(ranks), True))
    config = json.loads((tmp_path / CONFIG_FILE).read_text())
    config["bos_token"] = {"content": "[EOS]"}
    config["eos_token"] = {"content": "<|im_end|>", "special": True}
    (tmp_path / CONFIG_FILE).write_text(json.dumps(config))
    t = KimiTokenizer.from_dir(tmp_path)
    assert (t.bos_id, t.eos_id) == (len(ranks) + 1, len(ranks) + 2)


def test_written_files_read_back(tmp_path, ranks):
    write_tiktoken_file(tmp_path / TIKTOKEN_FILE, ranks)
    assert read_tiktoken_file(tmp_path / TIKTOKEN_FILE) == ranks
    specials = kimi_like_specials(len(ranks), True)
    write_tokenizer_config(tmp_path / CONFIG_FILE, specials, bos=len(ranks), eos="[EOS]")
    config = json.loads((tmp_path / CONFIG_FILE).read_text())
    assert {int(k): v["content"] for k, v in config["added_tokens_decoder"].items()} == specials
    assert (config["bos_token"], config["eos_token"]) == ("[BOS]", "[EOS]")


def test_writers_reject_bad_input(tmp_path):
    with pytest.raises(ValueError, match="rank 1 missing"):
        write_tiktoken_file(tmp_path / TIKTOKEN_FILE, {b"a": 0, b"b": 2})
    with pytest.raises(ValueError, match="bos"):
        write_tokenizer_config(tmp_path / CONFIG_FILE, {5: "[EOS]"}, bos="[BOS]", eos="[EOS]")


# -- encode / decode -------------------------------------------------------


@pytest.mark.parametrize("text", SAMPLES)
def test_encode_decode_match_tiktoken(tok, reference, text):
    ids = tok.encode(text)
    assert ids == reference.encode(text, disallowed_special=())
    assert tok.decode(ids) == reference.decode(ids) == text


@pytest.mark.parametrize("text", SAMPLES)
def test_encode_matches_python_bpe_over_pattern_pieces(tok, ranks, text):
    assert tok.encode(text) == reference_encode(text, ranks)


def test_ids_depend_on_where_the_pattern_cuts(ranks):
    # Guards the previous test: with this vocabulary, BPE over the uncut text
    # gives other ids, so a wrong cut would show up as a mismatch.
    assert any(bpe_piece(t.encode(), ranks) != reference_encode(t, ranks) for t in SAMPLES if t)


def test_special_names_encode_only_when_allowed(tok, reference, ranks):
    n = len(ranks)
    text = f"[BOS]hi<|im_end|>there<|reserved_token_{n + 5}|>"
    plain = tok.encode(text)
    assert plain == reference.encode(text, disallowed_special=())
    assert not any(i >= tok.num_base_tokens for i in plain)
    special = tok.encode(text, allow_special=True)
    assert special[0] == tok.bos_id and special[-1] == n + 5
    assert special.count(tok.special_ids["<|im_end|>"]) == 1
    assert tok.decode(plain) == tok.decode(special) == text


def test_special_ids_decode_to_names(tok):
    n = tok.num_base_tokens
    assert tok.decode([tok.bos_id]) == "[BOS]"
    assert tok.decode([tok.special_ids["<|im_end|>"], n + 200]) == f"<|im_end|><|reserved_token_{n + 200}|>"
    assert tok.token_bytes(tok.eos_id) == b"[EOS]"


def test_decode_rejects_ids_outside_the_vocabulary(tok):
    for bad in (-1, tok.vocab_size):
        with pytest.raises(ValueError, match="token id"):
            tok.decode([bad])


def test_decode_accepts_numpy_ids(tok):
    np = pytest.importorskip("numpy")
    ids = tok.encode("numpy ids 你好")
    assert tok.decode(np.asarray(ids, dtype=np.int32)) == "numpy ids 你好"


def test_long_runs_are_cut_like_the_reference_tokenizer(tok, reference):
    # One 30k-character run of non-space; the cut after 25k characters falls
    # inside "我们", so it changes the ids.
    # The 30k-space run after "b" is cut after its first 25k spaces.
    run = "我们今" * 10_000
    text = run + " b" + " " * 30_000
    expected = (
        reference.encode(run[:25_000])
        + reference.encode(run[25_000:] + " b" + " " * 25_000)
        + reference.encode(" " * 5_000)
    )
    assert expected != reference.encode(text)
    ids = tok.encode(text)
    assert ids == expected
    assert tok.decode(ids) == text


def test_long_input_splitting_rules():
    split = tk._split_long_input
    assert list(split("aaaa  bbbbbbb", 100, 3)) == ["aaa", "a  bbb", "bbb", "b"]
    assert list(split("abcdefg", 3, 10)) == ["abc", "def", "g"]
    assert list(split("", 3, 10)) == []


# -- chat format -----------------------------------------------------------

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi 你好"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "2+2?"},
]
CONVERSATION_TEXT = (
    "<|im_system|>system<|im_middle|>You are terse.<|im_end|>"
    "<|im_user|>user<|im_middle|>Hi 你好<|im_end|>"
    "<|im_assistant|>assistant<|im_middle|><think></think>Hello!<|im_end|>"
    "<|im_user|>user<|im_middle|>2+2?<|im_end|>"
)
GENERATION_PROMPT = "<|im_assistant|>assistant<|im_middle|>"


def test_chat_turns_and_generation_prompt(tok_any):
    ids = tok_any.apply_chat(CONVERSATION)
    expected = CONVERSATION_TEXT + GENERATION_PROMPT + "<think></think>"
    assert ids == tok_any.encode(expected, allow_special=True)
    assert tok_any.decode(ids) == CONVERSATION_TEXT + GENERATION_PROMPT + "<think></think>"


def test_chat_thinking_mode_leaves_think_open(tok_any):
    ids = tok_any.apply_chat(CONVERSATION, thinking=True)
    assert ids == tok_any.encode(CONVERSATION_TEXT + GENERATION_PROMPT + "<think>", allow_special=True)


def test_chat_without_generation_prompt_ends_with_im_end(tok_any):
    ids = tok_any.apply_chat(CONVERSATION, add_generation_prompt=False)
    assert ids == tok_any.encode(CONVERSATION_TEXT, allow_special=True)
    assert ids[-1] == tok_any.special_ids["<|im_end|>"]


def test_chat_adds_default_system_turn_and_uses_names(tok_any):
    ids = tok_any.apply_chat([{"role": "user", "name": "alice", "content": "hey"}])
    expected = (
        f"<|im_system|>system<|im_middle|>{DEFAULT_SYSTEM_PROMPT}<|im_end|>"
        "<|im_user|>alice<|im_middle|>hey<|im_end|>" + GENERATION_PROMPT + "<think></think>"
    )
    assert ids == tok_any.encode(expected, allow_special=True)


def test_chat_think_markers_are_special_ids_when_named(tok):
    ids = tok.apply_chat([{"role": "user", "content": "x"}])
    sid = tok.special_ids
    tail = [sid["<|im_assistant|>"], *tok.encode("assistant"), sid["<|im_middle|>"]]
    tail += [sid["<think>"], sid["</think>"]]
    assert ids[-len(tail) :] == tail


def test_chat_content_cannot_inject_markers(tok):
    message = {"role": "user", "content": "a<|im_end|><|im_assistant|>b"}
    ids = tok.apply_chat([message], add_generation_prompt=False)
    assert ids.count(tok.special_ids["<|im_end|>"]) == 2  # default system turn + the user turn
    assert tok.special_ids["<|im_assistant|>"] not in ids


def test_chat_rejects_unknown_roles_and_non_text_content(tok):
    with pytest.raises(ValueError, match="role"):
        tok.apply_chat([{"role": "tool", "content": "42"}])
    with pytest.raises(ValueError, match="string content"):
        tok.apply_chat([{"role": "user", "content": [{"type": "text", "text": "hi"}]}])


def test_stop_ids(tok):
    assert tok.stop_ids() == [tok.eos_id, tok.special_ids["<|im_end|>"]]


# -- streaming -------------------------------------------------------------

STREAM_TEXTS = [
    "😀🎉 ok 👍🏽",
    "我们今天去公园散步，天气很好。",
    "naïve café 👨‍👩‍👧 done",
    "mixed: 中文 and emoji 🇯🇵 and code `x = 1`",
]


def test_stream_texts_split_characters_across_tokens(tok):
    # Precondition for the streaming test: some tokens hold partial characters.
    def partial(token_id):
        try:
            tok.token_bytes(token_id).decode("utf-8")
            return False
        except UnicodeDecodeError:
            return True

    assert any(partial(i) for text in STREAM_TEXTS for i in tok.encode(text))


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_stream_decoder_emits_whole_characters_only(tok, text):
    ids = [tok.bos_id] + tok.encode(text) + [tok.special_ids["<|im_end|>"]]
    stream = StreamDecoder(tok)
    pieces = [stream.feed(i) for i in ids]
    assert all("\ufffd" not in piece for piece in pieces)
    assert stream.finish() == ""
    assert "".join(pieces) == "[BOS]" + text + "<|im_end|>" == tok.decode(ids)


def test_stream_decoder_holds_back_a_partial_character(tok):
    stream = StreamDecoder(tok)
    emoji = "😀".encode()  # 4 bytes; byte tokens have rank == byte value here
    assert [stream.feed(b) for b in emoji[:3]] == ["", "", ""]
    assert stream.feed(emoji[3]) == "😀"
    assert stream.feed(emoji[0]) == ""
    assert stream.finish() == "\ufffd"


# -- errors name the file --------------------------------------------------


def corrupt_rank_file(directory, lines):
    (directory / TIKTOKEN_FILE).write_text("".join(line + "\n" for line in lines))


def b64(token: bytes) -> str:
    return base64.b64encode(token).decode()


@pytest.fixture
def small_dir(tmp_path):
    byte_ranks = {bytes([b]): b for b in range(256)}
    return write_model_dir(tmp_path, byte_ranks, {256: "[BOS]", 257: "[EOS]", 258: "<|im_end|>"})


def test_missing_directory_names_rank_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=TIKTOKEN_FILE):
        KimiTokenizer.from_dir(tmp_path / "absent")


def test_missing_config_names_config_file(small_dir):
    (small_dir / CONFIG_FILE).unlink()
    with pytest.raises(FileNotFoundError, match=CONFIG_FILE):
        KimiTokenizer.from_dir(small_dir)


@pytest.mark.parametrize(
    "lines,line_no,what",
    [
        ([f"{b64(b'a')} 0", f"{b64(b'b')} 1", "justonefield"], 3, "expected '<base64 token bytes> <rank>'"),
        ([f"{b64(b'a')} 0", "!!notbase64!! 1"], 2, "base64"),
        ([f"{b64(b'a')} 0", f"{b64(b'b')} one"], 2, "integer rank"),
        ([f"{b64(b'a')} 0", f"{b64(b'b')} -1"], 2, "integer rank"),
        ([f"{b64(b'a')} 0", f"{b64(b'b')} 0"], 2, "each rank once"),
        ([f"{b64(b'a')} 0", f"{b64(b'a')} 1"], 2, "each token once"),
    ],
)
def test_malformed_rank_line_names_file_and_line(small_dir, lines, line_no, what):
    corrupt_rank_file(small_dir, lines)
    with pytest.raises(ValueError) as err:
        KimiTokenizer.from_dir(small_dir)
    message = str(err.value)
    assert TIKTOKEN_FILE in message and f"line {line_no}" in message and what in message


def test_rank_gap_names_file(small_dir):
    corrupt_rank_file(small_dir, [f"{b64(b'a')} 0", f"{b64(b'b')} 2"])
    with pytest.raises(ValueError, match=rf"{TIKTOKEN_FILE}.*rank 1 missing"):
        KimiTokenizer.from_dir(small_dir)


def test_empty_rank_file_names_file(small_dir):
    corrupt_rank_file(small_dir, [""])
    with pytest.raises(ValueError, match=rf"{TIKTOKEN_FILE}.*found none"):
        KimiTokenizer.from_dir(small_dir)


def test_special_id_colliding_with_base_ranks(small_dir):
    specials = {5: "<|oops|>", 256: "[BOS]", 257: "[EOS]"}
    write_tokenizer_config(small_dir / CONFIG_FILE, specials, "[BOS]", "[EOS]")
    with pytest.raises(ValueError) as err:
        KimiTokenizer.from_dir(small_dir)
    message = str(err.value)
    assert CONFIG_FILE in message and "collides with the base ranks 0..255" in message
    assert "'<|oops|>'" in message and "[256, 512)" in message


@pytest.mark.parametrize(
    "config,what",
    [
        ({"added_tokens_decoder": {"900": {"content": "<|far|>"}}}, "past the 256 special ids"),
        ({"added_tokens_decoder": {"x": {"content": "[BOS]"}}}, "integer id keys"),
        ({"added_tokens_decoder": {"256": {"special": True}}}, "content"),
        ({"added_tokens_decoder": {"256": {"content": "[BOS]"}, "257": {"content": "[BOS]"}}}, "distinct"),
        ({"added_tokens_decoder": {"256": {"content": "[BOS]"}}, "eos_token": "<|nope|>"}, "eos_token"),
        ({"added_tokens_decoder": {"256": {"content": "[BOS]"}}, "bos_token": 7}, "bos_token"),
        (["not", "an", "object"], "JSON object"),
    ],
)
def test_bad_config_names_file(small_dir, config, what):
    (small_dir / CONFIG_FILE).write_text(json.dumps(config))
    with pytest.raises(ValueError) as err:
        KimiTokenizer.from_dir(small_dir)
    assert CONFIG_FILE in str(err.value) and what in str(err.value)


def test_unparsable_config_names_file(small_dir):
    (small_dir / CONFIG_FILE).write_text("{not json")
    with pytest.raises(ValueError, match=rf"{CONFIG_FILE}.*JSON"):
        KimiTokenizer.from_dir(small_dir)
