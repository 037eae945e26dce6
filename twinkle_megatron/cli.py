"""``twinkle-megatron``: look at a run from its JSONL log (``plot``, ``summary``, ``incidents``), and check the
Triton kernel on this GPU (``kernel-check``).

::

    twinkle-megatron summary runs/demo/metrics.jsonl       # first/last/min/max/mean of every key
    twinkle-megatron plot runs/demo/metrics.jsonl -o runs/demo/plots
    twinkle-megatron incidents runs/demo                   # loss spikes: their samples and layers
    twinkle-megatron kernel-check                          # the record that lets kernel="auto" use the kernel

A run directory works too (its ``metrics.jsonl`` is read). The log is read
strictly: a missing or empty file, a line that is not JSON or a record without
``"step"`` stops the command with ``error: ...`` and exit status 2, naming the
line, because a chart of half a log looks right and is wrong. The one exception
is a half-written *last* line (no newline yet: the run is still writing it),
which is skipped with a warning so a live run can be watched. Non-finite values
(written as ``null``) are kept as NaN: gaps in the charts, counted apart in the
summary. Values that are not numbers are ignored.

A log written by the tracker never holds a step twice (a restarted run
supersedes what it repeats). A log that does (several runs appended to one file
by other means) is read with a warning: steps that go backwards, and values
logged twice for the same step, of which the later one is used.

Exit status: 0 on success, 2 for a bad command line or log, 1 when plotting
lacks matplotlib.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any, NoReturn, Optional, Sequence, TextIO

from . import keys
from .logging.rank_hosts import read_rank_hosts
from .logging.runlog import RunLog, RunLogError, load_run
from .version import __version__

PROG = "twinkle-megatron"
MATPLOTLIB_HINT = ("pip install matplotlib (from a checkout of twinkle-megatron: pip install -e '.[plot]')")
NO_CUDA_MESSAGE = ("kernel-check: no CUDA device (torch.cuda.is_available() is False): nothing was checked or "
                   "recorded; on CPU the kernel is tested under Triton's interpreter by `make kernel-test`")



def format_summary(log: RunLog) -> str:
    """A fixed-width table: one row per key with the count, first, last, min, max and mean of its finite values."""
    steps = [record["step"] for record in log.records]
    evals = sum(1 for record in log.records if any(key.startswith(keys.EVAL_PREFIX) for key in record))
    lines = [f"run: {log.path}",
             f"records: {len(log.records)} (steps {steps[0]}..{steps[-1]}"
             + (f"; {evals} with eval/* keys" if evals else "") + ")", ""]
    rows = []
    nonfinite_seen = False
    for key in log.keys:
        values = log.series(key)[1]
        finite = [value for value in values if math.isfinite(value)]
        nonfinite = len(values) - len(finite)
        nonfinite_seen |= nonfinite > 0
        if finite:
            stats = [finite[0], finite[-1], min(finite), max(finite), math.fsum(finite) / len(finite)]
            cells = [_number(value) for value in stats]
        else:
            cells = ["-"] * 5
        rows.append([key, str(len(finite)), str(nonfinite), *cells])
    header = ["key", "n", "non-finite", "first", "last", "min", "max", "mean"]
    if not nonfinite_seen:  # a column of zeros only adds width
        header.pop(2)
        rows = [row[:2] + row[3:] for row in rows]
    widths = [max(len(row[column]) for row in [header, *rows]) for column in range(len(header))]
    for row in [header, *rows]:
        cells = [row[0].ljust(widths[0])] + [cell.rjust(width) for cell, width in zip(row[1:], widths[1:])]
        lines.append("  ".join(cells).rstrip())
    lines += _slowest_nodes(log)
    return "\n".join(lines)


def _slowest_nodes(log: RunLog) -> list[str]:
    """With the run's ``hosts.json`` (``logging/rank_hosts.py``): how often each node held the slowest rank.

    ``slowest node: mn2 held the slowest rank in 7 of 12 records (ranks 2, 3), mn1 in 5 (ranks 0, 1);
    last: rank 3 on mn2``. Nothing without the file or without ``perf/slowest_rank``.
    """
    ranks = [int(value) for value in log.series(keys.SLOWEST_RANK)[1] if math.isfinite(value)]
    try:
        hosts = read_rank_hosts(os.path.dirname(os.path.abspath(log.path)))
    except ValueError as error:
        raise RunLogError(str(error)) from None
    if not hosts or not ranks:
        return []
    unknown = sorted({rank for rank in ranks if not 0 <= rank < len(hosts)})
    if unknown:
        raise RunLogError(f"{log.path}: slowest ranks {unknown} are not in hosts.json's {len(hosts)} ranks")
    counts: dict[str, list[int]] = {}
    for rank in ranks:
        counts.setdefault(hosts[rank], []).append(rank)
    parts = [f"{host} {'held the slowest rank in ' if index == 0 else 'in '}{len(seen)}"
             + (f" of {len(ranks)} records" if index == 0 else "")
             + f" (ranks {', '.join(str(r) for r in sorted(set(seen)))})"
             for index, (host, seen) in enumerate(sorted(counts.items(), key=lambda item: -len(item[1])))]
    return ["", f"slowest node: {', '.join(parts)}; last: rank {ranks[-1]} on {hosts[ranks[-1]]}"]


def _number(value: float) -> str:
    """5 significant digits; whole numbers and large rates (tokens/s) without an exponent."""
    if abs(value) >= 1e15:
        return f"{value:.5g}"
    if float(value).is_integer():
        return str(int(value))
    return f"{value:.0f}" if abs(value) >= 1e5 else f"{value:.5g}"


# ------------------------------------------------------------------ command line


def build_parser() -> argparse.ArgumentParser:
    """The ``twinkle-megatron`` argument parser (subcommands ``plot``, ``summary``, ``incidents``, ``kernel-check``)."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="Charts and summaries of a twinkle-megatron run from its JSONL log "
                               "(LOG_DIR/RUN_NAME/metrics.jsonl); the Triton kernel's device check.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    plot = _command(commands, "plot", "write PNG charts of a run",
                    "Write PNG charts of a run: overview.png (every panel) and one file per panel (loss, accuracy, "
                    "token statistics, throughput, MFU, memory, step time with the straggler band, optimizer). "
                    "Panels whose keys the log lacks are skipped.")
    plot.add_argument("-o", "--output", metavar="DIR", default=None,
                      help="where the PNGs go (default: a 'plots' directory next to the log)")
    plot.add_argument("--keys", nargs="+", metavar="KEY", default=(),
                      help="more keys to chart, one panel each, e.g. metrics of your own collection "
                           "(default: none)")
    _command(commands, "summary", "print a table of a run's metrics",
             "Print the number of records, the step range, and the count, first, last, min, max and mean of "
             "every key of a run log.")
    incidents = _command(
        commands, "incidents", "print a run's incidents (loss spikes, non-finite values)",
        "Print each incident of a run (RUN_DIR/incidents.jsonl): why the step was flagged, its highest-loss samples "
        "with their index and dataset, the per-dataset losses and the layers with the largest gradient norms.",
        run=("LOG", "the run's incidents.jsonl, metrics.jsonl or run directory"))
    incidents.add_argument("--skip-list", type=int, default=0, metavar="N",
                           help="print only the sample indices of each incident's N highest-loss samples, one a "
                                "line: a skip list for examples/train_gpt.py --skip-samples")
    kernel_check = _command(
        commands, "kernel-check", "check the Triton kernel on this CUDA device and record the result",
        "On this CUDA device: the Triton token-statistics kernel against the torch loop and float64 (argmax, "
        "log-probs, entropy on bf16 logits with padding, ties, NaN/inf rows, odd labels) and the time of each, per "
        "vocabulary size; then this device's entry in the record that lets kernel='auto' use the kernel "
        "(twinkle_megatron/ops/kernel_check.py). Exit status 1 when the check did not pass; without CUDA it says so "
        "and exits 0.", run=None)
    kernel_check.add_argument("--tokens", type=positive_int, default=8192, help="tokens per check (default: 8192)")
    kernel_check.add_argument("--vocab", type=positive_ints, default=[32768, 65536, 131072], metavar="V,V,...",
                              help="local vocabulary sizes, bf16 (default: 32768,65536,131072)")
    kernel_check.add_argument("--repeats", type=positive_int, default=10, help="timed calls per path (default: 10)")
    record = kernel_check.add_mutually_exclusive_group()
    record.add_argument("--record", metavar="PATH", default=None,
                        help="the record to update (default: $TWINKLE_MEGATRON_KERNEL_RECORD, else the package's "
                             "ops/kernel_checks.json)")
    record.add_argument("--no-record", action="store_true", help="check only, write nothing")
    return parser


def _command(commands: Any, name: str, help_text: str, description: str,
             run: Optional[tuple[str, str]] = ("RUN.jsonl", "the run log (or its run directory)")
             ) -> argparse.ArgumentParser:
    """A subcommand; with ``run`` (metavar, help), its one positional argument, the run it reads."""
    parser = commands.add_parser(name, help=help_text, description=description)
    if run is not None:
        parser.add_argument("run", metavar=run[0], help=run[1])
    return parser


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (the benchmarks' command lines use it too)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def positive_ints(text: str) -> list[int]:
    """An argparse type: comma-separated integers >= 1 (``32768,65536``)."""
    values = [value for value in text.split(",") if value.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return [positive_int(value) for value in values]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; returns the exit status (errors exit through ``SystemExit``)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "incidents":
        return _incidents(args)
    if args.command == "kernel-check":
        return _kernel_check(args)
    try:
        log = load_run(args.run)
    except RunLogError as error:
        _fail(str(error), 2)
    for warning in log.warnings:
        print(f"{PROG}: warning: {warning}", file=sys.stderr)
    if args.command == "summary":
        return _print(format_summary(log), sys.stdout)
    return _plot(log, args)


def _plot(log: RunLog, args: argparse.Namespace) -> int:
    from .plots import MissingMatplotlib, plot_run

    unknown = [key for key in args.keys if key not in log.keys]
    if unknown:
        _fail(f"--keys {' '.join(unknown)}: not in {log.path} (it has: {', '.join(log.keys)})", 2)
    output = args.output or os.path.join(os.path.dirname(os.path.abspath(log.path)), "plots")
    try:
        written, skipped = plot_run(log, output, extra_keys=args.keys)
    except MissingMatplotlib:
        _fail(f"plotting needs matplotlib, which is not installed: {MATPLOTLIB_HINT}", 1)
    except OSError as error:
        _fail(f"cannot write the charts to {output}: {error.strerror or error}", 2)
    if not written:
        _fail(f"nothing to plot: {log.path} has none of the charted keys (it has: {', '.join(log.keys)}); "
              "chart others with --keys", 2)
    lines = [f"wrote {len(written)} charts to {output}:"]
    lines += [f"  {os.path.basename(path)}" for path in written]
    if skipped:
        lines.append(f"skipped (keys not in the log): {', '.join(skipped)}")
    return _print("\n".join(lines), sys.stdout)


def _incidents(args: argparse.Namespace) -> int:
    from .tracker.incidents import describe_incident, load_incidents, read_skip_list

    if not os.path.exists(args.run):
        _fail(f"{args.run}: no such file or directory", 2)
    if args.skip_list:
        return _print("\n".join(str(i) for i in sorted(read_skip_list(args.run, args.skip_list))), sys.stdout)
    found = load_incidents(args.run)
    if not found:
        return _print(f"no incidents in {args.run}", sys.stdout)
    return _print("\n\n".join(describe_incident(incident) for incident in found), sys.stdout)


def _kernel_check(args: argparse.Namespace) -> int:
    import torch

    from .ops.kernel_check import check_kernel, record_check
    from .ops.kernel_select import record_path, triton_installed

    if not torch.cuda.is_available():
        return _print(NO_CUDA_MESSAGE, sys.stdout)
    if not triton_installed():
        _fail("the kernel check needs Triton (pip install --no-deps triton)", 1)
    device = torch.device("cuda", torch.cuda.current_device())
    check = check_kernel(device, args.tokens, args.vocab, args.repeats)
    lines = [f"kernel check on {check.device!r}, {check.tokens} tokens x V bf16:"]
    lines += [f"  V={vocab}: kernel {kernel * 1e3:.3f} ms, torch path {loop * 1e3:.3f} ms ({speedup:.1f}x)"
              for vocab, kernel, loop, speedup in zip(check.vocabs, check.kernel_seconds, check.torch_seconds,
                                                      check.speedups)]
    lines += [f"  {problem}" for problem in check.problems]
    lines.append(f"{'PASSED' if check.passed else 'NOT PASSED'}: {check.reason}")
    if not args.no_record:
        path = args.record or record_path()
        record_check(check, path)
        use = "uses the kernel" if check.passed else "keeps the torch path"
        lines.append(f"wrote {path}: kernel='auto' {use} on {check.device!r}; commit the file to share the result")
    _print("\n".join(lines), sys.stdout)
    return 0 if check.passed else 1


def _fail(message: str, status: int) -> NoReturn:
    """argparse's error format without the usage line: the command was right, the data or setup was not."""
    print(f"{PROG}: error: {message}", file=sys.stderr)
    raise SystemExit(status)


def _print(text: str, stream: TextIO) -> int:
    try:
        print(text, file=stream, flush=True)
    except BrokenPipeError:  # `twinkle-megatron summary run.jsonl | head`: the reader left, not an error
        # Point stdout at /dev/null so the flush at interpreter exit does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
