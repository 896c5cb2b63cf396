"""The `autopar` command: plan, show, explain, diff, profile, calibrate.

    autopar plan examples/gpt2.py --gpus 8 --memory 80GB --save plan.json --html plan.html
    autopar plan examples/gpt2.py --size gpt3-175b --gpus 64 --hardware h100-ib --pp auto
    autopar show plan.json
    autopar explain plan.json transformer.h.0.mlp.c_fc
    autopar diff a.json b.json
    autopar profile examples/gpt2.py --size tiny
    torchrun --nproc_per_node 4 -m autopar.cli calibrate --gpus 4 --save mesh.json

A thin driver over trace -> profile -> solve (docs/design.md, section 1). Errors print
one line of cause and one line of fix; exit code 2 for usage errors, 1 when no
plan fits or anything else fails; tracebacks only with --debug. This module is
the only place that configures logging handlers.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import math
import sys
import traceback
from typing import Iterator, Sequence

from rich.logging import RichHandler

from autopar.errors import AutoparError, InfeasibleError, Knobs, UsageError
from autopar.report.console import err_console
from autopar.report.units import fmt_bytes, parse_bytes
from autopar.values import positive


# ---------------------------------------------------------------- argument values
def _memory(text: str) -> float:
    try:
        value = parse_bytes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if not math.isfinite(value):  # 1e400 reads as inf
        raise argparse.ArgumentTypeError(f"memory size {text!r} is not a finite number; write e.g. 80GB")
    return value


def _seconds(text: str, flag: str = "--time-limit") -> float:
    try:
        return positive(flag, float(text), "seconds, e.g. 30")
    except ValueError as err:  # float()'s own or positive's
        raise argparse.ArgumentTypeError(f"cannot take {text!r} as a time limit: {err}") from None


def mesh_shape(text: str) -> tuple[int, ...]:
    """An argparse type: '2x4' -> (2, 4) (`solver.mesh.parse_mesh_shape`)."""
    from autopar.solver.mesh import parse_mesh_shape

    try:
        return parse_mesh_shape(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _whole_number(text: str, at_least: int, too_small: str) -> int:
    """A whole number of at least `at_least`; `too_small` names the fix, with `{n}` for the number given."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < at_least:
        raise argparse.ArgumentTypeError(too_small.format(n=n))
    return n


def _positive(text: str) -> int:
    return _whole_number(text, 1, "{n} must be at least 1")


def _pp(text: str) -> str | int:
    """An argparse type: 'auto' or a number of pp ranks (at least 2)."""
    if text == "auto":
        return text
    return _whole_number(text, 2, "{n} pp ranks is no pipeline: give at least 2, or 'auto'")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    # MODEL.py is optional on the parser because --hf-config replaces it; the command checks that one is given.
    p.add_argument("model", nargs="?", help="MODEL.py defining `model` and `sample_input`, or build(batch_size, seq_len)")
    p.add_argument("--hf-config", choices=("gpt2", "llama"), help="instead of MODEL.py: a Hugging Face preset with random weights (gpt2 = GPT-2 small, llama = LLaMA-2-7B shape); "
                   'needs transformers: pip install -e ".[hf]"')
    p.add_argument("--batch-size", type=_positive, help="passed to build(); default: the file's own")
    p.add_argument("--seq-len", type=_positive, help="passed to build(); default: the file's own")
    p.add_argument("--size", help="passed to build(size=...), e.g. tiny or small for the examples/ zoo")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autopar", description="Automatic parallelization planner for PyTorch training.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks and debug logs")
    common.add_argument("--json", action="store_true", help="print machine-readable JSON instead of tables")

    p = sub.add_parser("plan", parents=[common], help="plan a model's parallelization")
    _add_model_args(p)
    p.add_argument("--gpus", type=_positive, required=True, help="number of devices")
    p.add_argument("--mesh", type=mesh_shape, help="logical mesh shape, e.g. 2x4 (default: try every shape of --gpus)")
    p.add_argument("--hardware", default="h100", help="preset name (h100, a100, cpu, ...) or a mesh JSON from `autopar calibrate --save`")
    p.add_argument("--memory", type=_memory, help="per-device budget: 80GB (10^9 bytes), 80GiB (2^30 bytes), 512MB or plain bytes; default: the device's memory")
    p.add_argument("--optimizer", default="adamw", help="optimizer whose state is budgeted: adamw, adam, sgd, sgd-momentum, adafactor, muon "
                   "(the last two read whole matrices: their plans keep every parameter whole)")
    p.add_argument("--precision", choices=("fp32", "tf32", "bf16"), default="fp32",
                   help="fp32: float32 parameters and matmuls (parallelize's default); tf32: the same with TF32 matmuls "
                        "(torch.backends.cuda.matmul.allow_tf32); bf16: mixed precision, bf16 compute on float32 masters "
                        "(parallelize(..., mixed_precision=autopar.MixedPrecision(torch.bfloat16)))")
    p.add_argument("--offload", help="keep optimizer state on the host and step it there (parallelize(..., offload=...)): "
                   "'auto' lets the solver choose each parameter's tier within --host-memory; 'optimizer' for every "
                   "parameter, or parameter names separated by commas")
    p.add_argument("--host-memory", type=_memory, help="with --offload auto: host memory of each machine the host tier may "
                   "use, shared by its devices (min(--gpus, --gpus-per-node)); default: 3/4 of this machine's memory")
    p.add_argument("--time-limit", type=_seconds, default=30.0,
                   help="seconds the search may take in all, over every mesh shape it tries (stopped there, it answers with "
                        "the best plan found, never slower than the fastest textbook plan that fits)")
    p.add_argument("--pp", type=_pp, help="pipeline stages: 'auto' keeps them where they predict a faster step than "
                   "any plan without them; a number asks for that many pp ranks")
    p.add_argument("--gpus-per-node", type=_positive, default=8, help="with --pp: devices a node holds (the fast link "
                   "inside a node, the slower between nodes with --hardware h100-ib)")
    p.add_argument("--pp-time-limit", type=lambda text: _seconds(text, "--pp-time-limit"),
                   help="with --pp: CPU seconds the pipeline search may take in all (--time-limit bounds each of its "
                        "solves); stopped there, it answers with the best pipeline solved so far, or the plan without "
                        "stages (default: no limit)")
    p.add_argument("--save", help="write the plan to this JSON file")
    p.add_argument("--load", help="reuse this plan file (checked against the model) instead of solving")
    p.add_argument("--html", help="write a self-contained HTML report here")

    p = sub.add_parser("show", parents=[common], help="print the report of a saved plan")
    p.add_argument("plan", help="plan.json")
    p.add_argument("--html", help="also write the HTML report here")

    p = sub.add_parser("explain", parents=[common], help="why a node or module got its strategy, with each alternative's cost")
    p.add_argument("plan", help="plan.json")
    p.add_argument("target", help="node name, parameter FQN or module path")
    p.add_argument("--model", help="MODEL.py to price alternatives with (the file a plan records is never imported: "
                   "pass it here; a plan of a --hf-config preset is priced without)")

    p = sub.add_parser("diff", parents=[common], help="what changed between two plans and the predicted effect")
    p.add_argument("a", help="first plan.json")
    p.add_argument("b", help="second plan.json")

    p = sub.add_parser("profile", parents=[common], help="FLOPs, activation and parameter bytes per module")
    _add_model_args(p)
    p.add_argument("--optimizer", default="adamw", help="optimizer whose state is counted")

    p = sub.add_parser("calibrate", parents=[common], help="measure the mesh numbers on the live process group (run under torchrun)")
    p.add_argument("--gpus", type=_positive, required=True, help="number of ranks (must equal torchrun's world size)")
    p.add_argument("--save", help="write the measured mesh to this JSON file (use it as --hardware)")
    return parser


# ---------------------------------------------------------------- commands
def _run(args: argparse.Namespace) -> int:
    from autopar.report import commands  # heavy imports (torch) only after argument parsing succeeded

    return getattr(commands, f"cmd_{args.command}")(args)


@contextlib.contextmanager
def _logging_to_stderr(debug: bool) -> Iterator[None]:
    """autopar's log records go to stderr while a command runs; the previous setup is restored after,
    so calling main() in-process (tests, notebooks) leaves no handler on a stream that may close."""
    logger = logging.getLogger("autopar")
    saved = (logger.handlers[:], logger.level, logger.propagate)
    logger.handlers[:] = [RichHandler(console=err_console(), show_time=False, show_path=debug)]
    logger.setLevel(logging.DEBUG if debug else logging.WARNING)
    logger.propagate = False
    try:
        yield
    finally:
        logger.handlers[:], logger.level, logger.propagate = saved


# how the CLI names what an infeasible budget's fix changes (`InfeasibleError.worded_for`)
CLI_KNOBS = Knobs(lambda b: f"--memory {fmt_bytes(b, up=True).replace(' ', '')}", lambda s: f"--time-limit {s:g}",
                  "plan for more --gpus")
# ... where every optimizer state was kept on the device (no --offload): the host tier is one more way out
CLI_DEVICE_ONLY_KNOBS = Knobs(CLI_KNOBS.memory, CLI_KNOBS.time_limit,
                              "plan for more --gpus, or add --offload auto (with --host-memory, the host RAM the tier may "
                              "use) to let the solver keep optimizer state in host memory")


def _with_fix(err: AutoparError) -> str:
    if isinstance(err, InfeasibleError):  # its fix in the CLI's words: --memory, --time-limit, --gpus
        return str(err.worded_for(CLI_DEVICE_ONLY_KNOBS if err.device_only else CLI_KNOBS)).strip()
    text = str(err).strip()
    if "fix:" in text:
        return text
    return f"{text}\n  fix: rerun with --debug for details"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed its usage message
        return int(exc.code or 0)
    debug = getattr(args, "debug", False)
    try:
        with _logging_to_stderr(debug):
            return _run(args)
    except UsageError as err:
        sys.stderr.write(f"autopar {args.command}: error: {_with_fix(err)}\n")
        return 2
    except AutoparError as err:
        if debug:
            traceback.print_exc()
        sys.stderr.write(f"autopar {args.command}: error: {_with_fix(err)}\n")
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as err:  # the last resort: one line instead of a stack, unless --debug
        if debug:
            traceback.print_exc()
        sys.stderr.write(f"autopar {args.command}: internal error: {type(err).__name__}: {err}\n  fix: rerun with --debug and report the traceback\n")
        return 1


if __name__ == "__main__":
    sys.exit(main())
