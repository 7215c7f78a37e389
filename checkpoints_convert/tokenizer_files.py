"""Writers for the tokenizer files `jaxspec.tokenizer.KimiTokenizer` reads.

Only the demo builder (`scripts/build_demo_corpus.py`) and tests make tokenizer
files; converting and exporting a checkpoint copy the source's files as they are.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from pathlib import Path

from jaxspec.tokenizer import first_missing_rank


def write_tiktoken_file(path: str | Path, ranks: Mapping[bytes, int]) -> None:
    """Writes ``ranks`` as a tiktoken BPE rank file readable by ``read_tiktoken_file``.

    Args:
      path: output file (e.g. ``model_dir / "tiktoken.model"``).
      ranks: ``{token_bytes: rank}``; ranks must be exactly ``0 .. len-1`` and
        token bytes non-empty.
    """
    if not ranks:
        raise ValueError("expected at least one token rank, found an empty mapping")
    if any(not token for token in ranks):
        raise ValueError("expected non-empty token bytes, found b''")
    gap = first_missing_rank(ranks)
    if gap is not None:
        raise ValueError(f"expected ranks 0..{len(ranks) - 1} without gaps, found rank {gap} missing")
    lines = [
        f"{base64.b64encode(token).decode('ascii')} {rank}\n"
        for token, rank in sorted(ranks.items(), key=lambda item: item[1])
    ]
    Path(path).write_text("".join(lines), encoding="ascii", newline="\n")


def write_tokenizer_config(path: str | Path, specials: Mapping[int, str], bos: str | int, eos: str | int) -> None:
    """Writes a ``tokenizer_config.json`` holding the keys ``KimiTokenizer`` reads.

    Args:
      path: output file (e.g. ``model_dir / "tokenizer_config.json"``).
      specials: ``{special_id: name}`` for the named special ids.
      bos, eos: the begin/end-of-sequence token, as a name or as an id, either
        of which must be in ``specials``.
    """
    names = dict(specials)

    def as_name(token: str | int, field: str) -> str:
        if isinstance(token, int):
            if token not in names:
                raise ValueError(f"{field}: expected an id among the specials, found {token}")
            return names[token]
        if token not in names.values():
            raise ValueError(f"{field}: expected a name among the specials, found {token!r}")
        return token

    config = {
        "added_tokens_decoder": {
            str(token_id): {
                "content": name,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for token_id, name in sorted(names.items())
        },
        "bos_token": as_name(bos, "bos"),
        "eos_token": as_name(eos, "eos"),
    }
    Path(path).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# Kimi-K2.5's named special tokens, as offsets from the first special id
# (the id right after the last base rank). Unnamed offsets become
# <|reserved_token_{id}|> in KimiTokenizer.
KIMI_SPECIAL_OFFSETS = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|im_end|>",
    3: "<|im_user|>",
    4: "<|im_assistant|>",
    6: "<|start_header_id|>",
    7: "<|end_header_id|>",
    9: "[EOT]",
    10: "<|im_system|>",
    11: "<|tool_calls_section_begin|>",
    12: "<|tool_calls_section_end|>",
    13: "<|tool_call_begin|>",
    14: "<|tool_call_argument_begin|>",
    15: "<|tool_call_end|>",
    17: "<|im_middle|>",
    18: "<|media_begin|>",
    19: "<|media_content|>",
    20: "<|media_end|>",
    21: "<|media_pad|>",
    22: "<think>",
    23: "</think>",
    254: "[UNK]",
    255: "[PAD]",
}
