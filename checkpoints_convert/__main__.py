"""python -m checkpoints_convert --target HF_DIR [--draft HF_DRAFT_DIR] --out DIR [--dtype auto|bfloat16|float32]"""

import os
import sys

from jaxspec import cli

# The choices of convert.DTYPE_CHOICES, named here so that a bad command line is reported before
# the converter (and JAX) is imported; tests/test_cli_errors.py checks that both agree.
DTYPE_CHOICES = ("auto", "bfloat16", "float32")


def _check_input_dir(flag: str, path: str, what: str) -> None:
    expected = f"{what} directory with config.json and *.safetensors"
    if not os.path.exists(path):
        raise cli.UsageError(f"{flag} {path}: expected {expected}, found no such directory")
    if not os.path.isdir(path):
        raise cli.UsageError(f"{flag} {path}: expected {expected}, found a file")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise cli.UsageError(f"{flag} {path}: expected {expected}, found no config.json in it")


def _check_output_dir(out: str) -> None:
    """What the path alone shows about --out; `checkpoint.prepare_output` checks a directory's content."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise cli.UsageError(
            f"--out {out}: expected a new directory or an earlier jaxspec checkpoint to replace, found a file"
        )


@cli.entry_point
def main(argv=None) -> int:
    p = cli.ArgumentParser(prog="python -m checkpoints_convert", description=__doc__)
    p.add_argument("--target", required=True, help="Hugging Face target model directory (config.json + safetensors)")
    p.add_argument("--draft", help="EAGLE-3 draft directory (SpecForge/SGLang layout)")
    p.add_argument("--out", required=True, help="output directory for the jaxspec checkpoint")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPE_CHOICES,
        help="dtype of unquantized weights; auto: the checkpoint's own (config torch_dtype, else the "
        "tensors'; float16 is stored as float32)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    _check_input_dir("--target", args.target, "a Hugging Face model")
    if args.draft is not None:
        _check_input_dir("--draft", args.draft, "an EAGLE-3 draft")
    _check_output_dir(args.out)

    from checkpoints_convert.convert import convert

    summary = convert(args.target, args.out, args.draft, args.dtype, progress=not args.quiet)
    print(
        f"wrote {args.out}: {summary['leaves']} target leaves, {summary['bytes_read'] / 1e9:.2f} GB read "
        f"in {summary['seconds']} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
