"""The built-in demo pair: a small Kimi-architecture target and its EAGLE-3 draft.

They ship inside the package as real Hugging Face checkpoints (`jaxspec/demo/target`
in the Kimi-K2.5 layout with INT4 experts, `jaxspec/demo/draft` in SpecForge layout)
and go through exactly the converter and loader the real model uses. The first
run converts them into a user cache directory; later runs reuse it. A cache whose
source fingerprint differs (a new package version) or that is incomplete is
rebuilt.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os

DEMO_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo")
TARGET_DIR = os.path.join(DEMO_DIR, "target")
DRAFT_DIR = os.path.join(DEMO_DIR, "draft")
SOURCE_FILE = "demo_source.json"


def available() -> bool:
    return os.path.exists(os.path.join(TARGET_DIR, "config.json")) and os.path.exists(
        os.path.join(DRAFT_DIR, "config.json")
    )


def cache_root() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxspec")


def fingerprint(dirs=(TARGET_DIR, DRAFT_DIR)) -> str:
    """Hash of the shipped files' names and contents (small: a few MB)."""
    h = hashlib.sha256()
    for d in dirs:
        for name in sorted(os.listdir(d)):
            path = os.path.join(d, name)
            if os.path.isfile(path):
                h.update(name.encode())
                with open(path, "rb") as f:
                    for block in iter(lambda: f.read(1 << 20), b""):
                        h.update(block)
    return h.hexdigest()[:16]


def ensure_converted(cache_dir: str | None = None, progress: bool = True, log=print) -> str:
    """Path of the converted demo checkpoint, converting it first if needed."""
    # Function-local: the demo ships Hugging Face checkpoints and runs the converter on first
    # use; importing it here keeps `checkpoints_convert` (and jaxspec.checkpoint's orbax) out
    # of the runtime's module-level import graph.
    from checkpoints_convert.convert import convert
    from jaxspec import checkpoint

    if not available():
        raise FileNotFoundError(f"the built-in demo model is missing from {DEMO_DIR}; reinstall jaxspec")
    out = cache_dir or os.path.join(cache_root(), "demo")
    want = fingerprint()
    if _current(out, want, checkpoint) is True:
        return out
    # Several processes may start at once on a fresh machine (two runs, parallel tests): one converts
    # while the others wait on the lock, then find the checkpoint complete.
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(os.path.abspath(out) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        state = _current(out, want, checkpoint)
        if state is True:
            return out
        if state == "stale":
            log(f"jaxspec: the demo checkpoint in {out} is from another version; rebuilding it")
        elif os.path.exists(out):
            log(f"jaxspec: the demo checkpoint in {out} is incomplete; rebuilding it")
        log(f"jaxspec: converting the built-in demo model into {out} (once)")
        convert(TARGET_DIR, out, draft_dir=DRAFT_DIR, dtype="bfloat16", progress=progress)
        with open(os.path.join(out, SOURCE_FILE), "w") as f:
            json.dump({"fingerprint": want, "target": TARGET_DIR, "draft": DRAFT_DIR}, f)
    return out


def _current(out: str, want: str, checkpoint):
    """True if `out` holds the converted demo of fingerprint `want`; "stale" for another version's;
    None if it is missing or incomplete (the source record is written last)."""
    try:
        checkpoint.read_config(out)
        with open(os.path.join(out, SOURCE_FILE)) as f:
            return True if json.load(f).get("fingerprint") == want else "stale"
    except (OSError, ValueError):
        return None
