"""The ``specfit`` command. Each subcommand lives in its own module, imported only when it runs.

A subcommand module defines ``add_arguments(parser)`` and ``main(args) -> int | None``.
"""

import argparse
import sys
from importlib import import_module

# name -> (module, one-line help). Listed here so that `specfit --help` needs no heavy import.
SUBCOMMANDS = {
    "demo": ("specfit.evaluation.demo", "run the embedded model with AR, EAGLE-3 and SpecFit and print a small table"),
    "bench": ("specfit.evaluation.bench", "reproduce the paper's table on the embedded model (slots sweep, two link regimes)"),
    "calibrate": ("specfit.evaluation.calibrate", "fit the cycle-time model a(n) + beta * demand for this device"),
    "train-target": ("specfit.training.target", "train the embedded Qwen3-MoE (and its tokenizer) from scratch"),
    "train-drafter": ("specfit.training.drafter", "train the embedded EAGLE-3 drafter on target-generated text"),
    "train-router": ("specfit.training.router", "train the route predictor for draft nodes"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specfit", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in SUBCOMMANDS:
        parser = build_parser()
        if argv and not argv[0].startswith("-"):
            parser.error(f"unknown command {argv[0]!r}; choose one of: {', '.join(SUBCOMMANDS)}")
        parser.parse_args(argv)  # prints help for -h, errors for other flags
        parser.print_help()
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    module_name, help_text = SUBCOMMANDS[name]
    module = import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"specfit {name}", description=help_text)
    module.add_arguments(parser)
    return int(module.main(parser.parse_args(rest)) or 0)


if __name__ == "__main__":
    sys.exit(main())
