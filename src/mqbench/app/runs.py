"""What ``mqbench ptq`` and ``mqbench qat`` share: the run folder, the stages around quantization, the
report.

A run: the float model and data of the configuration and their float accuracy; the command's own
quantization (calibration, reconstruction or training); then, on rank 0, the quantized model's state
dict, its simulated accuracy, deployment of every artifact the backend consumes, ``verify_deploy``
on validation samples and the deployed model's accuracy as its runtime serves it. A language model
(``model.task: language_model``) is measured by its held-out perplexity instead (``results.json``'s
``perplexity``: float, simulated and deployed, lower is better; ``accuracy`` then holds nulls), its deployment
verified on the first ``context`` tokens of held-out windows. A sentence encoder (``model.task: embedding``) is
measured by how closely the quantized model's embeddings of the validation samples follow the float model's
(``results.json``'s ``embedding``: mean cosine, min cosine and nearest-neighbour agreement of the simulated and
the deployed model, higher is better; see :meth:`Run.embeddings`).

The run folder holds ``config.yaml`` (every default filled in), ``quantized_state_dict.pt`` (load it
into ``prepare_by_platform(model, backend, extra_prepare_dict)``, after
:func:`~mqbench.advanced_ptq.restore_smoothing` for a smoothed model), ``deploy/``, ``verify.txt``,
``results.json``, ``report.md`` and ``report.html`` (see :mod:`mqbench.app.report`). Each file is
written under a temporary name and renamed when complete, so an interrupted run leaves finished
files and no half-written one; ``results.json``'s ``status`` says ``running``, ``finished``,
``failed`` (with the error) or ``interrupted``. A finished run's last file is ``checksums.sha256``.
A folder holding a finished run is refused unless ``overwrite`` (see :mod:`mqbench.app.folder`: the
earlier run comes back if the new one does not finish).
"""

from __future__ import annotations

import inspect
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import Tensor, fx, nn
from tqdm.auto import tqdm

from mqbench.app.causal_lm import load_causal_lm
from mqbench.app.check import DeployCheck, deployed_runner
from mqbench.app.config import ConfigError, load_config
from mqbench.app.distributed import Processes
from mqbench.app.folder import OutputError, RunFolder, describe_os_error, previous_status
from mqbench.app.report import (
    format_percent,
    format_perplexity,
    layer_errors,
    lsb_histogram,
    render_html,
    render_markdown,
)
from mqbench.app.sources import Data, fit_channels, load_data, load_language_model, load_model
from mqbench.backends import BackendSpec, resolve_backend
from mqbench.convert_deploy import convert_deploy
from mqbench.deploy.context import DeployResult
from mqbench.deploy.verify import verify_deploy
from mqbench.models.decoder import window_perplexity
from mqbench.models.sentence_embedding import embedding_agreement
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.host import describe_host, host_facts
from mqbench.utils.logger import logger

__all__ = [
    "OutputError",
    "Run",
    "RunFolder",
    "check_output",
    "deploy_folder_of",
    "deploy_model",
    "describe_results",
    "execute",
    "has_huggingface_tracer",
    "huggingface_tracer",
    "load_run",
    "output_index",
    "output_tensors",
    "prediction",
    "seed_everything",
]


@dataclass
class Run:
    """One run's state, handed to the command's quantization step."""

    config: dict[str, Any]
    spec: BackendSpec
    folder: RunFolder | None  # None on ranks other than 0
    processes: Processes
    quiet: bool
    data: Data
    val: Tensor
    val_labels: Tensor | None
    seconds: dict[str, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # results.json entries of the quantization step

    @property
    def batch_size(self) -> int:
        return int(self.config["data"]["batch_size"])

    @property
    def input_name(self) -> str | None:
        """The forward argument a Hugging Face model's data feeds (``input_ids`` for ``model.type: causal_lm``); None
        for other models."""
        if self.config["model"]["type"] == "causal_lm":
            return "input_ids"
        if self.config["model"]["tracer"] != "huggingface":
            return None
        return str((self.config["model"]["input_names"] or ["input_ids"])[0])

    def prepare(self, model: nn.Module) -> fx.GraphModule:
        """``prepare_by_platform`` with the configuration's backend and ``extra_prepare_dict``. A Hugging Face model
        is captured with transformers' HFTracer where it has one (``model.tracer: huggingface`` on transformers 4),
        else with torch.export on held-out token ids; ``model.type: causal_lm`` always with torch.export (HFTracer
        does not trace the decoders of transformers 4.57)."""
        options = dict(self.config["extra_prepare_dict"] or {})
        tracer = None
        traced = options.get("capture", "auto") != "export" and self.config["model"]["type"] != "causal_lm"
        if self.input_name is not None and traced and has_huggingface_tracer():
            tracer = huggingface_tracer()
            fixed = {name: None for name in inspect.signature(model.forward).parameters if name != self.input_name}
            options["concrete_args"] = fixed | dict(options.get("concrete_args") or {})
        elif self.input_name is not None:  # transformers 5 (no HFTracer), causal_lm: captured with torch.export
            options["capture"] = "export"
            options.setdefault("example_inputs", {self.input_name: self.verify_samples[:2]})
        try:
            return prepare_by_platform(model, self.spec, options, custom_tracer=tracer)
        except ValueError as error:  # a key or value prepare_by_platform does not take; its message names it
            raise ConfigError(f"extra_prepare_dict: {error}") from error

    @property
    def task(self) -> str:
        """``model.task``: classification, language_model or embedding."""
        return str(self.config["model"]["task"] or "classification")

    @property
    def verify_samples(self) -> Tensor:
        """The validation samples the deployment is verified on (``quantize.verify_samples``); a language model's
        held-out windows without their last token (the windows are one longer than its context, for the targets)."""
        samples = self.val[: self.config["quantize"]["verify_samples"]]
        return samples[:, :-1] if self.task == "language_model" else samples

    def calibration_batches(self) -> list[Tensor]:
        """``cali_batchsize`` global batches: every process's calibration data together (rank 0 calibrates)."""
        global_batch = self.batch_size * self.processes.world_size
        return self.data.calibration_batches(self.config["quantize"]["cali_batchsize"], global_batch)

    @property
    def output(self) -> int | str | None:
        """Which of the model's outputs holds the class scores (``model.output``; see :func:`prediction`)."""
        return self.config["model"]["output"]

    def accuracy(self, run: Callable[[Tensor], Any], what: str) -> float | None:
        """Top-1 accuracy on the validation samples (None without labels, and for the tasks with their own metric)."""
        if self.task != "classification":
            return None
        return accuracy(run, self.val, self.val_labels, self.batch_size, what, self.quiet, self.output)

    def perplexity(self, run: Callable[[Tensor], Any], what: str) -> float | None:
        """A language model's held-out perplexity: ``exp`` of the mean next-token cross-entropy over the held-out
        windows, every position but the first (:func:`mqbench.models.decoder.window_perplexity`, for a deployed
        model's runner too; None for other tasks)."""
        if self.task != "language_model":
            return None
        windows = tqdm(self.val.split(self.batch_size), desc=f"perplexity ({what})", disable=self.quiet, leave=False)
        return window_perplexity(lambda ids: prediction(run(ids)), windows)

    def embeddings(self, run: Callable[[Tensor], Any], what: str) -> Tensor | None:
        """A sentence encoder's embeddings of the validation samples ``[N, D]`` (None for other tasks): the output
        ``model.output`` selects, ``[N, L, D]`` averaged over its L tokens (the samples are of one length, without
        padding: the attention-masked mean) or ``[N, D]`` as it is, L2-normalised."""
        if self.task != "embedding":
            return None
        pooled = []
        batches = tqdm(self.val.split(self.batch_size), desc=f"embeddings ({what})", disable=self.quiet, leave=False)
        with torch.no_grad():
            for ids in batches:
                output = run(ids)
                structured = isinstance(output, Tensor | dict | tuple | list)  # a model's; a runtime gives an array
                hidden = prediction(output, self.output) if structured else torch.as_tensor(np.asarray(output))
                if hidden.dim() not in (2, 3):
                    raise ConfigError(
                        f"model.task embedding: the output model.output selects ({self.output!r}) has shape "
                        f"{tuple(hidden.shape)}; it pools [N, L, D] hidden states (e.g. last_hidden_state) or takes "
                        "[N, D] embeddings: choose that output with model.output"
                    )
                pooled.append(F.normalize((hidden.mean(1) if hidden.dim() == 3 else hidden).float(), dim=-1))
        return torch.cat(pooled)


def load_run(
    config: dict[str, Any], spec: BackendSpec, folder: RunFolder | None, processes: Processes, quiet: bool
) -> tuple[Run, nn.Module, str]:
    """The run of a checked configuration: its data loaded; with its float model and a description of it."""
    if config["model"]["task"] == "language_model":
        load = load_causal_lm if config["model"]["type"] == "causal_lm" else load_language_model
        model, described, data = load(config)
    else:
        model, described = load_model(config["model"])
        data = fit_channels(load_data(config["data"], token_ids=config["model"]["tracer"] == "huggingface"), model)
    max_eval = config["data"]["max_eval"]
    val = data.val if max_eval is None else data.val[:max_eval]
    val_labels = data.val_labels if data.val_labels is None or max_eval is None else data.val_labels[:max_eval]
    return Run(config, spec, folder, processes, quiet, data, val, val_labels), model, described


def deploy_folder_of(config: dict[str, Any], run_folder: Path) -> Path:
    """Where a run's artifacts go: ``quantize.deploy.output_path``, else ``deploy/`` in the run folder."""
    output = config["quantize"]["deploy"]["output_path"]
    return Path(output) if output else run_folder / "deploy"


def deploy_model(run: Run, qmodel: nn.Module, output: Path) -> DeployResult:
    """``convert_deploy`` with the configuration's deploy settings into ``output``."""
    deploy = run.config["quantize"]["deploy"]
    samples = run.verify_samples
    name = run.input_name or "x"
    tokens = run.input_name is not None or run.task == "language_model"  # token ids: a real sample traces them
    if run.task == "language_model":
        name = next(iter(inspect.signature(qmodel.forward).parameters))
    return convert_deploy(
        qmodel,
        run.spec,
        None if tokens else {name: [1, *samples.shape[1:]]},
        output_path=output,
        model_name=deploy["model_name"],
        dummy_input={name: samples[:1]} if tokens else None,
        deploy_to_qlinear=deploy["deploy_to_qlinear"],
        dynamic_axes={name: {0: "batch"}},
    )


def has_huggingface_tracer() -> bool:
    """Whether transformers' ``HFTracer`` can be imported (transformers 4.x; 5.x removed torch.fx support)."""
    try:
        from transformers.utils.fx import HFTracer  # noqa: F401
    except ImportError:
        return False
    return True


def huggingface_tracer() -> fx.Tracer:
    """transformers' ``HFTracer`` (``model.tracer: huggingface``)."""
    try:
        from transformers.utils.fx import HFTracer
    except ImportError as error:
        raise ConfigError(
            "model.tracer: huggingface traces with transformers.utils.fx.HFTracer, which transformers 4.x has and "
            f"5.x removed ({error}); without it the model is captured with torch.export (extra_prepare_dict: "
            "{capture: export})"
        ) from error
    return HFTracer()


def prediction(output: Any, which: int | str | None = None) -> Tensor:
    """The class scores of a model's output: ``which`` (``model.output``) if given, an index into the output's
    tensors in the order the model returns them (flattened) or a key of a mapping output; otherwise the tensor,
    a mapping's ``logits`` (Hugging Face), or the first."""
    if which is not None:
        return output_tensors(output)[output_index(output, which)]
    if isinstance(output, Tensor):
        return output
    if isinstance(output, dict):  # transformers' ModelOutput is a dict too
        return output["logits"] if "logits" in output else next(iter(output.values()))
    if isinstance(output, tuple | list) and output:
        return prediction(output[0])
    raise TypeError(f"the model returned {type(output).__name__}; mqbench runs need class scores (a tensor)")


def output_tensors(output: Any) -> list[Tensor]:
    """A model's output tensors in the order it returns them (as the deployed model's outputs are ordered)."""
    return [leaf for leaf in pytree.tree_leaves(output) if isinstance(leaf, Tensor)]


def output_index(output: Any, which: int | str | None) -> int:
    """The position among :func:`output_tensors` of the class scores ``which`` chooses (see :func:`prediction`)."""
    tensors = output_tensors(output)
    if which is None:
        chosen = prediction(output)
        return next(i for i, t in enumerate(tensors) if t is chosen)
    if isinstance(which, str):
        keys = list(output) if isinstance(output, dict) else []
        if which not in keys or not isinstance(output[which], Tensor):
            raise ConfigError(
                f"model.output {which!r}: the model returns {type(output).__name__}"
                f"{' with keys ' + ', '.join(map(str, keys)) if keys else ''}; give one of its tensor keys or an "
                f"index from 0 to {len(tensors) - 1}"
            )
        return next(i for i, t in enumerate(tensors) if t is output[which])
    if which >= len(tensors):
        raise ConfigError(
            f"model.output {which}: the model returns {len(tensors)} tensor(s); give an index from 0 to "
            f"{len(tensors) - 1}"
        )
    return which


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@torch.no_grad()
def accuracy(
    run: Callable[[Tensor], Any],
    images: Tensor,
    labels: Tensor | None,
    size: int,
    what: str,
    quiet: bool,
    which: int | str | None = None,
) -> float | None:
    if labels is None:
        return None
    correct = 0
    for start in tqdm(range(0, len(images), size), desc=f"accuracy ({what})", disable=quiet, leave=False):
        output = run(images[start : start + size])
        structured = isinstance(output, Tensor | dict | tuple | list)  # a model's; a runtime gives an array
        logits = prediction(output, which) if structured else torch.as_tensor(np.asarray(output))
        correct += int((logits.argmax(1) == labels[start : start + size]).sum())
    return correct / len(labels)


def _verify_summary(check: Any, samples: int) -> dict[str, Any]:
    report = check.report
    artifacts = {}
    for key, art in report.artifacts.items():
        artifacts[key] = {
            "runtime": art.runtime,
            "max_lsb_diff": float(art.max_lsb_diff),
            "exact_fraction": float(art.exact_fraction),
            "host_max_lsb_diff": None if art.host is None else float(art.host.max_lsb_diff),
        }
    return {
        "passed": bool(check.passed),
        "tolerance": check.tolerance,
        "samples": samples,
        "artifacts": artifacts,
        "failures": report.failures(),
        "lsb_histograms": lsb_histogram(report),
    }


Quantize = Callable[[Run, nn.Module], nn.Module]


def _perplexities(
    run: Run, float_: float | None, simulated: float | None, deployed: float | None, artifact: str
) -> dict[str, Any]:
    """``results.json``'s ``perplexity`` entry of a language model (nothing for other tasks)."""
    if run.task != "language_model":
        return {}
    return {
        "perplexity": {
            "float": float_,
            "simulated": simulated,
            "deployed": deployed,
            "deployed_artifact": artifact,
            "windows": len(run.val),
            "window_tokens": int(run.val.shape[1]) - 1,
        }
    }


def _embedding_agreements(
    run: Run, reference: Tensor | None, simulated: Tensor | None, deployed: Tensor | None, artifact: str
) -> dict[str, Any]:
    """``results.json``'s ``embedding`` entry of a sentence encoder (nothing for other tasks): the simulated and the
    deployed model's :func:`~mqbench.models.sentence_embedding.embedding_agreement` with the float embeddings."""
    if reference is None or simulated is None or deployed is None:
        return {}
    return {
        "embedding": {
            "simulated": asdict(embedding_agreement(reference, simulated)),
            "deployed": asdict(embedding_agreement(reference, deployed)),
            "deployed_artifact": artifact,
            "output": run.output,
            "samples": len(run.val),
            "sample_shape": list(run.val.shape[1:]),
            "dimension": int(reference.shape[1]),
        }
    }


def check_output(output: str | Path, overwrite: bool) -> str | None:
    """Refuse an output folder that holds a finished run unless ``overwrite``; the status of the run there."""
    previous = previous_status(output)
    if previous == "finished" and not overwrite:
        raise OutputError(
            f"{output} holds a finished run (its results.json says finished); give --output another folder, or "
            "add --overwrite to replace that run (its files, deploy/ included, are removed when the new run "
            "finishes, and kept if it does not)"
        )
    return previous


def execute(
    command: str,
    config_path: str | Path | dict[str, Any],
    output: str | Path,
    quantize: Quantize,
    quiet: bool,
    handles: dict[str, Any] | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Run ``config_path`` with the quantization step ``quantize(run, float_model) -> quantized model``.

    ``config_path`` is a YAML file or an already checked configuration (:func:`parse_config`'s result).
    Returns ``results.json``'s content (on every rank; only rank 0 writes and deploys). ``handles``, when
    given, receives the ``DeployResult`` (``deploy_result``) and one validation sample as NumPy
    (``sample``), for callers that go on measuring the deployed model. ``overwrite``: replace a finished
    run in ``output`` (else an :class:`OutputError`). A file that cannot be written (a full disk, a
    read-only folder) is an :class:`OutputError` naming it, and ``results.json`` says ``failed``.
    """
    config = config_path if isinstance(config_path, dict) else load_config(config_path)
    if isinstance(config_path, dict):
        config_path = "<configuration>"
    previous = check_output(output, overwrite)  # on every rank, before any of them starts
    processes = Processes.from_env()
    folder: RunFolder | None = None
    results: dict[str, Any] = {"status": "running", "command": command, "config": str(config_path)}
    try:
        if processes.main:
            folder = RunFolder(output)
            if previous is not None:
                resume = config["training"]["resume"]
                folder.set_aside_previous([Path(resume)] if resume else [], restore_on_failure=previous == "finished")
        return _execute(config, folder, processes, results, quantize, quiet, handles)
    except KeyboardInterrupt:
        if folder is not None:
            folder.fail({**results, "status": "interrupted"})
        raise
    except Exception as error:
        reason = describe_os_error(error) if isinstance(error, OSError) else str(error)
        if folder is not None:
            folder.fail({**results, "status": "failed", "error": f"{type(error).__name__}: {reason}"})
        if isinstance(error, OSError):
            raise OutputError(reason) from error
        raise
    finally:
        processes.close()


def _execute(
    config: dict[str, Any],
    folder: RunFolder | None,
    processes: Processes,
    results: dict[str, Any],
    quantize: Quantize,
    quiet: bool,
    handles: dict[str, Any] | None,
) -> dict[str, Any]:
    import yaml

    quiet = quiet or not processes.main
    try:
        spec = resolve_backend(config["quantize"]["backend"])
    except (KeyError, ValueError) as error:
        raise ConfigError(f"quantize.backend: {error}") from error
    results["backend"] = spec.name
    if folder is not None:
        folder.write_text("config.yaml", yaml.safe_dump(config, sort_keys=False))
        folder.write_json("results.json", results)
    seed_everything(config["process"]["seed"])

    started = time.perf_counter()
    run, model, described = load_run(config, spec, folder, processes, quiet)
    run.seconds["load"] = time.perf_counter() - started
    data, val = run.data, run.val
    logger.info("model: %s; data: %s (%d train, %d validation)", described, data.source, len(data.train), len(val))
    results |= {"model": described, "host": describe_host(), "host_facts": host_facts()}

    float_accuracy = float_perplexity = float_embeddings = None
    if processes.main:
        started = time.perf_counter()
        float_accuracy = run.accuracy(model, "float")
        float_perplexity = run.perplexity(model, "float")
        float_embeddings = run.embeddings(model, "float")
        run.seconds["float evaluation"] = time.perf_counter() - started

    qmodel = quantize(run, model)
    results |= run.extra
    if not processes.main:
        return {**results, "status": "finished (rank 0 deploys)"}
    assert folder is not None
    qmodel.eval()
    folder.save_torch("quantized_state_dict.pt", qmodel.state_dict())

    started = time.perf_counter()
    simulated_accuracy = run.accuracy(qmodel, "simulated")
    simulated_perplexity = run.perplexity(qmodel, "simulated")
    simulated_embeddings = run.embeddings(qmodel, "simulated")
    run.seconds["simulated evaluation"] = time.perf_counter() - started

    started = time.perf_counter()
    deploy_folder = deploy_folder_of(config, folder.path)
    samples = run.verify_samples
    logger.info("deploying for %s into %s and verifying on %d samples", spec.name, deploy_folder, len(samples))
    with tqdm(total=2, desc=f"deploy for {spec.name}", disable=quiet, leave=False) as bar:
        result = deploy_model(run, qmodel, deploy_folder)
        bar.set_description(f"verify {len(result.artifacts)} artifact(s)")
        bar.update()
        report = verify_deploy(qmodel, result, samples)
        bar.update()
    check = DeployCheck(spec.name, result, report, spec.lsb_tolerance)
    folder.write_text("verify.txt", check.report.summary() + "\n")
    run.seconds["deploy and verify"] = time.perf_counter() - started

    started = time.perf_counter()
    errors = layer_errors(qmodel, samples)
    run.seconds["quantization error"] = time.perf_counter() - started

    started = time.perf_counter()
    with torch.no_grad():
        index = output_index(model(samples[:1]), run.output)  # the deployed model's outputs are in this order
    artifact, runner = deployed_runner(check.result, index)
    deployed_accuracy = run.accuracy(lambda x: runner(x.numpy()), f"deployed {artifact}")
    deployed_perplexity = run.perplexity(
        lambda x: torch.as_tensor(np.asarray(runner(x.numpy()))), f"deployed {artifact}"
    )
    deployed_embeddings = run.embeddings(lambda x: runner(x.numpy()), f"deployed {artifact}")
    run.seconds["deployed evaluation"] = time.perf_counter() - started

    results |= {
        "status": "finished",
        "data": {
            "source": data.source,
            "calibration_samples": sum(len(b) for b in run.calibration_batches()),
            "val_samples": len(val),
            "classes": list(data.classes),
        },
        "accuracy": {
            "float": float_accuracy,
            "simulated": simulated_accuracy,
            "deployed": deployed_accuracy,
            "deployed_artifact": artifact,
        },
        "verify": _verify_summary(check, len(samples)),
        **_perplexities(run, float_perplexity, simulated_perplexity, deployed_perplexity, artifact),
        **_embedding_agreements(run, float_embeddings, simulated_embeddings, deployed_embeddings, artifact),
        "simulation_vs_float": report.fidelity.to_dict() if report.fidelity is not None else None,
        "layer_errors": errors,
        "artifacts": {key: str(path) for key, path in check.result.artifacts.items()},
        "seconds": run.seconds,
    }
    if handles is not None:
        handles |= {"deploy_result": check.result, "sample": samples[:1].numpy()}
    folder.write_text("report.md", render_markdown(results))
    folder.write_text("report.html", render_html(results))
    folder.write_json("results.json", results)
    inputs = [
        name for name in ("config.yaml", "mixed_precision.yaml", "quantized_state_dict.pt") if name in folder.written
    ]
    artifacts = [Path(path).resolve() for path in check.result.artifacts.values()]
    folder.write_checksums([*inputs, *artifacts])  # last: the run is complete
    folder.finish()
    return results


def describe_results(results: dict[str, Any]) -> str:
    """A few lines for the terminal."""
    if "accuracy" not in results:
        return f"{results.get('command', 'run')}: {results['status']}"
    acc = results["accuracy"]
    verdict = "passed" if results["verify"]["passed"] else "FAILED"

    pct, ppl = format_percent, format_perplexity
    if "embedding" in results:
        e = results["embedding"]

        def agreement(figures: dict[str, float]) -> str:
            return (
                f"mean cosine {figures['mean_cosine']:.4f}, min {figures['min_cosine']:.4f}, nearest neighbour "
                f"{pct(figures['neighbour_agreement'])}"
            )

        return (
            f"{results['model']} on {results['backend']} ({results['method']}): sentence embeddings against the float "
            f"model's (higher is better): simulated {agreement(e['simulated'])}; deployed ({e['deployed_artifact']}) "
            f"{agreement(e['deployed'])}; verify {verdict}"
        )
    if "perplexity" in results:
        p = results["perplexity"]
        left_float = ", ".join(results.get("float_layers") or {})
        return (
            f"{results['model']} on {results['backend']} ({results['method']}): held-out perplexity (lower is "
            f"better) float {ppl(p['float'])}, simulated {ppl(p['simulated'])}, deployed {ppl(p['deployed'])} "
            f"({p['deployed_artifact']}); verify {verdict}"
            + (f"; left float: {left_float}" if left_float else "")
            # the text the windows were cut from (a causal_lm run's corpus and its split)
            + f"\ndata: {results['data']['source']}"
        )
    return (
        f"{results['model']} on {results['backend']} ({results['method']}): float {pct(acc['float'])}, "
        f"simulated {pct(acc['simulated'])}, deployed {pct(acc['deployed'])} ({acc['deployed_artifact']}); "
        f"verify {verdict}"
    )
