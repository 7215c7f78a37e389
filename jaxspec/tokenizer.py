"""Kimi-K2.5 tokenizer: byte-level BPE over a tiktoken rank file, Kimi's special
tokens, Kimi's chat turn format, and streaming detokenization.

Files read from a Hugging Face style model directory:

* ``tiktoken.model`` -- one line per base token: ``<base64 token bytes> <rank>``.
  Ranks must be exactly ``0 .. N-1`` (N = 163584 for Kimi, but N is always
  taken from the file). A token's rank is its id.
* ``tokenizer_config.json`` -- ``added_tokens_decoder`` maps id strings to
  ``{"content": name, ...}``; ``bos_token`` / ``eos_token`` are names (either
  plain strings or ``{"content": name}`` dicts).

Id layout: base ids ``0 .. N-1``, then ``NUM_SPECIAL_TOKENS`` (256) special ids
``N .. N+255``. Special ids without a name in the config are called
``<|reserved_token_{id}|>``. For Kimi: ``[BOS]`` = 163584, ``[EOS]`` = 163585,
``<|im_end|>`` = 163586, vocab size 163840.

BPE merging itself runs in ``tiktoken`` (a declared dependency); this module
supplies the file readers, the pre-tokenizer pattern, the special-token table,
the chat format and the long-input splitting that Kimi's reference tokenizer
does. Writing these files (the demo builder, tests) is
:mod:`checkpoints_convert.tokenizer_files`.
"""

from __future__ import annotations

import base64
import binascii
import codecs
import json
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import tiktoken

from jaxspec.cli import UsageError

TIKTOKEN_FILE = "tiktoken.model"
CONFIG_FILE = "tokenizer_config.json"

# Kimi reserves a fixed block of special ids right after the base ranks.
NUM_SPECIAL_TOKENS = 256

# System turn that Kimi's chat template inserts when the conversation does not
# start with a system message.
DEFAULT_SYSTEM_PROMPT = "You are Kimi, an AI assistant created by Moonshot AI."

# Pre-tokenizer: text is first cut into pieces by this pattern, and BPE merges
# happen only inside a piece. It is written in the syntax of Rust's regex /
# fancy-regex engine used by tiktoken: ``[A&&[^B]]`` is a character-class
# intersection ("in A but not in B"). Python's ``regex`` module reads it the
# same way only with the ``regex.V1`` flag. The alternatives are tried left to
# right at each position.
#
# Shorthand: "Han" = CJK ideographs (script Han); "letter" below never
# includes Han, because the letter classes are intersected with [^\p{Han}].
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_UPPERISH = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"  # upper/title/modifier/other letters, marks
_LOWERISH = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"  # lower/modifier/other letters, marks
_PREFIX = r"[^\r\n\p{L}\p{N}]?"  # at most one leading char that is no letter, digit or line break
_PRETOKENIZE_PIECES = (
    # 1. A run of Han characters. Chinese has no spaces between words, so a
    #    whole run is one piece and BPE decides the word boundaries.
    r"[\p{Han}]+",
    # 2. A word that ends in lower case: optional leading space/punctuation,
    #    any capitals, then at least one lower-case letter, then an optional
    #    English contraction ('s, 't, 're, 've, 'm, 'll, 'd; any case).
    #    "Hello" -> "Hello", " world" -> " world", "iPhone" -> "i", "Phone".
    _PREFIX + _UPPERISH + "*" + _LOWERISH + "+" + _CONTRACTION,
    # 3. A word that starts with capitals (all-caps words such as "DON'T",
    #    "HTTP"), with an optional lower-case tail and contraction.
    _PREFIX + _UPPERISH + "+" + _LOWERISH + "*" + _CONTRACTION,
    # 4. Digits in groups of at most three: "12345" -> "123", "45".
    r"\p{N}{1,3}",
    # 5. A run of punctuation/symbols with an optional leading space, keeping
    #    any line breaks that directly follow it: " {\n", "：“".
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    # 6. Whitespace that ends in line breaks: "  \n", "\n\n".
    r"\s*[\r\n]+",
    # 7. Whitespace not followed by a non-space: trailing whitespace, or a
    #    space run minus its last space, which then leads the next word.
    r"\s+(?!\S)",
    # 8. Any other whitespace (a single space before a digit, say).
    r"\s+",
)
KIMI_PAT_STR = "|".join(_PRETOKENIZE_PIECES)

# Very long inputs are cut before BPE, exactly where Kimi's reference
# tokenizer cuts them: every 400k characters, and inside any run of
# whitespace or of non-whitespace longer than 25k characters. The cuts keep
# tiktoken's regex matcher away from pathological run lengths; matching the
# reference's cut points keeps our ids identical to it.
_MAX_ENCODE_CHARS = 400_000
_MAX_SAME_CLASS_RUN = 25_000

# Chat markers (special tokens of Kimi's vocabulary).
_IM_END = "<|im_end|>"
_IM_MIDDLE = "<|im_middle|>"
_ROLE_MARKERS = {
    "system": "<|im_system|>",
    "user": "<|im_user|>",
    "assistant": "<|im_assistant|>",
}
_THINK_OPEN = "<think>"
_THINK_CLOSE = "</think>"


class TokenizerError(UsageError):
    """A tokenizer file (tiktoken.model, tokenizer_config.json) whose content jaxspec cannot use."""


def read_tiktoken_file(path: str | Path) -> dict[bytes, int]:
    """Reads a tiktoken BPE rank file.

    Args:
      path: file with lines ``<base64 token bytes> <rank>``; blank lines are
        ignored.

    Returns:
      ``{token_bytes: rank}`` with ranks exactly ``0 .. len-1``.

    Raises:
      FileNotFoundError: the file does not exist.
      TokenizerError (a ValueError): a malformed line (message names file and line number), a
        repeated token or rank, or ranks that are not ``0 .. N-1``.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: expected a tiktoken BPE file ('<base64 token bytes> <rank>' per line), found no such file"
        )
    ranks: dict[bytes, int] = {}
    line_of_rank: dict[int, int] = {}
    line_of_token: dict[bytes, int] = {}
    with path.open("rb") as lines:
        for line_no, raw in enumerate(lines, start=1):
            line = raw.strip()
            if not line:
                continue
            fields = line.split()
            where = f"{path}, line {line_no}"
            if len(fields) != 2:
                raise TokenizerError(f"{where}: expected '<base64 token bytes> <rank>', found {_excerpt(line)}")
            encoded, rank_text = fields
            try:
                token = base64.b64decode(encoded, validate=True)
            except (binascii.Error, ValueError):
                raise TokenizerError(f"{where}: expected base64 token bytes, found {_excerpt(encoded)}") from None
            if not token:
                raise TokenizerError(f"{where}: expected non-empty token bytes, found {_excerpt(encoded)}")
            if not rank_text.isdigit():
                raise TokenizerError(f"{where}: expected a non-negative integer rank, found {_excerpt(rank_text)}")
            rank = int(rank_text)
            if token in line_of_token:
                raise TokenizerError(
                    f"{where}: expected each token once, found token {token!r} "
                    f"again (first on line {line_of_token[token]})"
                )
            if rank in line_of_rank:
                raise TokenizerError(
                    f"{where}: expected each rank once, found rank {rank} again (first on line {line_of_rank[rank]})"
                )
            ranks[token] = rank
            line_of_token[token] = line_no
            line_of_rank[rank] = line_no
    if not ranks:
        raise TokenizerError(f"{path}: expected at least one '<base64 token bytes> <rank>' line, found none")
    gap = first_missing_rank(ranks)
    if gap is not None:
        raise TokenizerError(
            f"{path}: expected ranks 0..{len(ranks) - 1} without gaps (special ids follow "
            f"the last rank), found rank {gap} missing and a largest rank of {max(ranks.values())}"
        )
    return ranks


class KimiTokenizer:
    """Kimi-K2.5 tokenizer.

    Attributes:
      vocab_size: number of base ranks + ``num_special`` (163840 for Kimi).
      num_base_tokens: number of base ranks N; special ids start at N.
      bos_id, eos_id: ids of the begin/end-of-sequence tokens.
      special_ids: ``{name: id}`` for every special id, reserved ones included.
    """

    def __init__(
        self,
        ranks: Mapping[bytes, int],
        special_names: Mapping[int, str],
        bos_token: str = "[BOS]",
        eos_token: str = "[EOS]",
        num_special: int = NUM_SPECIAL_TOKENS,
        name: str = "kimi",
    ):
        """Builds the tokenizer from in-memory tables (``from_dir`` reads them from files).

        Args:
          ranks: ``{token_bytes: rank}`` with ranks exactly ``0 .. N-1``.
          special_names: ``{id: name}`` for named special ids, each in
            ``[N, N + num_special)``; unnamed ids there become
            ``<|reserved_token_{id}|>``.
          bos_token, eos_token: names of the begin/end-of-sequence tokens.
          num_special: size of the special id block after the base ranks.
          name: label passed to tiktoken.
        """
        num_base = len(ranks)
        if not ranks:
            raise ValueError("expected at least one base rank, found none")
        gap = first_missing_rank(ranks)
        if gap is not None:
            raise ValueError(f"expected base ranks 0..{num_base - 1} without gaps, found rank {gap} missing")
        first, end = num_base, num_base + num_special
        for token_id, token_name in special_names.items():
            if token_id < first:
                raise ValueError(
                    f"special token {token_name!r} has id {token_id}, which collides with the base "
                    f"ranks 0..{num_base - 1}; expected special ids in [{first}, {end})"
                )
            if token_id >= end:
                raise ValueError(
                    f"special token {token_name!r} has id {token_id}, past the {num_special} special "
                    f"ids; expected special ids in [{first}, {end})"
                )
        special_ids: dict[str, int] = {}
        for token_id in range(first, end):
            token_name = special_names.get(token_id, f"<|reserved_token_{token_id}|>")
            if token_name in special_ids:
                raise ValueError(
                    f"expected distinct special token names, found {token_name!r} "
                    f"for ids {special_ids[token_name]} and {token_id}"
                )
            special_ids[token_name] = token_id
        for field, token_name in (("bos_token", bos_token), ("eos_token", eos_token)):
            if token_name not in special_ids:
                raise ValueError(f"{field}: expected one of the special token names, found {token_name!r}")

        self._encoding = tiktoken.Encoding(
            name, pat_str=KIMI_PAT_STR, mergeable_ranks=dict(ranks), special_tokens=special_ids
        )
        self.num_base_tokens: int = num_base
        self.vocab_size: int = end
        self.special_ids: dict[str, int] = special_ids
        self.bos_id: int = special_ids[bos_token]
        self.eos_id: int = special_ids[eos_token]

    @classmethod
    def from_dir(cls, path: str | Path, num_special: int = NUM_SPECIAL_TOKENS) -> KimiTokenizer:
        """Loads ``path/tiktoken.model`` and ``path/tokenizer_config.json``.

        Raises:
          FileNotFoundError: a file is missing (message names it).
          TokenizerError (a ValueError): malformed content (message names the file and, for the
            rank file, the line).
        """
        directory = Path(path)
        bpe_path = directory / TIKTOKEN_FILE
        config_path = directory / CONFIG_FILE
        ranks = read_tiktoken_file(bpe_path)
        special_names, bos_token, eos_token = _read_tokenizer_config(config_path)
        try:
            return cls(ranks, special_names, bos_token, eos_token, num_special, name=directory.name or "kimi")
        except ValueError as err:
            raise TokenizerError(f"{config_path}: {err} ({len(ranks)} base ranks in {bpe_path})") from None

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Text -> token ids (no BOS added).

        Args:
          text: input string.
          allow_special: if True, special token names in ``text`` (e.g.
            ``<|im_end|>``) become their special ids; if False they are
            ordinary text. Keep False for untrusted text.

        Returns:
          list[int] of ids in ``[0, vocab_size)``.
        """
        if allow_special:
            options = {"allowed_special": "all"}
        else:
            options = {"allowed_special": set(), "disallowed_special": ()}
        ids: list[int] = []
        for piece in _split_long_input(text, _MAX_ENCODE_CHARS, _MAX_SAME_CLASS_RUN):
            ids.extend(self._encoding.encode(piece, **options))
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Token ids -> text. Special ids decode to their names; byte sequences
        that are not valid UTF-8 become U+FFFD.

        Args:
          ids: iterable of ints (a list, or a 1-D numpy/jax integer array).
        """
        token_ids = [self._checked_id(token_id) for token_id in ids]
        return self._encoding.decode_bytes(token_ids).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """Raw bytes of one token (a special token's bytes are its UTF-8 name)."""
        return self._encoding.decode_single_token_bytes(self._checked_id(token_id))

    def apply_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        thinking: bool = False,
    ) -> list[int]:
        """Renders a conversation in Kimi's chat format and encodes it.

        Each message is a dict with ``role`` ("system", "user" or
        "assistant"), ``content`` (str or None) and optional ``name``. One turn
        renders as::

            <|im_{role}|>{name or role}<|im_middle|>{content}<|im_end|>

        Following Kimi-K2.5's own chat template (moonshotai Kimi-K2-Thinking /
        Kimi-K2.5 ``chat_template.jinja``), which adds three things to that
        plain shape:

        * a conversation that does not start with a system message gets
          ``<|im_system|>system<|im_middle|>{DEFAULT_SYSTEM_PROMPT}<|im_end|>``
          first;
        * every assistant turn's content is preceded by an empty reasoning
          block ``<think></think>`` (the template's rendering of past turns,
          and of all turns when thinking is off; ``reasoning_content`` of
          messages is not rendered);
        * the generation prompt ``<|im_assistant|>assistant<|im_middle|>`` is
          followed by ``<think></think>`` when ``thinking`` is False
          (non-thinking mode, the default here) or by an open ``<think>`` when
          ``thinking`` is True (the template's default).

        No BOS and no newlines between turns. Tool declarations, tool calls
        and tool results are not supported. Structural markers are inserted as
        special ids; names, contents and the default prompt are encoded as
        text with ``allow_special=False``, so a content containing
        ``<|im_end|>`` cannot end its turn early (the reference template would
        tokenize such text as the special token). ``<think>``/``</think>`` are
        emitted as special ids if the vocabulary names them, else as text.
        Text between two special ids is encoded as one string, so ids equal
        ``encode(rendered_string, allow_special=True)`` for contents free of
        special token names.

        Returns:
          list[int] of token ids.
        """
        segments: list[str | int] = []  # str: text, int: special id

        def turn(marker: str, role_name: str, body: list[str | int]) -> None:
            segments.extend([self._required_special(marker), role_name, self._required_special(_IM_MIDDLE)])
            segments.extend(body)
            segments.append(self._required_special(_IM_END))

        if not messages or messages[0].get("role") != "system":
            turn(_ROLE_MARKERS["system"], "system", [DEFAULT_SYSTEM_PROMPT])
        for index, message in enumerate(messages):
            role = message.get("role")
            if role not in _ROLE_MARKERS:
                raise ValueError(f"message {index}: expected role 'system', 'user' or 'assistant', found {role!r}")
            content = message.get("content")
            if content is None:
                content = ""
            if not isinstance(content, str):
                raise ValueError(f"message {index}: expected string content, found {type(content).__name__}")
            body: list[str | int] = [content]
            if role == "assistant":
                body = [self._marker(_THINK_OPEN), self._marker(_THINK_CLOSE), content]
            turn(_ROLE_MARKERS[role], message.get("name") or role, body)
        if add_generation_prompt:
            segments.extend(
                [
                    self._required_special(_ROLE_MARKERS["assistant"]),
                    "assistant",
                    self._required_special(_IM_MIDDLE),
                    self._marker(_THINK_OPEN),
                ]
            )
            if not thinking:
                segments.append(self._marker(_THINK_CLOSE))
        return self._encode_segments(segments)

    def stop_ids(self) -> list[int]:
        """Ids that end generation: ``[eos_id, <|im_end|> id]`` (the latter if present)."""
        stops = [self.eos_id]
        im_end = self.special_ids.get(_IM_END)
        if im_end is not None and im_end != self.eos_id:
            stops.append(im_end)
        return stops

    # -- internals ---------------------------------------------------------

    def _checked_id(self, token_id: int) -> int:
        token_id = int(token_id)
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"expected a token id in [0, {self.vocab_size}), found {token_id}")
        return token_id

    def _required_special(self, token_name: str) -> int:
        if token_name not in self.special_ids:
            raise TokenizerError(f"chat format needs the special token {token_name!r}, which this vocabulary lacks")
        return self.special_ids[token_name]

    def _marker(self, token_name: str) -> str | int:
        """Special id of ``token_name`` if the vocabulary has it, else the literal text."""
        return self.special_ids.get(token_name, token_name)

    def _encode_segments(self, segments: list[str | int]) -> list[int]:
        ids: list[int] = []
        text_run: list[str] = []
        for segment in segments:
            if isinstance(segment, str):
                text_run.append(segment)
                continue
            # Adjacent texts are joined first: BPE pieces may span their seam.
            ids.extend(self.encode("".join(text_run)))
            text_run.clear()
            ids.append(segment)
        ids.extend(self.encode("".join(text_run)))
        return ids


class StreamDecoder:
    """Incremental detokenizer for generated ids.

    ``feed`` takes one token id and returns only text completed by it. A
    UTF-8 character whose bytes are spread over several tokens is held back
    until its last byte arrives, so no partial character (or U+FFFD for it)
    is ever emitted; the concatenation of all returned strings equals
    ``tokenizer.decode(all_ids)``. Special ids produce their names.
    """

    def __init__(self, tokenizer: KimiTokenizer):
        self._tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        """Adds one token id; returns the newly completed text (possibly "")."""
        return self._utf8.decode(self._tokenizer.token_bytes(token_id))

    def finish(self) -> str:
        """Ends the stream; bytes of an unfinished character come out as U+FFFD."""
        return self._utf8.decode(b"", final=True)


def _read_tokenizer_config(path: Path) -> tuple[dict[int, str], str, str]:
    """Returns ``({special_id: name}, bos_name, eos_name)`` from a tokenizer_config.json."""
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: expected a tokenizer config (JSON with 'added_tokens_decoder', "
            "'bos_token', 'eos_token'), found no such file"
        )
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise TokenizerError(f"{path}: expected a JSON object, found unreadable JSON ({err})") from None
    if not isinstance(config, dict):
        raise TokenizerError(f"{path}: expected a JSON object, found {type(config).__name__}")
    decoder = config.get("added_tokens_decoder", {})
    if not isinstance(decoder, dict):
        raise TokenizerError(
            f"{path}: expected 'added_tokens_decoder' to map ids to token entries, found {type(decoder).__name__}"
        )
    special_names: dict[int, str] = {}
    for key, entry in decoder.items():
        try:
            token_id = int(key)
        except ValueError:
            raise TokenizerError(f"{path}: added_tokens_decoder: expected integer id keys, found {key!r}") from None
        content = entry.get("content") if isinstance(entry, dict) else None
        if not isinstance(content, str) or not content:
            raise TokenizerError(
                f'{path}: added_tokens_decoder[{key!r}]: expected {{"content": <name>, ...}}, found {entry!r}'
            )
        special_names[token_id] = content
    # Defaults are those of Kimi's reference tokenizer class.
    bos_token = _config_token_name(config.get("bos_token", "[BOS]"), "bos_token", path)
    eos_token = _config_token_name(config.get("eos_token", "[EOS]"), "eos_token", path)
    return special_names, bos_token, eos_token


def _config_token_name(value: object, field: str, path: Path) -> str:
    if isinstance(value, dict):
        value = value.get("content")
    if not isinstance(value, str) or not value:
        raise TokenizerError(f'{path}: {field}: expected a token name or {{"content": <name>}}, found {value!r}')
    return value


def _split_long_input(text: str, max_chars: int, max_run: int) -> Iterator[str]:
    """Cuts ``text`` into consecutive pieces (their concatenation is ``text``):
    windows of ``max_chars``, each cut again inside any run of whitespace or of
    non-whitespace characters that grows past ``max_run``. Yields nothing for "".
    """
    for start in range(0, len(text), max_chars):
        window = text[start : start + max_chars]
        if len(window) <= max_run:
            yield window
            continue
        piece_start = 0
        run_length = 0
        run_is_space = window[0].isspace()
        for index, char in enumerate(window):
            is_space = char.isspace()
            if is_space != run_is_space:
                run_is_space = is_space
                run_length = 1
                continue
            run_length += 1
            if run_length > max_run:
                yield window[piece_start:index]
                piece_start = index
                run_length = 1
        yield window[piece_start:]


def first_missing_rank(ranks: Mapping[bytes, int]) -> int | None:
    """Smallest rank in ``0 .. len-1`` that is absent, or None if ranks are exactly that range."""
    present = set(ranks.values())
    if len(present) == len(ranks) and all(0 <= r < len(ranks) for r in present):
        return None
    for rank in range(len(ranks) + 1):
        if rank not in present:
            return rank
    return None  # unreachable: len+1 candidates, at most len present


def _excerpt(raw: bytes, limit: int = 60) -> str:
    text = raw.decode("utf-8", errors="replace")
    return repr(text if len(text) <= limit else text[:limit] + "...")
