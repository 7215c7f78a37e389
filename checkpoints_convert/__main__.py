"""python -m checkpoints_convert --target HF_DIR [--draft HF_DRAFT_DIR] --out DIR [--dtype auto|bfloat16|float32]"""

import argparse
import sys

from checkpoints_convert.convert import DTYPE_CHOICES, convert
from checkpoints_convert.safetensors_io import CheckpointError
from jaxspec.config import ConfigError


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m checkpoints_convert", description=__doc__)
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
    try:
        summary = convert(args.target, args.out, args.draft, args.dtype, progress=not args.quiet)
    except (CheckpointError, ConfigError, FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(
        f"wrote {args.out}: {summary['leaves']} target leaves, {summary['bytes_read'] / 1e9:.2f} GB read "
        f"in {summary['seconds']} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
