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
from pathlib import Path

from mqbench import __version__

__all__ = ["build_parser", "describe_backends", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mqbench", description="Hardware-aware model quantization toolkit and benchmark for PyTorch."
    )
    parser.add_argument("--version", action="version", version=f"mqbench {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.add_parser("backends", help="list the backends with their quantization schemes and placement rules")
    demo = commands.add_parser("demo", help="run the built-in end-to-end example (no downloads)")
    demo.add_argument("--epochs", type=int, default=30, help="float training epochs (default: 30)")
    demo.add_argument("--qat-epochs", type=int, default=10, help="quantization-aware fine-tune epochs (default: 10)")
    demo.add_argument("--seed", type=int, default=0)
    verify = commands.add_parser(
        "verify",
        help="deploy a model for backends and check every artifact against the simulation on a runtime",
        description=(
            "Prepare a model for each backend, calibrate it on scikit-learn's digits (or load a prepared "
            "model's state dict), deploy it and compare every artifact with the simulation on onnxruntime, "
            "OpenVINO or the integer reference. Two verdicts per artifact: its arithmetic (what the file "
            "means, the same on every host) and this host's runtime as it serves it (int8 kernels; on a CPU "
            "without VNNI they can saturate). Exits with 1 if a verdict differs by more than the backend's "
            "tolerance (1 LSB; 2 for NNIE and Vitis)."
        ),
    )
    verify.add_argument(
        "--run",
        default=None,
        help="a finished run folder (mqbench ptq/qat --output): check the artifacts it holds against its saved model",
    )
    verify.add_argument("--backend", nargs="+", default=None, help="backend names (default: every registered one)")
    verify.add_argument(
        "--model", default="digits", help="digits (the demo's DigitsCNN) or a model of mqbench.models.zoo"
    )
    verify.add_argument(
        "--state-dict", default=None, help="state dict of the prepared, calibrated model (torch.load, weights only)"
    )
    verify.add_argument("--output-dir", default=None, help="where to write the artifacts (default: a temporary folder)")
    verify.add_argument("--reference", action="store_true", help="also run the integer reference executor")
    verify.add_argument("--tensors", action="store_true", help="print every tensor's comparison")
    verify.add_argument(
        "--reduce-range",
        action="store_true",
        help="prepare with 7-bit weights (reduce_range), which CPU int8 kernels without VNNI run exactly",
    )
    deploy = commands.add_parser(
        "deploy",
        help="deploy a finished run folder's quantized model again (every artifact of its backend)",
        description=(
            "Rebuild the quantized model of a run folder (its config.yaml and quantized_state_dict.pt) and write "
            "every artifact its backend consumes, into the run's deploy folder unless --output names another."
        ),
    )
    deploy.add_argument("--run", required=True, help="the run folder (mqbench ptq/qat --output)")
    deploy.add_argument("--output", default=None, help="where to write the artifacts (default: the run's deploy/)")
    deploy.add_argument("--quiet", action="store_true", help="no log lines, only the artifact list")
    ptq = commands.add_parser(
        "ptq",
        help="post-training quantization of a configured model and data, deployed and verified, in one run folder",
        description=(
            "Run a YAML configuration (MQBench's application layout: model, data, quantize, extra_prepare_dict, "
            "process): prepare the model for the backend, calibrate (naive_ptq) or calibrate and reconstruct "
            "(advanced_ptq), deploy every artifact, verify it on a runtime and measure float, simulated and "
            "deployed accuracy. The output folder gets config.yaml, quantized_state_dict.pt, deploy/, verify.txt, "
            "results.json and report.md. Exits with 1 if verification fails."
        ),
    )
    qat = commands.add_parser(
        "qat",
        help="quantization-aware training of a configured model and data (torchrun for several processes)",
        description=(
            "Run a YAML configuration as mqbench ptq does, but calibrate and then train with quantization in the "
            "loop (its training section: epochs, lr, optimizer, ...), writing checkpoint.pt after every epoch "
            "(training.resume continues from it). Under `torchrun --nproc_per_node N -m mqbench qat` the training "
            "is data parallel (gloo on CPUs, NCCL on GPUs); rank 0 writes the run folder."
        ),
    )
    bench = commands.add_parser(
        "bench",
        help="a matrix of backends x methods x models: accuracy simulated and deployed, verify LSB, latency",
        description=(
            "Run every combination of a bench configuration (a run configuration plus a bench section: models, "
            "backends, methods, latency_repeats) as mqbench ptq runs, and write the matrix as bench.md, "
            "bench.json and bench.png. Exits with 1 if any combination fails verification."
        ),
    )
    profile = commands.add_parser(
        "profile",
        help="mqbench ptq plus each layer's error against float (standalone and accumulated)",
        description=(
            "Run a YAML configuration as mqbench ptq does, then measure each quantized layer's output against "
            "float with only its weights, only its activations, or both quantized, and with every layer up to it "
            "quantized (profile section: modes, batches). The table is in results.json, profile.md and the report."
        ),
    )
    mixed = commands.add_parser(
        "mixed-precision",
        help="choose a bit width per layer under a size or BitOps budget, then deploy and verify",
        description=(
            "Search per-quantizer widths (mixed_precision section: weight_bits, activation_bits, budget, pareto) "
            "by an integer program over measured sensitivities, then calibrate, deploy and verify the mixed model "
            "as mqbench ptq does. Needs a backend that deploys several widths (academic, academic_nlp)."
        ),
    )
    for command in (ptq, qat, bench, profile, mixed):
        command.add_argument("--config", required=True, help="the YAML configuration (see examples/)")
        command.add_argument(
            "--output", required=True, help="the run folder (created; one holding a finished run is refused)"
        )
        command.add_argument(
            "--overwrite",
            action="store_true",
            help="replace the finished run in --output (its files, deploy/ included, go when the new run finishes; "
            "they stay if it does not)",
        )
        command.add_argument("--quiet", action="store_true", help="no progress bars or log lines, only the summary")
    return parser


def describe_backends() -> str:
    """One block per registered backend: schemes of weights and activations, and where quantizers go."""
    # imported when the command runs: `mqbench --help` answers without loading torch
    from mqbench.backends import ParamsTable

    blocks = []
    for name, spec in ParamsTable.items():
        weight = spec.weight.describe() if spec.weight else "from extra_qconfig_dict"
        activation = spec.activation.describe() if spec.activation else "from extra_qconfig_dict"
        if spec.transformer_activation is not None:
            activation += f"; a transformer's (LayerNorm, RMSNorm): {spec.transformer_activation.describe()}"
        blocks.append(
            f"{name}: {spec.description}\n"
            f"  weights:     {weight}\n"
            f"  activations: {activation}\n"
            f"  placement:   {spec.placement.describe()}"
        )
    return "\n\n".join(blocks)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "backends":
        print(describe_backends())
        return 0
    if args.command == "demo":
        # imported when the command runs: `mqbench --help` answers without loading torch
        from mqbench.app.demo import run_demo

        for name in ("epochs", "qat_epochs"):
            if getattr(args, name) < 1:
                parser.error(f"--{name.replace('_', '-')} must be at least 1")
        rows = run_demo(epochs=args.epochs, qat_epochs=args.qat_epochs, seed=args.seed)
        return 0 if all(row.passed for row in rows) else 1
    if args.command == "deploy" or (args.command == "verify" and args.run is not None):
        return _saved_run_command(parser, args)
    if args.command == "verify":
        # imported when the command runs: `mqbench --help` answers without loading torch
        from mqbench.app.check import run_verify_command

        try:
            return run_verify_command(
                args.backend,
                args.model,
                args.state_dict,
                args.output_dir,
                args.reference,
                args.tensors,
                reduce_range=args.reduce_range,
            )
        except (ValueError, FileNotFoundError) as error:
            parser.error(str(error))
    if args.command in ("ptq", "qat", "bench", "profile", "mixed-precision"):
        return _run_command(parser, args)
    parser.print_help()
    return 0


def _saved_run_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``mqbench deploy --run DIR`` / ``mqbench verify --run DIR``; verify exits with 1 when a verdict failed."""
    from mqbench.app.config import ConfigError
    from mqbench.app.folder import ChecksumError, OutputError
    from mqbench.app.saved import deploy_saved_run, verify_saved_run
    from mqbench.utils.logger import logger

    if getattr(args, "quiet", False):
        logger.setLevel("WARNING")
    if args.command == "verify":
        options = ("backend", "state_dict", "output_dir")
        given = [f"--{name.replace('_', '-')}" for name in options if getattr(args, name)]
        given += ["--reduce-range"] * args.reduce_range + ["--tensors"] * args.tensors
        given += ["--model"] * (args.model != "digits")
        if given:
            parser.error(f"verify --run checks the run's own model and artifacts; drop {', '.join(given)}")
    try:
        if args.command == "deploy":
            result = deploy_saved_run(args.run, args.output, quiet=args.quiet)
            for key, path in sorted(result.artifacts.items()):
                print(f"{key}: {path}")
            return 0
        check = verify_saved_run(args.run, reference=args.reference)
    except (ConfigError, ChecksumError, OutputError) as error:
        parser.error(str(error))
    except OSError as error:  # the artifacts' folder (--output) cannot be written
        from mqbench.app.folder import describe_os_error

        parser.error(describe_os_error(error))
    print(check.report.summary())
    verdict = "passed" if check.passed else "FAILED"
    print(f"{args.run}: {check.backend} artifacts {verdict} (tolerance {check.tolerance} LSB)")
    return 0 if check.passed else 1


def _run_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``mqbench ptq / qat / bench``: a configuration run; exit status 1 when a verification failed."""
    # imported when the command runs: `mqbench --help` answers without loading torch
    from mqbench.app.config import ConfigError
    from mqbench.app.folder import OutputError
    from mqbench.utils.logger import logger
    from mqbench.utils.memory import keep_freed_memory

    keep_freed_memory()  # the process is a training or calibration run: reuse freed memory
    if args.quiet:
        logger.setLevel("WARNING")
    try:
        if args.command == "bench":
            from mqbench.app.bench import run_bench

            payload = run_bench(args.config, args.output, quiet=args.quiet, overwrite=args.overwrite)
            print((Path(args.output) / "bench.md").read_text())
            return 0 if all(row["verified"] for row in payload["rows"]) else 1
        from mqbench.app.precision import run_mixed_precision, run_profile
        from mqbench.app.ptq import run_ptq
        from mqbench.app.qat import run_qat
        from mqbench.app.runs import describe_results

        command = {"ptq": run_ptq, "qat": run_qat, "profile": run_profile, "mixed-precision": run_mixed_precision}
        results = command[args.command](args.config, args.output, quiet=args.quiet, overwrite=args.overwrite)
    except (ConfigError, OutputError) as error:
        parser.error(str(error))
    if "verify" not in results:  # a rank other than 0
        return 0
    print(describe_results(results))
    print(f"run folder: {args.output} (report.md, results.json, deploy/)")
    return 0 if results["verify"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
