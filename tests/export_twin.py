"""A pytest plugin: every model the suite prepares with torch.fx is also captured with torch.export, and compared.

Run the suite with it to check the export path on every model the tests prepare:

    MQBENCH_EXPORT_TWIN=twins.jsonl .venv/bin/pytest -p export_twin

Wherever a test calls ``prepare_by_platform`` (without choosing a capture or a custom tracer) and then calls the
prepared model, the first call's inputs become ``example_inputs``: the same float model is prepared again with
``capture="export"``, given the fx-prepared model's state (parameters, statistics, switches), and both compute
the first call's inputs (on copies, under one random seed). One JSON line per prepared model records the outcome:
``same`` (the same modules of the same types, and equal outputs bit for bit), ``renamed`` (equal outputs; some
quantizers are named after another name of the node they follow, such as ``relu`` for fx's ``relu_``, paired in
graph order), ``different`` (with what differs),
``export_failed`` (with the error) or ``not_called``. The test itself goes on with the fx-prepared model: the
plugin measures, it changes no test's outcome.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import traceback
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree

import mqbench.prepare_by_platform as platform
from mqbench.custom_quantizer.ops import IDENTITY_MODULES
from mqbench.utils.state import is_quantizer

OUTPUT = os.environ.get("MQBENCH_EXPORT_TWIN")
ORIGINAL = platform.prepare_by_platform


def _write(record: dict[str, Any]) -> None:
    if OUTPUT:
        with open(OUTPUT, "a") as stream:
            stream.write(json.dumps(record) + "\n")


def _names(model: torch.fx.GraphModule) -> dict[str, type]:
    """The modules the graph calls, by name, but for quantizers (compared by count and order: a quantizer is named
    after the node it follows, and the captures name some nodes differently) and identity-like ones (export drops
    ``nn.Identity``; fx keeps the module that holds one, uncalled)."""
    called = {str(node.target) for node in model.graph.nodes if node.op == "call_module"}
    modules = {name: model.get_submodule(name) for name in called}
    return {
        name: type(module)
        for name, module in modules.items()
        if not is_quantizer(module) and not isinstance(module, IDENTITY_MODULES)
    }


def _compare(test: str, prepared: torch.fx.GraphModule, twin: torch.fx.GraphModule, args: Any, kwargs: Any) -> dict:
    record: dict[str, Any] = {"test": test}
    fx_names, export_names = _names(prepared), _names(twin)
    if fx_names.keys() != export_names.keys():
        missing = sorted(fx_names.keys() - export_names.keys())[:4]
        extra = sorted(export_names.keys() - fx_names.keys())[:4]
        return {**record, "status": "different", "why": f"modules only fx: {missing}, only export: {extra}"}
    wrong = [name for name in fx_names if fx_names[name] is not export_names[name]]
    if wrong:
        return {**record, "status": "different", "why": f"module types differ: {wrong[:4]}"}
    state = prepared.state_dict()
    renamed = set(state) != set(twin.state_dict())
    twin.load_state_dict(state, strict=False)
    # quantizers named after another getitem counter: the same quantizers in graph (registration) order
    fx_quantizers = [name for name, module in prepared.named_modules() if is_quantizer(module)]
    export_quantizers = [name for name, module in twin.named_modules() if is_quantizer(module)]
    only_fx = [name for name in fx_quantizers if name not in set(export_quantizers)]
    only_export = [name for name in export_quantizers if name not in set(fx_quantizers)]
    if len(only_fx) != len(only_export):
        return {
            **record,
            "status": "different",
            "why": f"quantizers only fx: {only_fx[:4]}, only export: {only_export[:4]}",
        }
    for fx_name, export_name in zip(only_fx, only_export, strict=True):
        twin.get_submodule(export_name).load_state_dict(prepared.get_submodule(fx_name).state_dict())
    twin.train(prepared.training)
    reference = copy.deepcopy(prepared)
    outputs = []
    for model in (reference, twin):
        with torch.random.fork_rng():
            torch.manual_seed(0)
            with torch.no_grad():
                outputs.append(pytree.tree_leaves(model(*copy.deepcopy(args), **copy.deepcopy(kwargs))))
    expected, got = outputs
    tensors = [(e, g) for e, g in zip(expected, got, strict=False) if isinstance(e, torch.Tensor)]
    if len(expected) != len(got) or not all(isinstance(g, torch.Tensor) and torch.equal(e, g) for e, g in tensors):
        worst = max(
            (
                float((e.float() - g.float()).abs().max())
                for e, g in tensors
                if isinstance(g, torch.Tensor) and e.shape == g.shape
            ),
            default=float("nan"),
        )
        return {**record, "status": "different", "why": f"outputs differ (max abs {worst:.3g})"}
    return {**record, "status": "renamed" if renamed else "same"}


def _twin_checked(test: str):
    def prepare_by_platform(
        model, deploy_backend, prepare_custom_config_dict=None, custom_tracer=None, is_qat=None, freeze_bn=False
    ):
        prepared = ORIGINAL(model, deploy_backend, prepare_custom_config_dict, custom_tracer, is_qat, freeze_bn)
        config = dict(prepare_custom_config_dict or {})
        if custom_tracer is not None or "capture" in config or "concrete_args" in config:
            return prepared
        source = copy.deepcopy(platform.unwrap_model(model))
        record = {"test": test, "status": "not_called"}
        done = {"called": False}

        def first_call(module, args, kwargs):
            if done["called"]:
                return None
            done["called"] = True
            handle.remove()
            example = dict(kwargs) if kwargs and not args else tuple(args)
            if kwargs and args:
                record.update(status="skipped", why="positional and keyword inputs")
                return None
            export_config = {**config, "capture": "export", "example_inputs": example}
            try:
                with torch.random.fork_rng():
                    twin = ORIGINAL(source, deploy_backend, export_config, None, is_qat, freeze_bn)
            except Exception as error:  # measured, not raised
                record.update(status="export_failed", why=f"{type(error).__name__}: {str(error)[:300]}")
                return None
            try:
                record.update(_compare(test, module, twin, args, kwargs))
            except Exception as error:  # measured, not raised
                record.update(status="compare_failed", why="".join(traceback.format_exception_only(error))[:300])
            return None

        handle = prepared.register_forward_pre_hook(first_call, with_kwargs=True)
        _PENDING.append(record)
        return prepared

    return prepare_by_platform


_PENDING: list[dict[str, Any]] = []


@pytest.fixture(autouse=True)
def _export_twin(request, monkeypatch):
    if not OUTPUT:
        yield
        return
    wrapper = _twin_checked(request.node.nodeid)
    for module in list(sys.modules.values()):
        if getattr(module, "prepare_by_platform", None) is ORIGINAL:
            monkeypatch.setattr(module, "prepare_by_platform", wrapper)
    yield
    while _PENDING:
        _write(_PENDING.pop(0))
