"""``mqbench qat --config FILE --output DIR``: quantization-aware training of the configured model.

The model is prepared in training mode (fused conv+BN modules, the backend's QAT quantizers),
calibrated on ``quantize.cali_batchsize`` training batches (observers on, in eval mode, as
MQBench's example does), then trained with cross-entropy for ``training.epochs`` epochs with
quantization in the loop. After each epoch rank 0 measures the simulated accuracy and writes
``checkpoint.pt`` (the model, the optimizer, the epoch and the history; ``training.resume`` continues
from it, with the same data order as an uninterrupted run). Deployment, verification and the
report are :mod:`mqbench.app.runs`'.

Under ``torchrun --nproc_per_node N -m mqbench qat ...`` the training is data parallel, set up as
:mod:`mqbench.app.distributed` describes: ``data.batch_size`` per process, one global batch of
``N * batch_size`` per step.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from mqbench.app.config import ConfigError
from mqbench.app.distributed import restore_batch_norm, synchronise_batch_norm
from mqbench.app.runs import Run, execute, prediction
from mqbench.fake_quantize.lsq import LearnableFakeQuantize
from mqbench.utils.role import role_of
from mqbench.utils.state import enable_calibration, enable_quantization

__all__ = ["run_qat"]

_RESUME_IGNORES = {("training", "resume"), ("training", "epochs")}


def _optimizer(training: dict[str, Any], parameters: list[nn.Parameter]) -> torch.optim.Optimizer:
    lr, decay = float(training["lr"]), float(training["weight_decay"])
    if training["optimizer"] == "sgd":
        return torch.optim.SGD(parameters, lr=lr, momentum=float(training["momentum"]), weight_decay=decay)
    if training["optimizer"] == "adamw":
        return torch.optim.AdamW(parameters, lr=lr, weight_decay=decay)
    return torch.optim.Adam(parameters, lr=lr, weight_decay=decay)


def _comparable(config: dict[str, Any]) -> dict[str, Any]:
    """The configuration without the keys a resumed run may change."""
    return {
        section: {k: v for k, v in values.items() if (section, k) not in _RESUME_IGNORES}
        if isinstance(values, dict)
        else values
        for section, values in config.items()
    }


def _resume(run: Run, qmodel: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, list[dict[str, Any]]]:
    path = run.config["training"]["resume"]
    if path is None:
        return 0, []
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"training.resume: no such checkpoint {str(file)!r}")
    checkpoint = torch.load(file, map_location="cpu", weights_only=True)
    if not isinstance(checkpoint, dict) or not {"model", "optimizer", "epoch", "history", "config"} <= set(checkpoint):
        raise ConfigError(f"training.resume: {str(file)!r} is not a checkpoint.pt written by mqbench qat")
    if _comparable(checkpoint["config"]) != _comparable(run.config):
        raise ConfigError(
            f"training.resume: {str(file)!r} was written by a run of another configuration; only training.epochs "
            "and training.resume may differ"
        )
    qmodel.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    return int(checkpoint["epoch"]), list(checkpoint["history"])


def _quantize(run: Run, model: nn.Module) -> nn.Module:
    config, processes = run.config, run.processes
    if config["quantize"]["quantize_type"] == "advanced_ptq":
        raise ConfigError(
            "quantize.quantize_type: advanced_ptq is for mqbench ptq; mqbench qat calibrates, then trains"
        )
    if run.data.train_labels is None:
        raise ConfigError("data.path: QAT trains with cross-entropy and needs labels (y_train in a .npz)")
    training = config["training"]
    run.extra["method"] = "qat"

    started = time.perf_counter()
    qmodel = run.prepare(copy.deepcopy(model).train())  # the float model (a shared zoo instance) keeps its mode
    qmodel.eval()
    enable_calibration(qmodel)
    if processes.main:  # rank 0 calibrates on the whole set; the others get its state
        with torch.no_grad():
            for batch in tqdm(run.calibration_batches(), desc="calibration", disable=run.quiet, leave=False):
                qmodel(batch)
    enable_quantization(qmodel)
    processes.broadcast_state(qmodel)
    run.seconds["calibration"] = time.perf_counter() - started

    if processes.distributed:
        synchronise_batch_norm(qmodel)
        for name, module in qmodel.named_modules():  # LSQ's gradient scale counts the global batch
            if isinstance(module, LearnableFakeQuantize) and role_of(name, module).kind == "activation":
                module.batch_replicas = processes.world_size
    optimizer = _optimizer(training, [p for p in qmodel.parameters() if p.requires_grad])
    start_epoch, history = _resume(run, qmodel, optimizer)
    trained: nn.Module = qmodel
    if processes.distributed:
        trained = nn.parallel.DistributedDataParallel(qmodel, find_unused_parameters=True)

    images, labels = run.data.train, run.data.train_labels
    global_batch = run.batch_size * processes.world_size
    steps = len(images) // global_batch
    if training["max_steps"] is not None:
        steps = min(steps, training["max_steps"])
    if steps == 0:
        raise ConfigError(
            f"data.batch_size: one step needs {global_batch} training samples ({processes.world_size} process(es)), "
            f"there are {len(images)}"
        )
    started = time.perf_counter()
    for epoch in range(start_epoch, training["epochs"]):
        if training["lr_scheduler"] == "cosine":  # a function of the epoch: a resumed run continues it
            for group in optimizer.param_groups:
                group["lr"] = float(training["lr"]) * 0.5 * (1.0 + math.cos(math.pi * epoch / training["epochs"]))
        order = torch.randperm(len(images), generator=torch.Generator().manual_seed(config["process"]["seed"] + epoch))
        trained.train()
        losses = []
        for step in tqdm(range(steps), desc=f"QAT epoch {epoch + 1}", disable=run.quiet, leave=False):
            index = processes.shard(order[step * global_batch : (step + 1) * global_batch])
            loss = F.cross_entropy(prediction(trained(images[index]), run.output), labels[index])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
        mean_loss = processes.mean(statistics.fmean(losses))
        if processes.main:
            qmodel.eval()
            accuracy = run.accuracy(qmodel, f"simulated, epoch {epoch + 1}")
            qmodel.train()
            history.append({"epoch": epoch + 1, "loss": mean_loss, "accuracy": accuracy})
            assert run.folder is not None
            run.folder.save_torch(
                "checkpoint.pt",
                {
                    "model": qmodel.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "epoch": epoch + 1,
                    "history": history,
                    "config": config,
                },
            )
            accuracy_text = "-" if accuracy is None else f"{100 * accuracy:.2f}%"
            if not run.quiet:
                tqdm.write(f"epoch {epoch + 1}: loss {mean_loss:.4f}, simulated accuracy {accuracy_text}")
        processes.barrier()
    run.seconds["training"] = time.perf_counter() - started
    if processes.distributed:
        restore_batch_norm(qmodel)
    run.extra["training"] = {
        "epochs": training["epochs"],
        "resumed_from_epoch": start_epoch,
        "steps_per_epoch": steps,
        "global_batch": global_batch,
        "processes": processes.world_size,
        "history": history,
    }
    return qmodel


def run_qat(
    config_path: str | Path | dict[str, Any], output: str | Path, quiet: bool = False, overwrite: bool = False
) -> dict[str, Any]:
    """Run the QAT configuration ``config_path`` into the folder ``output``; returns ``results.json``'s content.

    ``overwrite``: replace a finished run in ``output`` (refused otherwise)."""
    return execute("QAT", config_path, output, _quantize, quiet, overwrite=overwrite)
