"""The ``mqbench`` command.

Example:
    >>> from mqbench.cli import build_parser
    >>> build_parser().parse_args(["demo", "--epochs", "5"]).epochs
    5
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from mqbench import __version__

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mqbench", description="Hardware-aware model quantization toolkit and benchmark for PyTorch."
    )
    parser.add_argument("--version", action="version", version=f"mqbench {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = commands.add_parser("demo", help="run the built-in end-to-end example (no downloads)")
    demo.add_argument("--epochs", type=int, default=30, help="float training epochs (default: 30)")
    demo.add_argument("--qat-epochs", type=int, default=10, help="quantization-aware fine-tune epochs (default: 10)")
    demo.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        from mqbench.demo import run_demo

        for name in ("epochs", "qat_epochs"):
            if getattr(args, name) < 1:
                parser.error(f"--{name.replace('_', '-')} must be at least 1")
        run_demo(epochs=args.epochs, qat_epochs=args.qat_epochs, seed=args.seed)
        return 0
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
