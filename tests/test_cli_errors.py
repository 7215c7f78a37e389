"""Every CLI reports a bad flag or path as one `error: ...` line on stderr and exits with status 2.

Each case runs the CLI as a user would (`python -m ...`, one process per case) and checks: exit
status 2, the last non-empty stderr line is the only `error:` line, it names the flag or path and
holds the expected and the found value, and there is no traceback. The inputs are chosen so that
the error fires before any model loads (except the mesh case, which needs a model's dimensions).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jaxspec import cli, demo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

GEN, CONVERT, TRAIN, TUNE, REPORT = (
    "jaxspec.generate",
    "checkpoints_convert",
    "jaxspec.train_draft",
    "jaxspec.tune",
    "jaxspec.profile_report",
)

# (module, argv, fragments of the error line); {tmp} is a directory holding the files made by `files`.
CASES = {
    # generate: flag ranges and the tree shape at parse time, paths before anything loads
    "gen-steps-0": (GEN, ["--steps", "0"], ["--steps", ">= 1", "found 0"]),
    "gen-temperature-negative": (GEN, ["--temperature", "-1"], ["--temperature", ">= 0", "found -1"]),
    "gen-top-p-above-1": (GEN, ["--top-p", "1.5"], ["--top-p", "(0, 1]", "found 1.5"]),
    "gen-top-p-0": (GEN, ["--top-p", "0"], ["--top-p", "(0, 1]", "found 0"]),
    "gen-top-p-nan": (GEN, ["--top-p", "nan"], ["--top-p", "(0, 1]", "found nan"]),
    "gen-top-k-negative": (GEN, ["--top-k", "-2"], ["--top-k", ">= 0", "found -2"]),
    "gen-max-new-tokens-0": (GEN, ["--max-new-tokens", "0"], ["--max-new-tokens", ">= 1", "found 0"]),
    "gen-topk-0": (GEN, ["--topk", "0"], ["--topk", ">= 1", "found 0"]),
    "gen-draft-tokens-1": (GEN, ["--draft-tokens", "1"], ["--draft-tokens", ">= 2", "found 1"]),
    "gen-chain-tokens": (
        GEN,
        ["--topk", "1", "--draft-tokens", "7"],
        ["--draft-tokens", "--topk", "expected num_steps + 1 = 4", "found 7"],
    ),
    "gen-num-devices-0": (GEN, ["--num-devices", "0"], ["--num-devices", ">= 1", "found 0"]),
    "gen-prefill-chunk-negative": (GEN, ["--prefill-chunk", "-1"], ["--prefill-chunk", ">= 0", "found -1"]),
    "gen-num-processes-0": (
        GEN,
        ["--coordinator", "h:1", "--num-processes", "0", "--process-id", "0"],
        ["--num-processes", ">= 1", "found 0"],
    ),
    "gen-steps-not-int": (GEN, ["--steps", "three"], ["--steps", "int", "'three'"]),
    "gen-dtype-choice": (GEN, ["--dtype", "fp8"], ["--dtype", "bfloat16", "'fp8'"]),
    "gen-model-missing": (
        GEN,
        ["--model", "/nonexistent"],
        ["--model /nonexistent", "expected a jaxspec checkpoint directory", "found no such directory"],
    ),
    "gen-model-incomplete": (GEN, ["--model", "{tmp}/empty"], ["--model {tmp}/empty", "COMPLETE", "again"]),
    "gen-model-file": (GEN, ["--model", "{tmp}/file"], ["--model {tmp}/file", "checkpoint directory", "a file"]),
    "gen-profile-file": (GEN, ["--profile", "{tmp}/file"], ["--profile {tmp}/file", "a directory", "a file"]),
    "gen-num-devices-3": (GEN, ["--num-devices", "3"], ["over 3 devices", "--num-devices", "size 4", "usable"]),
    # checkpoints_convert
    "convert-target-missing": (
        CONVERT,
        ["--target", "/nonexistent", "--out", "{tmp}/out"],
        ["--target /nonexistent", "config.json", "found no such directory"],
    ),
    "convert-target-no-config": (
        CONVERT,
        ["--target", "{tmp}/empty", "--out", "{tmp}/out"],
        ["--target {tmp}/empty", "expected a Hugging Face model directory", "found no config.json"],
    ),
    "convert-draft-no-config": (
        CONVERT,
        ["--target", "{demo_target}", "--draft", "{tmp}/empty", "--out", "{tmp}/out"],
        ["--draft {tmp}/empty", "expected an EAGLE-3 draft directory", "found no config.json"],
    ),
    "convert-out-file": (
        CONVERT,
        ["--target", "{demo_target}", "--out", "{tmp}/file"],
        ["--out {tmp}/file", "expected a new directory", "found a file"],
    ),
    "convert-out-foreign-dir": (
        CONVERT,
        ["--target", "{demo_target}", "--out", "{tmp}/foreign"],
        ["--out {tmp}/foreign", "not a jaxspec checkpoint", "expected a new directory"],
    ),
    "convert-target-required": (CONVERT, ["--out", "{tmp}/out"], ["--target", "required"]),
    "convert-dtype-choice": (
        CONVERT,
        ["--target", "{tmp}/empty", "--out", "{tmp}/out", "--dtype", "float16"],
        ["--dtype", "'bfloat16'", "'float16'"],
    ),
    # train_draft
    "train-data-missing": (
        TRAIN,
        ["--model", "{tmp}/empty", "--data", "/nonexistent.npy", "--out", "{tmp}/d"],
        ["--data /nonexistent.npy", "expected a text, .jsonl or .npy file", "found no such file"],
    ),
    "train-steps-0": (
        TRAIN,
        ["--model", "m", "--data", "x", "--out", "o", "--steps", "0"],
        ["--steps", ">= 1", "found 0"],
    ),
    "train-lr-negative": (
        TRAIN,
        ["--model", "m", "--data", "x", "--out", "o", "--lr=-1e-4"],
        ["--lr", "> 0", "found -0.0001"],
    ),
    "train-batch-0": (
        TRAIN,
        ["--model", "m", "--data", "x", "--out", "o", "--batch", "0"],
        ["--batch", ">= 1", "found 0"],
    ),
    "train-time-budget-0": (
        TRAIN,
        ["--model", "m", "--data", "x", "--out", "o", "--time-budget", "0"],
        ["--time-budget", "> 0", "found 0.0"],
    ),
    "train-model-missing": (
        TRAIN,
        ["--model", "/nonexistent", "--data", "{tmp}/file", "--out", "{tmp}/d"],
        ["--model /nonexistent", "checkpoint directory", "found no such directory"],
    ),
    # tune (the too-small --time-budget, found after loading, is test_tune.test_cli_errors)
    "tune-no-draft": (TUNE, ["--model", "{tmp}/nodraft"], ["--model {tmp}/nodraft", "has no draft", "expected"]),
    "tune-prompts-unparsable": (
        TUNE,
        ["--model", "{tmp}/nodraft", "--prompts", "{tmp}/bad.json"],
        ["--prompts {tmp}/bad.json", "expected JSON", "found text that is neither"],
    ),
    "tune-time-budget-0": (TUNE, ["--time-budget", "0"], ["--time-budget", "> 0", "found 0.0"]),
    "tune-batch-0": (TUNE, ["--batch", "1", "0"], ["--batch", ">= 1", "found 0"]),
    "tune-max-topk": (TUNE, ["--max-topk", "9"], ["--max-topk", "[1, 4]", "found 9"]),
    "tune-max-draft-tokens": (TUNE, ["--max-draft-tokens", "3"], ["--max-draft-tokens", "[7, 16]", "found 3"]),
    # profile_report
    "report-dir-missing": (REPORT, ["/nonexistent"], ["DIR /nonexistent", "not a directory", "no such path"]),
    "report-no-trace": (REPORT, ["{tmp}/empty"], ["{tmp}/empty", "no profiler run found", "expected"]),
    "report-bad-trace": (REPORT, ["{tmp}/badtrace"], ["x.xplane.pb", "expected an XLA profiler trace", "unreadable"]),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli_errors")
    (tmp / "empty").mkdir()
    (tmp / "file").write_text("not a directory\n")
    (tmp / "foreign").mkdir()
    (tmp / "foreign" / "notes.txt").write_text("someone else's\n")
    (tmp / "bad.json").write_text("def f(:\n")
    nodraft = tmp / "nodraft"  # a complete checkpoint's config without a draft (no weights needed)
    nodraft.mkdir()
    (nodraft / "COMPLETE").write_text("{}")
    (nodraft / "jaxspec_config.json").write_text(json.dumps({"format_version": 1, "target": {}}))
    run = tmp / "badtrace" / "plugins" / "profile" / "run1"
    run.mkdir(parents=True)
    (run / "x.xplane.pb").write_bytes(b"\x07 not a protobuf \xff" * 4)
    return {"tmp": str(tmp), "demo_target": os.path.join(ROOT, "jaxspec", "demo", "target")}


@pytest.mark.parametrize("case", sorted(CASES))
def test_cli_error_is_one_line_with_status_2(case, files):
    module, argv, fragments = CASES[case]
    if "{demo_target}" in " ".join(argv) or case == "gen-num-devices-3":
        if not demo.available():
            pytest.skip("needs the built-in demo model")
    argv = [a.format(**files) for a in argv]
    proc = subprocess.run([sys.executable, "-m", module, *argv], cwd=ROOT, capture_output=True, text=True, timeout=300)
    err = proc.stderr
    assert proc.returncode == 2, (proc.returncode, err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.strip()]
    last = lines[-1]
    assert last.startswith("error: "), err[-3000:]
    assert [ln for ln in lines if ln.startswith("error:")] == [last], err[-3000:]
    for fragment in fragments:
        assert fragment.format(**files) in last, (fragment, last)


def test_entry_point_keeps_the_traceback_of_a_bug():
    """Only user-input errors become the `error:` line: anything else propagates."""

    @cli.entry_point
    def main(argv=None):
        raise (cli.UsageError if argv == ["user"] else KeyError)("what")

    assert main(["user"]) == 2
    with pytest.raises(KeyError):
        main(["bug"])


def test_range_actions_check_each_value_and_pass_good_ones():
    p = cli.ArgumentParser(prog="t")
    p.add_argument("--n", type=int, nargs="+", action=cli.at_least(1))
    p.add_argument("--p", type=float, default=1.0, action=cli.in_range(0.0, 1.0, low_open=True))
    p.add_argument("--x", type=float, action=cli.above(0.0))
    args = p.parse_args(["--n", "1", "5", "--p", "1", "--x", "0.5"])
    assert (args.n, args.p, args.x) == ([1, 5], 1.0, 0.5)
    assert p.parse_args([]).p == 1.0
    for argv, want in [
        (["--n", "3", "0"], "--n must be >= 1, found 0"),
        (["--p", "0"], "--p must be in (0, 1], found 0.0"),
        (["--x", "0"], "--x must be > 0, found 0.0"),
        (["--x", "inf"], "--x must be a finite number > 0, found inf"),
        (["--n", "one"], "--n: invalid int value: 'one'"),
        (["--y"], "unrecognized arguments: --y"),
    ]:
        with pytest.raises(cli.UsageError) as info:
            p.parse_args(argv)
        assert str(info.value).startswith(want), (argv, str(info.value))


def test_convert_cli_names_the_converters_dtypes():
    """checkpoints_convert's parser lists --dtype choices without importing the converter; they agree."""
    import checkpoints_convert.__main__ as convert_cli
    from checkpoints_convert.convert import DTYPE_CHOICES

    assert convert_cli.DTYPE_CHOICES == DTYPE_CHOICES


@pytest.mark.parametrize("module", [GEN, CONVERT, TRAIN, TUNE, REPORT])
def test_help_describes_every_option_and_states_each_default_once(module, capsys):
    """`--help` of each CLI: every option has a help text; a default is stated at most once per option and
    never as a bare None or False; the description keeps its own line breaks (its usage line comes first)."""
    import importlib

    mod = importlib.import_module(module if module != CONVERT else f"{CONVERT}.__main__")
    with pytest.raises(SystemExit) as info:
        mod.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "(default: None)" not in out and "(default: False)" not in out, out
    first = mod.__doc__.strip().splitlines()[0].strip()
    assert first in [line.strip() for line in out.splitlines()], f"{module}: description reflowed:\n{out}"
    # One entry per option: its line ('  --flag METAVAR  help') and the indented lines that continue it.
    entries = []
    for line in out.splitlines():
        if line.startswith("  -"):
            entries.append([line.strip()])
        elif entries and entries[-1] and line.startswith(" " * 6) and line.strip():
            entries[-1].append(line.strip())
        else:
            entries.append(None)
    entries = [e for e in entries if e]
    flags = [e[0].split()[0].rstrip(",") for e in entries]
    assert "--help" not in flags and "-h" in flags and len(flags) >= 3, out
    for flag, entry in zip(flags, entries):
        has_help = "  " in entry[0] or len(entry) > 1
        assert has_help, f"{module} {flag}: no help text"
        text = " ".join(entry).lower()
        assert text.count("(default") <= 1, f"{module} {flag} states its default twice: {text}"
