"""Train an EAGLE-3 draft for a converted target and write it in SpecForge layout.

    python -m jaxspec.train_draft --model CKPT --data corpus.txt tokens.npy --out DRAFT \\
        [--steps 2000 --batch 8 --seq-len 512 --ttt-steps 3 --lr 1e-4 --draft-vocab 32000]

CKPT is a jaxspec checkpoint made by `python -m checkpoints_convert`. --data takes
UTF-8 text files (tokenized with CKPT's tokenizer; one document per file),
.jsonl files (one document per line, field "text") and .npy int token arrays
(1-D: one document; 2-D: one document per row). Documents are joined with the
EOS id (when the model has one) and cut into --seq-len windows.

The draft vocabulary is the --draft-vocab most frequent tokens of the data
(d2t / t2d). Training is EAGLE-3's training-time test on the frozen target's
aux hidden states and argmax predictions (`jaxspec.training.draft_ttt_loss`).
DRAFT/train_state/state.npz holds params, optimizer state, step and vocab map
(written every --save-every steps, at the end, and on Ctrl-C); --resume
continues from it. --init DRAFT starts from an existing SpecForge-layout draft
(its architecture and vocab map; new optimizer and schedule) to fine-tune it.
DRAFT/train_log.jsonl records loss and per-step accuracy.
The finished draft (config.json + model.safetensors) goes to DRAFT itself;
pair it with the target by

    python -m checkpoints_convert --target HF_TARGET --draft DRAFT --out PAIR
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import checkpoint, cli, training
from jaxspec.cli import UsageError
from jaxspec.config import from_dict
from jaxspec.draft import DraftConfig, aux_layer_ids, validate_pair
from jaxspec.draft import init_params as draft_init_params
from jaxspec.model import INT4_DEQUANT_LIMIT
from jaxspec.sharding import replicated

STATE_DIR = "train_state"
STATE_FILE = "state.npz"
LOG_FILE = "train_log.jsonl"
DEFAULT_DRAFT_VOCAB = 32000  # SpecForge's usual reduced vocabulary


def build_parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(prog="python -m jaxspec.train_draft", description=__doc__)
    p.add_argument("--model", required=True, help="converted jaxspec target checkpoint")
    p.add_argument("--data", required=True, nargs="+", help="training files: text, .jsonl or .npy token arrays")
    p.add_argument("--out", required=True, help="output directory for the SpecForge-layout draft")
    p.add_argument(
        "--steps",
        type=int,
        default=2000,
        action=cli.at_least(1),
        help="total optimizer steps (a resumed run keeps the total of the run it continues)",
    )
    p.add_argument("--batch", type=int, default=8, action=cli.at_least(1), help="sequences per step")
    p.add_argument("--seq-len", type=int, default=512, action=cli.at_least(1), help="tokens per training sequence")
    p.add_argument(
        "--ttt-steps", type=int, default=3, action=cli.at_least(1), help="unrolled draft steps of training-time test"
    )
    p.add_argument(
        "--step-decay",
        type=float,
        default=1.0,
        action=cli.above(0.0),
        help="loss weight of unrolled step k is DECAY**k (1: equal weights; below 1 favours the "
        "first steps, which every cycle uses)",
    )
    p.add_argument(
        "--lr",
        type=float,
        default=1e-4,
        action=cli.above(0.0),
        help="peak learning rate (warmup, then cosine to lr/10)",
    )
    p.add_argument(
        "--draft-vocab",
        type=int,
        action=cli.at_least(1),
        help=f"draft vocabulary size (default min({DEFAULT_DRAFT_VOCAB}, target vocab))",
    )
    p.add_argument(
        "--hidden",
        type=int,
        action=cli.at_least(1),
        help="draft hidden size; must equal the target's (shared embedding)",
    )
    p.add_argument(
        "--heads",
        type=int,
        action=cli.at_least(1),
        help="attention heads (default: the target's, if they divide the hidden size into even head dims, else 8)",
    )
    p.add_argument("--kv-heads", type=int, action=cli.at_least(1), help="key/value heads (default: gcd(heads, 4))")
    p.add_argument(
        "--intermediate", type=int, action=cli.at_least(1), help="MLP width (default: the target's dense MLP width)"
    )
    p.add_argument(
        "--aux-layers",
        type=int,
        nargs=3,
        action=cli.at_least(0),
        metavar=("I", "J", "K"),
        help="target layers whose outputs feed the draft (default: SGLang's (1, L/2-1, L-4))",
    )
    p.add_argument("--seed", type=int, default=0, help="draft init and data order")
    p.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        help="target compute dtype (default: float32 on CPU, bfloat16 otherwise); the draft trains in float32",
    )
    p.add_argument(
        "--save-dtype", choices=["bfloat16", "float32"], default="bfloat16", help="dtype of the exported draft weights"
    )
    p.add_argument(
        "--save-every", type=int, default=500, action=cli.at_least(1), help="steps between train_state saves"
    )
    p.add_argument("--resume", action="store_true", help="continue from OUT/train_state (and its total steps)")
    p.add_argument(
        "--init",
        metavar="DRAFT",
        help="start from this SpecForge-layout draft (its architecture, aux layers and vocab map) "
        "with a fresh optimizer and schedule: fine-tune a draft on new data (with --resume, pass "
        "it again: it still sets the architecture)",
    )
    p.add_argument(
        "--time-budget",
        type=float,
        action=cli.above(0.0),
        metavar="SECONDS",
        help="fix the step count (at most --steps) so that training takes about this long, compile "
        "included: measured after 20 steps, then kept, so the learning-rate schedule still anneals",
    )
    p.add_argument(
        "--expert-impl",
        choices=["auto", "gather", "xla", "tokamax"],
        default="auto",
        help="routed-expert path of the frozen target's forward: 'gather' reads an expert per (token, "
        "expert) assignment (the decode path); 'xla'/'tokamax' sort tokens by expert for grouped "
        "matmuls, dequantizing an INT4 layer's local experts once per step. auto: the engine's own "
        "choice for the batch's token count (`model.choose_expert_impl`): the fused INT4 kernel where "
        "it runs, else grouped (xla) when one layer's local experts dequantize to at most "
        f"{INT4_DEQUANT_LIMIT >> 30} GiB and that reads fewer bytes than the per-assignment reads",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


# ---------------------------------------------------------------------------
# Data


def _check_data_file(file: str) -> None:
    if not os.path.isfile(file):
        found = "a directory" if os.path.isdir(file) else "no such file"
        raise UsageError(f"--data {file}: expected a text, .jsonl or .npy file, found {found}")


def read_documents(files: list[str], tokenizer, vocab_size: int) -> list[np.ndarray]:
    """Token documents (int32 1-D arrays) from every file, ids checked against vocab_size."""
    docs = []
    for file in files:
        _check_data_file(file)
        if file.endswith(".npy"):
            try:
                arr = np.load(file)
            except (ValueError, OSError, EOFError) as e:  # what numpy raises for a file that is not a plain .npy
                raise UsageError(
                    f"--data {file}: expected a .npy integer token array, found unreadable data ({e})"
                ) from None
            if arr.ndim not in (1, 2) or arr.dtype.kind not in "iu":
                raise UsageError(
                    f"--data {file}: expected a 1-D or 2-D integer token array, found {arr.dtype}{list(arr.shape)}"
                )
            new = [arr] if arr.ndim == 1 else list(arr)
        else:
            if tokenizer is None:
                raise UsageError(
                    f"--data {file}: text needs a tokenizer, but the --model checkpoint has no "
                    "tiktoken.model; pass .npy token arrays instead"
                )
            new = [np.asarray(tokenizer.encode(text), np.int64) for text in _texts(file)]
        for doc in new:
            if doc.size and (doc.min() < 0 or doc.max() >= vocab_size):
                raise UsageError(
                    f"--data {file}: token ids must be in [0, {vocab_size}) (the target vocab), "
                    f"found range [{doc.min()}, {doc.max()}]"
                )
        docs += [np.asarray(d, np.int32) for d in new if len(d)]
    return docs


def _texts(file: str) -> list[str]:
    try:
        with open(file, encoding="utf-8") as f:
            lines = [f.read()] if not file.endswith(".jsonl") else list(f)
    except UnicodeDecodeError as e:
        raise UsageError(f"--data {file}: expected UTF-8 text, found {e.reason} at byte {e.start}") from None
    if not file.endswith(".jsonl"):
        return lines
    texts = []
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UsageError(f"--data {file} line {n}: expected a JSON object, found invalid JSON ({e})") from None
            if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                raise UsageError(f"--data {file} line {n}: expected an object with a string field 'text'")
            texts.append(row["text"])
    return texts


def pack(docs: list[np.ndarray], seq_len: int, sep: int | None) -> np.ndarray:
    """Concatenate documents (separated by `sep`) and cut into [N, seq_len] windows; the tail is dropped."""
    parts = []
    for doc in docs:
        parts.append(doc)
        if sep is not None:
            parts.append(np.array([sep], np.int32))
    stream = np.concatenate(parts) if parts else np.zeros(0, np.int32)
    n = len(stream) // seq_len
    if n == 0:
        raise UsageError(f"--data holds {len(stream)} tokens, fewer than one --seq-len {seq_len} window")
    return stream[: n * seq_len].reshape(n, seq_len)


class Batches:
    """Batch of step s = rows s*B .. s*B+B-1 of a per-epoch permutation: a resumed run sees the same order."""

    def __init__(self, seqs_NT: np.ndarray, batch: int, seed: int):
        if len(seqs_NT) < batch:
            raise UsageError(
                f"--batch {batch} needs at least {batch} sequences; --data gives {len(seqs_NT)} "
                f"of --seq-len {seqs_NT.shape[1]}"
            )
        self.seqs, self.batch, self.seed = seqs_NT, batch, seed
        self._orders: dict[int, np.ndarray] = {}

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            if len(self._orders) >= 2:  # a batch spans at most two epochs
                self._orders.pop(min(self._orders))
            self._orders[epoch] = np.random.default_rng([self.seed, epoch]).permutation(len(self.seqs))
        return self._orders[epoch]

    def at(self, step: int) -> np.ndarray:
        """[B, T] int32 tokens of step `step` (0-based)."""
        g = step * self.batch + np.arange(self.batch)
        n = len(self.seqs)
        rows = [self._order(int(i // n))[i % n] for i in g]
        return self.seqs[rows]


# ---------------------------------------------------------------------------
# Draft config


def make_draft_config(args, cfg, source: str) -> DraftConfig:
    """DraftConfig from the flags, defaults derived from the target config; aux ids always explicit."""
    hidden = args.hidden or cfg.hidden_size
    if hidden != cfg.hidden_size:
        raise UsageError(
            f"--hidden {hidden}: the draft shares the target's embedding table, so its hidden size "
            f"must equal the target hidden_size {cfg.hidden_size}"
        )
    heads = args.heads or (cfg.num_heads if hidden % cfg.num_heads == 0 and hidden // cfg.num_heads % 2 == 0 else 8)
    if hidden % heads or (hidden // heads) % 2:
        raise UsageError(f"--heads {heads}: must divide hidden size {hidden} into even head dims (RoPE)")
    kv_heads = args.kv_heads or math.gcd(heads, 4)
    if heads % kv_heads:
        raise UsageError(f"--kv-heads {kv_heads}: must divide --heads {heads}")
    draft_vocab = args.draft_vocab or min(DEFAULT_DRAFT_VOCAB, cfg.vocab_size)
    if not 0 < draft_vocab <= cfg.vocab_size:
        raise UsageError(f"--draft-vocab {draft_vocab}: expected 1..{cfg.vocab_size} (the target vocab)")
    dcfg = DraftConfig(
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=hidden // heads,
        intermediate_size=args.intermediate or cfg.intermediate_size,
        rms_norm_eps=cfg.rms_norm_eps,
        vocab_size=cfg.vocab_size,
        draft_vocab_size=draft_vocab,
        target_hidden_size=cfg.hidden_size,
        rope_theta=cfg.rope_theta,
        max_position_embeddings=cfg.max_position_embeddings,
        aux_layer_ids=tuple(args.aux_layers) if args.aux_layers else None,
        source=source,
    )
    try:
        ids = aux_layer_ids(dcfg, cfg.num_layers)
    except ValueError as e:
        raise UsageError(f"--aux-layers: {e}") from None
    return dataclasses.replace(dcfg, aux_layer_ids=tuple(int(i) for i in ids))


# ---------------------------------------------------------------------------
# Training state


@dataclasses.dataclass
class TrainState:
    step: int  # optimizer steps done
    total: int  # steps of the whole run (the lr schedule's length)
    dparams: dict
    opt_state: object
    d2t: np.ndarray  # int64 [draft_vocab]
    t2d: np.ndarray  # bool [vocab]


def save_state(path: str, state: TrainState, dcfg: DraftConfig, args) -> None:
    """One .npz (written to a temporary name, then renamed): every leaf of (dparams, opt_state) plus metadata."""
    leaves = jax.tree.leaves((state.dparams, state.opt_state))
    meta = {
        "step": state.step,
        "total": state.total,
        "draft_config": _comparable(dcfg),
        "steps": args.steps,
        "lr": args.lr,
        "ttt_steps": args.ttt_steps,
        "step_decay": args.step_decay,
        "seq_len": args.seq_len,
        "batch": args.batch,
        "seed": args.seed,
        "model": os.path.abspath(args.model),
        "num_leaves": len(leaves),
    }
    arrays = {f"leaf_{i:05d}": np.asarray(x) for i, x in enumerate(leaves)}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".partial"
    with open(tmp, "wb") as f:
        np.savez(f, meta=np.array(json.dumps(meta)), d2t=state.d2t, t2d=state.t2d, **arrays)
    os.replace(tmp, path)


def load_state(path: str, template: TrainState, dcfg: DraftConfig) -> TrainState:
    """Restore a saved state into the structure of `template` (fresh params and optimizer state)."""
    if not os.path.exists(path):
        raise UsageError(f"--resume: no saved state at {path}")
    with np.load(path) as z:
        meta = json.loads(str(z["meta"]))
        if meta["draft_config"] != _comparable(dcfg):
            diff = {
                k: (v, _comparable(dcfg).get(k))
                for k, v in meta["draft_config"].items()
                if _comparable(dcfg).get(k) != v
            }
            raise UsageError(
                f"--resume: {path} was trained with a different draft config; "
                f"field: (saved, from these flags) = {diff}; pass the flags of the first run"
            )
        treedef = jax.tree.structure((template.dparams, template.opt_state))
        like = jax.tree.leaves((template.dparams, template.opt_state))
        if meta["num_leaves"] != len(like):
            raise UsageError(f"--resume: {path} holds {meta['num_leaves']} state arrays, expected {len(like)}")
        leaves = []
        for i, ref in enumerate(like):
            value = z[f"leaf_{i:05d}"]
            if value.shape != ref.shape:
                raise UsageError(f"--resume: {path} array {i} has shape {value.shape}, expected {ref.shape}")
            leaves.append(jnp.asarray(value.astype(ref.dtype)))
        dparams, opt_state = jax.tree.unflatten(treedef, leaves)
        return TrainState(
            int(meta["step"]),
            int(meta.get("total", meta["steps"])),
            dparams,
            opt_state,
            z["d2t"].astype(np.int64),
            z["t2d"].astype(bool),
        )


def _comparable(dcfg: DraftConfig) -> dict:
    d = dcfg.to_dict()
    d.pop("source")
    return d


class ProgressLog:
    """tqdm bar with loss and per-step accuracy, plus one JSON line per step in OUT/train_log.jsonl.

    A step's loss and accuracy arrive as device arrays and are written when the next
    step is logged (or on `flush`/`close`): reading them waits for that step to finish,
    and by then the next one is already queued, so the device never idles on the log.
    """

    def __init__(self, out: str, start: int, total: int, quiet: bool):
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=start, desc="draft", unit="step", disable=quiet)
        self.file = open(os.path.join(out, LOG_FILE), "a")
        self.last = None
        self._pending = None

    def __call__(self, step: int, loss, acc) -> None:
        self.flush()
        self._pending = (step, loss, acc)

    def flush(self) -> None:
        if self._pending is None:
            return
        step, loss, acc = self._pending
        self._pending = None
        loss, acc = float(loss), [round(float(a), 4) for a in np.asarray(acc)]
        self.last = {"step": step, "loss": round(loss, 5), "acc": acc, "time": round(time.time(), 1)}
        self.file.write(json.dumps(self.last) + "\n")
        self.file.flush()
        self.bar.set_postfix(loss=f"{loss:.3f}", acc="/".join(f"{a:.2f}" for a in acc), refresh=False)
        self.bar.update(1)

    def close(self):
        self.flush()
        self.bar.close()
        self.file.close()


# ---------------------------------------------------------------------------
# Main


def _initial_state(args, dcfg, seqs, state_path, init=None) -> TrainState:
    if os.path.exists(state_path) and not args.resume:
        raise UsageError(f"{state_path} exists from an earlier run; pass --resume to continue it, or delete it")
    if init is not None:
        _, params, d2t, t2d = init
        dparams = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
    else:
        # One compiled init instead of flax's op-by-op eager init (seconds even for small drafts).
        dparams = jax.jit(draft_init_params, static_argnums=(0, 2))(dcfg, jax.random.key(args.seed), jnp.float32)
        counts = np.bincount(seqs.ravel(), minlength=dcfg.vocab_size)
        d2t, t2d = training.vocab_map(counts, dcfg.draft_vocab_size)
    opt_state = training.make_optimizer().init(dparams)
    fresh = TrainState(0, args.steps, dparams, opt_state, d2t, t2d)
    return load_state(state_path, fresh, dcfg) if args.resume else fresh


ARCH_FLAGS = ("hidden", "heads", "kv_heads", "intermediate", "draft_vocab", "aux_layers")


def read_init_draft(args, cfg):
    """(DraftConfig, params, d2t, t2d) of --init, checked against the target; architecture flags are refused."""
    from checkpoints_convert.draft import read_draft  # converter side: only --init reads an HF draft

    given = [f"--{f.replace('_', '-')}" for f in ARCH_FLAGS if getattr(args, f) is not None]
    if given:
        raise UsageError(f"{' '.join(given)}: the architecture comes from --init {args.init}; drop these flags")
    try:
        dcfg, params, d2t, t2d = read_draft(args.init, np.float32)
        ids = aux_layer_ids(dcfg, cfg.num_layers)
        dcfg = dataclasses.replace(dcfg, aux_layer_ids=tuple(int(i) for i in ids))
    except (OSError, ValueError) as e:
        raise UsageError(f"--init {args.init}: {e}") from None
    return dcfg, params, d2t, t2d


def _tokenizer(model_dir: str):
    """The checkpoint's tokenizer, or None when it has no tiktoken.model."""
    if not os.path.exists(os.path.join(model_dir, "tiktoken.model")):
        return None
    from jaxspec.tokenizer import KimiTokenizer

    return KimiTokenizer.from_dir(model_dir)


def run(args, on_step=None) -> int:
    from checkpoints_convert.export import export_draft  # converter side: off the runtime's import graph
    from jaxspec.engine import Engine

    if args.resume and args.time_budget:
        raise UsageError("--time-budget applies to a fresh run; --resume keeps the saved run's total steps")
    if args.seq_len < args.ttt_steps + 2:
        raise UsageError(
            f"--seq-len {args.seq_len} is too short for --ttt-steps {args.ttt_steps} "
            f"(need at least {args.ttt_steps + 2})"
        )
    for file in args.data:  # the paths first: a typo there is the cheapest mistake to report
        _check_data_file(file)
    # Flags, data and saved state are checked from the config alone, before the (large) target loads.
    cfg = from_dict(checkpoint.read_config(args.model, flag="--model")["target"])
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise UsageError(f"--out {args.out}: expected a directory for the draft (new or existing), found a file")
    init = read_init_draft(args, cfg) if args.init else None
    dcfg = init[0] if init else make_draft_config(args, cfg, source=os.path.join(args.out, "config.json"))
    tokenizer = _tokenizer(args.model)
    sep = cfg.eos_token_id if cfg.eos_token_id is not None else getattr(tokenizer, "eos_id", None)
    seqs = pack(read_documents(args.data, tokenizer, cfg.vocab_size), args.seq_len, sep)
    batches = Batches(seqs, args.batch, args.seed)
    os.makedirs(args.out, exist_ok=True)
    state_path = os.path.join(args.out, STATE_DIR, STATE_FILE)
    state = _initial_state(args, dcfg, seqs, state_path, init)
    try:
        validate_pair(cfg, dcfg, state.d2t, state.t2d)
    except ValueError as e:
        raise UsageError(str(e)) from None
    engine = Engine.load(
        args.model, dtype=args.dtype, expert_impl=None if args.expert_impl == "auto" else args.expert_impl
    )

    # Replicate the draft state on the target's mesh up front: a first call with
    # differently placed inputs would compile the step twice.
    place = functools.partial(jax.device_put, device=replicated(engine.mesh))
    state.dparams, state.opt_state = place(state.dparams), place(state.opt_state)
    to_draft = place(jnp.asarray(training.target_to_draft_ids(state.t2d)))
    log = ProgressLog(args.out, state.step, state.total, args.quiet)
    loss_fn = training.DraftTTTLoss(engine.model, dcfg, dcfg.aux_layer_ids, args.ttt_steps, args.step_decay)
    budget = training.StepBudget(args.time_budget, state.total) if args.time_budget else None
    try:
        while state.step < state.total:
            lr = training.lr_at(state.step, args.lr, state.total)
            batch = (engine.params, to_draft, jnp.asarray(batches.at(state.step)))
            state.dparams, state.opt_state, loss, acc = training.train_step(
                loss_fn, state.dparams, state.opt_state, lr, batch
            )
            state.step += 1
            log(state.step, loss, acc)  # written once the next step is queued
            if budget is not None and budget.update(state.step, loss) != state.total:
                state.total = budget.total
                log.bar.total = state.total
            if on_step is not None:
                on_step(state.step)
            if state.step % args.save_every == 0:
                log.flush()  # the log covers every saved step
                save_state(state_path, state, dcfg, args)
    except KeyboardInterrupt:
        log.close()
        try:
            save_state(state_path, state, dcfg, args)
            print(f"\ninterrupted: saved step {state.step} to {state_path}; continue with --resume", file=sys.stderr)
        except RuntimeError:  # interrupted inside a step: its input buffers were already donated
            print(f"\ninterrupted mid-step; {state_path} keeps the last periodic save", file=sys.stderr)
        return 130
    log.close()
    save_state(state_path, state, dcfg, args)
    export_draft(dcfg, state.dparams, state.d2t, state.t2d, args.out, dtype=args.save_dtype)
    summary = f"loss {log.last['loss']:.3f}, accuracy per step {log.last['acc']}" if log.last else "no steps run"
    print(
        f"wrote {args.out} after {state.step} steps ({summary}); pair it with: python -m checkpoints_convert "
        f"--target HF_TARGET --draft {args.out} --out PAIR"
    )
    return 0


@cli.entry_point
def main(argv=None, on_step=None) -> int:
    """CLI entry point; `on_step(step)` is called after every optimizer step (tests use it to interrupt)."""
    return run(build_parser().parse_args(argv), on_step)


if __name__ == "__main__":
    sys.exit(main())
