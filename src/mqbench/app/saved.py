"""``mqbench deploy --run DIR`` and ``mqbench verify --run DIR``: a finished run folder, rebuilt.

The quantized model of a run is its configuration's float model, prepared as the run prepared it
(``config.yaml``; a mixed-precision run's ``mixed_precision.yaml``; training mode for a QAT run),
with ``quantized_state_dict.pt`` loaded. ``deploy`` writes every artifact again (into the run's
deploy folder unless told otherwise; each set is moved into place whole). ``verify`` checks the
artifacts the run folder holds against the simulation of the saved model, on the run's validation
samples, and changes nothing.

Both first compare the folder's files with the checksums the run recorded when it finished
(``checksums.sha256``): ``verify`` every file in it, ``deploy`` the files it rebuilds the model from
(``config.yaml``, ``mixed_precision.yaml``, ``quantized_state_dict.pt``). A changed or missing file is an
error naming it and what to do; ``deploy`` into the run's own deploy folder records the new artifacts'
checksums.
"""

from __future__ import annotations

import copy
import json
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
import yaml
from torch import nn

from mqbench.advanced_ptq import restore_smoothing
from mqbench.app.check import DeployCheck
from mqbench.app.config import ConfigError, load_config
from mqbench.app.distributed import Processes
from mqbench.app.folder import CHECKSUMS, check_checksums, create_folder, update_checksums
from mqbench.app.runs import Run, deploy_folder_of, deploy_model, load_run, seed_everything
from mqbench.backends import resolve_backend
from mqbench.deploy.context import DeployResult
from mqbench.deploy.verify import verify_deploy
from mqbench.utils.logger import logger

__all__ = ["deploy_saved_run", "load_saved_run", "verify_saved_run"]

_MODEL_FILES = ("config.yaml", "mixed_precision.yaml", "quantized_state_dict.pt")


def load_saved_run(folder: str | Path, quiet: bool = True) -> tuple[Run, nn.Module]:
    """The run and its quantized model (eval mode) from the run folder ``folder``."""
    path = Path(folder)
    results_file, config_file = path / "results.json", path / "config.yaml"
    if not results_file.is_file() or not config_file.is_file():
        raise ConfigError(
            f"{path}: not a run folder (it needs results.json and config.yaml); give the --output folder of "
            "mqbench ptq, qat, profile or mixed-precision"
        )
    results = json.loads(results_file.read_text())
    status = results.get("status")
    state_file = path / "quantized_state_dict.pt"
    if status != "finished" or not state_file.is_file():
        raise ConfigError(f"{path}: the run's status is {status!r}; only a finished run holds a quantized model")
    if not check_checksums(path, lambda name: name in _MODEL_FILES):
        logger.warning("%s has no %s (a run from before they were written): its files are not checked", path, CHECKSUMS)
    config = load_config(config_file)
    chosen = path / "mixed_precision.yaml"
    if chosen.is_file():  # the widths the mixed-precision search chose
        config["extra_prepare_dict"] = yaml.safe_load(chosen.read_text())
    try:
        spec = resolve_backend(config["quantize"]["backend"])
    except (KeyError, ValueError) as error:
        raise ConfigError(f"quantize.backend: {error}") from error
    seed_everything(config["process"]["seed"])
    run, model, _ = load_run(config, spec, None, Processes(), quiet)
    training = str(results.get("command", "")).lower() == "qat"  # prepared with BatchNorm folded while training
    qmodel = run.prepare(copy.deepcopy(model).train() if training else model)
    state = torch.load(state_file, weights_only=True)
    restore_smoothing(qmodel, state)
    qmodel.load_state_dict(state)
    return run, qmodel.eval()


def deploy_saved_run(folder: str | Path, output: str | Path | None = None, quiet: bool = True) -> DeployResult:
    """Deploy a run folder's quantized model again, into ``output`` (default: the run's deploy folder)."""
    if output is not None:
        create_folder(Path(output), "the deploy folder")
    run, qmodel = load_saved_run(folder, quiet)
    own = deploy_folder_of(run.config, Path(folder))
    target = Path(output) if output is not None else own
    result = deploy_model(run, qmodel, target)
    if target.resolve() == own.resolve():  # the run's artifacts, written again: their checksums follow
        update_checksums(folder, result.artifacts.values())
    return result


def verify_saved_run(folder: str | Path, reference: bool = False, quiet: bool = True) -> DeployCheck:
    """Check the artifacts in a run folder against the simulation of its saved quantized model."""
    check_checksums(folder)  # every file the run recorded, its artifacts included
    run, qmodel = load_saved_run(folder, quiet)
    saved_folder = deploy_folder_of(run.config, Path(folder))
    with tempfile.TemporaryDirectory() as scratch:  # the deployment's names and qparams, derived again
        derived = deploy_model(run, qmodel, Path(scratch))
    saved = {key: saved_folder / Path(file).name for key, file in derived.artifacts.items()}
    missing = sorted(str(file) for file in saved.values() if not file.is_file())
    if missing:
        raise ConfigError(
            f"{folder}: the run's artifacts are missing ({', '.join(missing)}); write them with mqbench deploy --run"
        )
    result = replace(derived, artifacts={key: str(file) for key, file in saved.items()})
    report = verify_deploy(qmodel, result, run.verify_samples, reference=reference)
    return DeployCheck(run.spec.name, result, report, run.spec.lsb_tolerance)
