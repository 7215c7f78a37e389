"""python -m jaxspec.generate --model DIR --prompt TEXT [options]

Streams the generated text and prints throughput (and speculative statistics
when a draft is used) at the end. On several hosts, run one process per host with
--coordinator HOST:PORT --num-processes N --process-id I: the mesh spans every
host's devices and process 0 prints.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

from jaxspec import cli

DEFAULT_PROMPT = 'def read_lines(path, encoding="utf-8"):\n    """Return the lines of a text file."""\n'


def build_parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(prog="python -m jaxspec.generate", description=__doc__)
    p.add_argument("--model", help="converted jaxspec checkpoint directory (default: the built-in demo pair)")
    p.add_argument(
        "--prompt", default=DEFAULT_PROMPT, help="prompt text (default: a Python function's first two lines)"
    )
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn of the chat format")
    p.add_argument(
        "--max-new-tokens", type=int, default=128, action=cli.at_least(1), help="tokens to generate per sequence"
    )
    p.add_argument("--temperature", type=float, default=0.0, action=cli.at_least(0.0), help="0 = greedy")
    p.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        action=cli.in_range(0.0, 1.0, low_open=True),
        help="nucleus sampling mass; 1 = off",
    )
    p.add_argument("--top-k", type=int, default=0, action=cli.at_least(0), help="0 = off")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], help="default: float32 on CPU, bfloat16 otherwise")
    p.add_argument(
        "--num-devices",
        type=int,
        action=cli.at_least(1),
        help="devices of the mesh (default: the most devices, up to all, that divide every split "
        "dimension of the model)",
    )
    p.add_argument(
        "--draft-placement",
        choices=["replicated", "sharded"],
        default="replicated",
        help="replicated: every device runs the whole draft (no collectives); sharded: the draft's "
        "heads, MLP and vocab split over the mesh like the target's",
    )
    p.add_argument(
        "--prefill-chunk",
        type=int,
        action=cli.at_least(0),
        help="prefill long prompts this many tokens at a time; 0: the whole prompt at once "
        "(default: jaxspec.engine.DEFAULT_PREFILL_CHUNK, 512)",
    )
    p.add_argument(
        "--steps",
        type=int,
        action=cli.at_least(1),
        help="draft steps per speculative cycle (none of --steps/--topk/"
        "--draft-tokens given: the tuned setting of DIR/spec_config.json for "
        "the batch, written by `python -m jaxspec.tune`, else 3/1/4)",
    )
    p.add_argument(
        "--topk", type=int, action=cli.at_least(1), help="draft branching factor, 1 = chain (given alone: steps 3)"
    )
    p.add_argument(
        "--draft-tokens",
        type=int,
        action=cli.at_least(2),
        help="tree nodes verified per cycle, root included (not given: steps + 1 for a chain, else 4)",
    )
    p.add_argument("--no-spec", action="store_true", help="plain decoding even if the checkpoint has a draft")
    p.add_argument(
        "--profile",
        metavar="DIR",
        help="write an XLA profiler trace of the generation to DIR "
        "(DIR/process_I for each process of a multi-host run)",
    )
    g = p.add_argument_group("multi-host (one process per host, all with the same flags but --process-id)")
    g.add_argument("--coordinator", metavar="HOST:PORT", help="address of process 0's coordinator")
    g.add_argument("--num-processes", type=int, action=cli.at_least(1), metavar="N", help="number of processes")
    g.add_argument("--process-id", type=int, metavar="I", help="this process's index, 0..N-1")
    return p


@cli.entry_point
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from jaxspec import distributed

    try:
        multi = distributed.check_args(args.coordinator, args.num_processes, args.process_id, distributed.CLI_NAMES)
    except ValueError as e:
        raise cli.UsageError(str(e)) from None
    # Everything the flags alone decide is checked before a model loads.
    from jaxspec import checkpoint, tune

    tune.explicit_choice(args.steps, args.topk, args.draft_tokens)
    if args.model is not None:
        checkpoint.read_config(args.model, flag="--model")
    if args.profile and os.path.exists(args.profile) and not os.path.isdir(args.profile):
        raise cli.UsageError(f"--profile {args.profile}: expected a directory (new or existing), found a file")
    if args.profile:  # before the backend starts: the report needs the loop's optimized HLO
        from jaxspec.profile_report import dump_hlo

        dump_hlo(os.path.join(args.profile, f"process_{args.process_id}") if multi else args.profile)
    if not multi:
        return _run(args, multi=False)
    # Join the other processes before anything touches the devices.
    distributed.initialize(args.coordinator, args.num_processes, args.process_id, names=distributed.CLI_NAMES)
    with _library_output_to_stderr():
        return _run(args, multi=True)


def _prompt_ids(args, tok, vocab_size: int) -> list[int]:
    """The prompt as token ids: encoded by the checkpoint's tokenizer, else read as ids."""
    if args.chat:
        if tok is None:
            raise cli.UsageError(
                f"--chat: expected a checkpoint with a tokenizer (tiktoken.model), found none in {args.model}"
            )
        return tok.apply_chat([{"role": "user", "content": args.prompt}])
    if tok is not None:
        ids = tok.encode(args.prompt)
        if not ids:
            raise cli.UsageError("--prompt: expected at least one token, found an empty prompt")
        return ids
    words = args.prompt.split()
    bad = [w for w in words if not (w.isdigit() and int(w) < vocab_size)]
    if bad or not words:
        raise cli.UsageError(
            f"--prompt: the checkpoint has no tokenizer, so the prompt must be token ids in [0, {vocab_size}) "
            f"separated by spaces; found {bad[0][:40] if bad else 'an empty prompt'!r}"
        )
    return [int(w) for w in words]


def _run(args, multi: bool) -> int:
    """Load, generate and print (from process 0 only, in a multi-host run)."""
    from jaxspec import distributed

    primary = distributed.is_primary()
    from jaxspec.engine import DEFAULT_PREFILL_CHUNK, ContextLengthError, Engine

    model_dir = args.model
    if model_dir is None:
        from jaxspec import demo

        if not demo.available():
            raise cli.UsageError(
                "no --model given and this installation has no built-in demo model; pass --model DIR "
                "(a checkpoint made by `python -m checkpoints_convert`)"
            )
        model_dir = _demo_checkpoint(demo, multi, primary)
    engine = Engine.load(
        model_dir,
        dtype=args.dtype,
        num_devices=args.num_devices,
        prefill_chunk=DEFAULT_PREFILL_CHUNK if args.prefill_chunk is None else args.prefill_chunk,
        draft_placement=args.draft_placement,
    )
    tok = engine.tokenizer
    prompt = _prompt_ids(args, tok, engine.cfg.vocab_size)
    from jaxspec import tune

    # explicit flags win, else the tuned setting for this batch (DIR/spec_config.json), else 3/1/4
    choice = tune.choose(engine, 1, args.steps, args.topk, args.draft_tokens, no_spec=args.no_spec)
    spec = choice.spec
    if primary:
        print(f"jaxspec: {choice.reason}", file=sys.stderr)

    # Every process runs the same generation (same compiled calls, same chunks); only process 0 prints.
    printer = _Streamer(engine, quiet=not primary)
    if tok is not None and primary:
        sys.stdout.write(args.prompt if not args.chat else "")
        sys.stdout.flush()
    profile = contextlib.nullcontext()
    if args.profile:
        import jax

        profile = jax.profiler.trace(
            os.path.join(args.profile, f"process_{args.process_id}") if multi else args.profile
        )
    try:
        with profile:
            (result,) = engine.generate(
                [prompt],
                args.max_new_tokens,
                args.temperature,
                args.top_p,
                args.top_k,
                args.seed,
                spec=spec,
                on_tokens=printer,
            )
    except ContextLengthError as e:
        raise cli.UsageError(
            f"--max-new-tokens {args.max_new_tokens} after a {len(prompt)}-token prompt: {e}"
        ) from None
    printer.flush(result.tokens)
    if not primary:
        return 0
    s = result.stats
    print(
        f"\n\n[{s['mode']}] {s['new_tokens']} tokens in {s['seconds']:.2f} s: "
        f"{s['tokens_per_second']:.1f} tok/s (wall time, first-call compilation included)",
        file=sys.stderr,
    )
    if "compiled_tokens_per_second" in s:
        print(
            f"after the first chunk ({s['first_chunk_seconds']:.2f} s with prefill and compilation): "
            f"{s['compiled_tokens_per_second']:.1f} tok/s",
            file=sys.stderr,
        )
    if "mean_accept_len" in s:
        print(
            f"mean acceptance length {s['mean_accept_len']:.2f} tokens per target forward (bonus included), "
            f"{s['cycles']} cycles, histogram {s['accept_histogram']}",
            file=sys.stderr,
        )
    if args.profile:
        where = os.path.join(args.profile, f"process_0..{args.num_processes - 1}") if multi else args.profile
        print(f"profile written to {where}", file=sys.stderr)
    return 0


@contextlib.contextmanager
def _library_output_to_stderr():
    """Point file descriptor 1 at stderr while `sys.stdout` keeps writing to the real stdout, so that
    native libraries' chatter in a multi-host run (gloo's connection messages on CPU) stays out of the
    generated text."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    real = sys.stdout
    sys.stdout = open(saved, "w", encoding=real.encoding, errors=real.errors, closefd=False)  # noqa: SIM115
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stdout = real
        os.dup2(saved, 1)
        os.close(saved)


def _demo_checkpoint(demo, multi: bool, primary: bool) -> str:
    """The converted demo pair. In a multi-host run process 0 converts first; the others then
    find its copy (a shared disk) or convert their own (one disk per host), never concurrently."""
    log = (lambda m: print(m, file=sys.stderr)) if primary else (lambda m: None)
    if not multi:
        return demo.ensure_converted(log=log)
    from jax.experimental import multihost_utils

    path = demo.ensure_converted(log=log) if primary else None
    multihost_utils.sync_global_devices("jaxspec: demo checkpoint converted")
    return path if primary else demo.ensure_converted(progress=False, log=log)


class _Streamer:
    """Prints newly completed text as token chunks arrive."""

    def __init__(self, engine, quiet: bool = False):
        self.engine = engine
        self.quiet = quiet  # a process other than 0 of a multi-host run: follow along, print nothing
        self.seen = 0
        self.decoder = None
        if engine.tokenizer is not None:
            from jaxspec.tokenizer import StreamDecoder

            self.decoder = StreamDecoder(engine.tokenizer)

    def __call__(self, rows):
        self.flush(rows[0])

    def flush(self, tokens):
        if self.quiet:
            return
        stop = set(self.engine.stop_ids().tolist())
        new = [t for t in tokens[self.seen :] if t not in stop]
        self.seen = len(tokens)
        if self.decoder is None:
            sys.stdout.write(" ".join(map(str, new)) + (" " if new else ""))
        else:
            sys.stdout.write("".join(self.decoder.feed(t) for t in new))
        sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
