"""python -m jaxspec.generate --model DIR --prompt TEXT [options]

Streams the generated text and prints throughput (and speculative statistics
when a draft is used) at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import sys


DEFAULT_PROMPT = 'def read_lines(path, encoding="utf-8"):\n    """Return the lines of a text file."""\n'


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxspec.generate", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", help="converted jaxspec checkpoint directory (default: the built-in demo pair)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn of the chat format")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], help="default: float32 on CPU, bfloat16 otherwise")
    p.add_argument("--num-devices", type=int, help="devices of the mesh (default: all)")
    p.add_argument("--prefill-chunk", type=int,
                   help="prefill long prompts this many tokens at a time; 0: the whole prompt at once "
                        "(default: jaxspec.engine.DEFAULT_PREFILL_CHUNK, 512)")
    p.add_argument("--steps", type=int, default=3, help="draft steps per speculative cycle")
    p.add_argument("--topk", type=int, default=1, help="draft branching factor (1 = chain)")
    p.add_argument("--draft-tokens", type=int, default=4, help="tree nodes verified per cycle, root included")
    p.add_argument("--no-spec", action="store_true", help="plain decoding even if the checkpoint has a draft")
    p.add_argument("--profile", metavar="DIR", help="write an XLA profiler trace of the generation to DIR")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.prefill_chunk is not None and args.prefill_chunk < 0:
        print(f"error: --prefill-chunk must be >= 0, found {args.prefill_chunk}", file=sys.stderr)
        return 2
    from jaxspec.engine import DEFAULT_PREFILL_CHUNK, Engine

    model_dir = args.model
    if model_dir is None:
        from jaxspec import demo

        if not demo.available():
            print("error: no --model given and this installation has no built-in demo model; pass --model DIR "
                  "(a checkpoint made by `python -m checkpoints_convert`)", file=sys.stderr)
            return 2
        model_dir = demo.ensure_converted(log=lambda m: print(m, file=sys.stderr))
    engine = Engine.load(model_dir, dtype=args.dtype, num_devices=args.num_devices,
                         prefill_chunk=DEFAULT_PREFILL_CHUNK if args.prefill_chunk is None else args.prefill_chunk)
    tok = engine.tokenizer
    if args.chat:
        if tok is None:
            print("error: --chat needs a tokenizer in the checkpoint", file=sys.stderr)
            return 2
        prompt = tok.apply_chat([{"role": "user", "content": args.prompt}])
    else:
        prompt = tok.encode(args.prompt) if tok is not None else [int(x) for x in args.prompt.split()]
    spec = None
    if engine.draft is not None and not args.no_spec:
        from jaxspec.spec import SpecConfig

        spec = SpecConfig(args.steps, args.topk, args.draft_tokens)

    printer = _Streamer(engine)
    if tok is not None:
        sys.stdout.write(args.prompt if not args.chat else "")
        sys.stdout.flush()
    profile = contextlib.nullcontext()
    if args.profile:
        import jax

        profile = jax.profiler.trace(args.profile)
    with profile:
        (result,) = engine.generate([prompt], args.max_new_tokens, args.temperature, args.top_p, args.top_k,
                                    args.seed, spec=spec, on_tokens=printer)
    printer.flush(result.tokens)
    s = result.stats
    print(f"\n\n[{s['mode']}] {s['new_tokens']} tokens in {s['seconds']:.2f} s: "
          f"{s['tokens_per_second']:.1f} tok/s (wall time, first-call compilation included)", file=sys.stderr)
    if "compiled_tokens_per_second" in s:
        print(f"after the first chunk ({s['first_chunk_seconds']:.2f} s with prefill and compilation): "
              f"{s['compiled_tokens_per_second']:.1f} tok/s", file=sys.stderr)
    if "mean_accept_len" in s:
        print(f"mean acceptance length {s['mean_accept_len']:.2f} tokens per target forward (bonus included), "
              f"{s['cycles']} cycles, histogram {s['accept_histogram']}", file=sys.stderr)
    if args.profile:
        print(f"profile written to {args.profile}", file=sys.stderr)
    return 0


class _Streamer:
    """Prints newly completed text as token chunks arrive."""

    def __init__(self, engine):
        self.engine = engine
        self.seen = 0
        self.decoder = None
        if engine.tokenizer is not None:
            from jaxspec.tokenizer import StreamDecoder

            self.decoder = StreamDecoder(engine.tokenizer)

    def __call__(self, rows):
        self.flush(rows[0])

    def flush(self, tokens):
        stop = set(self.engine.stop_ids().tolist())
        new = [t for t in tokens[self.seen:] if t not in stop]
        self.seen = len(tokens)
        if self.decoder is None:
            sys.stdout.write(" ".join(map(str, new)) + (" " if new else ""))
        else:
            sys.stdout.write("".join(self.decoder.feed(t) for t in new))
        sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
