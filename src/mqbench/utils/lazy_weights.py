"""Weights kept on disk while a model is calibrated block by block: memory bounded by one block.

A model made without its weights (``accelerate.init_empty_weights()`` or ``torch.device("meta")`` while building
it: its parameters on the ``meta`` device, shapes without values) is captured and prepared like any other.
:func:`attach_weights` then names where its weights are: a safetensors file, a Hugging Face folder of safetensors
shards (``model.safetensors.index.json``), or any mapping of names to tensors. Each parameter on ``meta`` becomes a
placeholder of its shape holding no memory (one placeholder for a tensor tied in two places).

A model loaded by transformers with some modules offloaded to disk (``from_pretrained(..., device_map=...,
offload_folder=...)``: accelerate leaves their parameters on ``meta`` and loads them in hooks around each forward)
is prepared the same way: :func:`offloaded_weights` takes accelerate's weights loader from the model and removes
its hooks (the capture must see the modules as they compute), and the loader is the source to attach.

The calibration pipeline (:class:`~mqbench.advanced_ptq.pipeline.Pipeline`) loads a block's weights when it
reaches the block (onto its ``device`` when it has one), the algorithm works on them, and when the block is done
they are written, as the algorithm left them, to the offload folder and memory-mapped from there: pages of a file
the system reads back when touched and may drop under memory pressure, not memory the process holds. At any time
one block's weights are loaded; after the pass every weight is a memory-mapped tensor and the model is whole. A
later pass (AWQ then GPTQ) loads each block's memory-mapped weights into memory again and writes them back when
done: every pass holds one block. :func:`materialize` ends this: the weights stay where they are (in memory, or
memory-mapped), and later passes no longer write blocks back.

A deep copy of a model whose weights are still on disk is refused (the copy's placeholders would name nothing); once
every weight is loaded or memory-mapped, a copy holds its own tensors and no store.

Algorithms that need every weight at once before the pass (AWQ and SmoothQuant rescale layers after it, the
rotation rewrites them all) and ``convert_deploy`` refuse a model with weights still on disk, saying to load them
first with :func:`materialize` (memory-mapped where they come from the offload folder).

Example:
    >>> import tempfile, torch
    >>> from torch import nn
    >>> from mqbench.prepare_by_platform import prepare_by_platform
    >>> from mqbench.advanced_ptq import attach_weights, calibrate
    >>> class Stack(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
    ...     def forward(self, x):
    ...         for layer in self.layers:
    ...             x = x + layer(x)
    ...         return x
    >>> weights = Stack().state_dict()
    >>> with torch.device("meta"):
    ...     empty = Stack().eval()
    >>> qmodel = prepare_by_platform(empty, "llm_w8a16", {"example_inputs": (torch.randn(2, 8),)})
    >>> store = attach_weights(qmodel, weights)
    >>> len(store.pending)
    6
    >>> _ = calibrate(qmodel, [torch.randn(4, 8)])
    >>> len(store.pending), bool(torch.equal(qmodel.get_parameter("layers.0.weight"), weights["layers.0.weight"]))
    (0, True)
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "LAZY_WEIGHTS",
    "WeightStore",
    "attach_weights",
    "materialize",
    "offloaded_weights",
    "pending_weights",
    "require_weights",
    "store_of",
]

LAZY_WEIGHTS = "mqbench_lazy_weights"  # the key of GraphModule.meta (any module's attribute) holding the store


class WeightStore:
    """Where each weight's values are (``pending``: placeholder -> name in the source; ``loaded``: those a block
    holds in memory now; ``mapped``: those memory-mapped from the offload folder, where finished blocks go)."""

    def __init__(self, source: str | Path | Mapping[str, Tensor], folder: str | Path | None = None) -> None:
        self._mapping: Mapping[str, Tensor] | None = None
        self._files: dict[str, Path] = {}
        if isinstance(source, Mapping):
            self._mapping = source
        else:
            self._files = _safetensors_names(Path(source))
        self._temporary = None if folder is not None else tempfile.TemporaryDirectory(prefix="mqbench-offload-")
        self.folder = Path(folder if folder is not None else self._temporary.name)  # type: ignore[union-attr]
        self.folder.mkdir(parents=True, exist_ok=True)
        self.pending: dict[Tensor, str] = {}
        self.loaded: dict[Tensor, str] = {}
        self.mapped: dict[Tensor, str] = {}
        self._written = 0

    def __deepcopy__(self, memo: dict[int, Any]) -> None:
        if self.pending or self.loaded:
            raise ValueError(
                f"a model with {len(self.pending) + len(self.loaded)} weight(s) on disk (attach_weights) cannot be "
                "copied: its placeholders hold no values. Load them first (mqbench.advanced_ptq.materialize(model)), "
                "or work on the model itself"
            )
        return None  # every weight is the copy's own tensor: the copy keeps no store

    def names(self) -> set[str]:
        return set(self._mapping) if self._mapping is not None else set(self._files)

    def shape(self, name: str) -> tuple[int, ...]:
        if self._mapping is not None:
            return tuple(self._mapping[name].shape)
        from safetensors import safe_open

        with safe_open(str(self._files[name]), framework="pt") as handle:
            return tuple(handle.get_slice(name).get_shape())

    def read(self, name: str, dtype: torch.dtype, device: torch.device | str = "cpu") -> Tensor:
        """The source's values of ``name`` as ``dtype`` on ``device`` (a copy the caller owns)."""
        if self._mapping is not None:
            value = self._mapping[name]
        else:
            from safetensors import safe_open

            with safe_open(str(self._files[name]), framework="pt") as handle:
                value = handle.get_tensor(name)
        return value.to(device=device, dtype=dtype, copy=True)

    def load(self, tensors: Sequence[Tensor], device: torch.device | str | None) -> list[Tensor]:
        """Load the pending and memory-mapped ones of ``tensors`` (each once) into memory in place; those loaded."""
        loaded = []
        for tensor in _unique(tensors):
            to = device if device is not None else "cpu"
            name = self.pending.pop(tensor, None)
            if name is not None:
                tensor.data = self.read(name, tensor.dtype, to)
            elif tensor in self.mapped:  # a copy of its own: the file's pages are not written
                name = self.mapped.pop(tensor)
                tensor.data = tensor.data.to(to, copy=True)
            else:
                continue
            self.loaded[tensor] = name
            loaded.append(tensor)
        return loaded

    def offload(self, tensors: Sequence[Tensor], label: str) -> None:
        """Write ``tensors`` (loaded by :meth:`load`) to one file of the offload folder and memory-map each from
        it: their values kept, their memory given back."""
        if not tensors:
            return
        file = self.folder / f"{self._written:04d}-{_safe(label)}.pt"
        self._written += 1
        names = {tensor: self.loaded[tensor] for tensor in tensors}
        torch.save({names[t]: t.detach().to("cpu") for t in tensors}, file)
        mapped = torch.load(file, mmap=True, weights_only=True)
        for tensor in tensors:
            tensor.data = mapped[names[tensor]]
            self.mapped[tensor] = self.loaded.pop(tensor)


def _unique(tensors: Sequence[Tensor]) -> Iterator[Tensor]:
    seen: set[int] = set()
    for tensor in tensors:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            yield tensor


def _safe(label: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in label)[:80]


def _safetensors_names(path: Path) -> dict[str, Path]:
    """Each tensor name of a safetensors file or folder (sharded with its index, or every ``*.safetensors``) and
    its file."""
    if not path.exists():
        raise FileNotFoundError(f"attach_weights: {path} does not exist (a .safetensors file or a folder of them)")
    try:
        from safetensors import safe_open
    except ImportError as error:  # pragma: no cover - safetensors comes with transformers
        raise ImportError("attach_weights reads safetensors files: pip install safetensors") from error
    if path.is_dir():
        index = path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            return {name: path / file for name, file in weight_map.items()}
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(
                f"attach_weights: {path} holds no .safetensors file (a Hugging Face folder saved with "
                "save_pretrained(..., safe_serialization=True) has model.safetensors or shards with an index)"
            )
    else:
        files = [path]
    names = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            names.update({name: file for name in handle.keys()})  # noqa: SIM118 - a handle, not a dict
    return names


def _meta_slots(model: nn.Module) -> dict[Tensor, list[tuple[nn.Module, str, str]]]:
    """Each parameter or buffer on ``meta``, with every (module, attribute, full name) holding it."""
    slots: dict[Tensor, list[tuple[nn.Module, str, str]]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for kind in ("_parameters", "_buffers"):
            for attribute, tensor in getattr(module, kind).items():
                if isinstance(tensor, Tensor) and tensor.is_meta:
                    full = f"{path}.{attribute}" if path else attribute
                    slots.setdefault(tensor, []).append((module, attribute, full))
    return slots


def attach_weights(
    model: nn.Module, source: str | Path | Mapping[str, Tensor], folder: str | Path | None = None
) -> WeightStore:
    """Give ``model``'s parameters and buffers on ``meta`` their weights from ``source`` (see the module
    docstring), loaded block by block by the calibration pipeline; ``folder``: where finished blocks are written
    (default: a temporary folder removed with the store). Returns the store (also kept on the model)."""
    store = WeightStore(source, folder)
    slots = _meta_slots(model)
    if not slots:
        raise ValueError(
            "attach_weights: no parameter of the model is on the meta device; build the model without its weights "
            "(accelerate.init_empty_weights() or `with torch.device('meta'):`) and prepare it, then attach them"
        )
    available = store.names()
    missing, wrong = [], []
    chosen: dict[Tensor, str] = {}
    for tensor, held in slots.items():
        name = next((full for _, _, full in held if full in available), None)
        if name is None:
            missing.append(held[0][2])
            continue
        if store.shape(name) != tuple(tensor.shape):
            wrong.append(f"{name}: {store.shape(name)} in the source, {tuple(tensor.shape)} in the model")
        chosen[tensor] = name
    if missing or wrong:
        raise ValueError(
            "attach_weights: the source does not hold the model's weights: "
            + (f"missing {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}" if missing else "")
            + ("; " if missing and wrong else "")
            + (f"shapes differ: {'; '.join(wrong[:4])}" if wrong else "")
            + " (a checkpoint of another model, or names the model does not use; a weight tied to another is tied"
            " before preparing, model.tie_weights() for a Hugging Face model; a buffer no checkpoint holds, such as a"
            " rotary table, is built on the host by accelerate.init_empty_weights(), which leaves buffers there)"
        )
    for tensor, held in slots.items():
        empty = torch.zeros((), dtype=tensor.dtype).expand(tensor.shape)  # the shape, holding one element
        placeholder: Tensor
        if isinstance(tensor, nn.Parameter):
            placeholder = nn.Parameter(empty, requires_grad=tensor.requires_grad)
        else:
            placeholder = empty
        for module, attribute, _ in held:
            kind = "_parameters" if isinstance(tensor, nn.Parameter) else "_buffers"
            getattr(module, kind)[attribute] = placeholder
        store.pending[placeholder] = chosen[tensor]
    _keep_store(model, store)
    return store


def offloaded_weights(model: nn.Module) -> Mapping[str, Tensor]:
    """The weights of ``model``, which accelerate offloaded in part: its loader (parameter name -> tensor, read from
    disk when asked) and the parameters it kept in memory, these now put on ``meta`` too (a capture needs every
    parameter on one device); accelerate's hooks are removed from every module. The source to
    :func:`attach_weights` once ``model`` is prepared."""
    loaders: list[Mapping[str, Tensor]] = []
    for module in model.modules():
        weights_map = getattr(getattr(module, "_hf_hook", None), "weights_map", None)
        loader = getattr(weights_map, "dataset", weights_map)
        if isinstance(loader, Mapping) and all(loader is not seen for seen in loaders):
            loaders.append(loader)
    if not loaders:
        raise ValueError(
            "offloaded_weights: no module of the model has weights accelerate offloaded (load it with "
            "from_pretrained(..., device_map=..., offload_folder=...) and some modules on 'disk' or 'cpu' offload)"
        )
    from accelerate.hooks import remove_hook_from_module

    remove_hook_from_module(model, recurse=True)
    resident: dict[str, Tensor] = {}
    emptied: dict[Tensor, nn.Parameter] = {}  # one empty parameter for a tensor held in two places
    for path, module in model.named_modules(remove_duplicate=False):
        for attribute, parameter in list(module._parameters.items()):
            if parameter is None or parameter.is_meta:
                continue
            resident[f"{path}.{attribute}" if path else attribute] = parameter.detach()
            if parameter not in emptied:
                empty = torch.empty(parameter.shape, dtype=parameter.dtype, device="meta")
                emptied[parameter] = nn.Parameter(empty, requires_grad=parameter.requires_grad)
            module._parameters[attribute] = emptied[parameter]
    return _Chain([resident, *loaders])


class _Chain(Mapping[str, Tensor]):
    """Names looked up in each mapping in turn (the first holding a name gives its tensor)."""

    def __init__(self, maps: Sequence[Mapping[str, Tensor]]) -> None:
        self.maps = list(maps)

    def __getitem__(self, name: str) -> Tensor:
        for found in self.maps:
            if name in found:
                return found[name]
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return iter({name: None for found in self.maps for name in found})

    def __len__(self) -> int:
        return len({name for found in self.maps for name in found})


def _keep_store(model: nn.Module, store: WeightStore | None) -> None:
    """Keep ``store`` on ``model`` (its ``meta`` dict where it has one)."""
    meta = getattr(model, "meta", None)
    if isinstance(meta, dict):
        if store is None:
            meta.pop(LAZY_WEIGHTS, None)
        else:
            meta[LAZY_WEIGHTS] = store
    elif store is None:
        model.__dict__.pop(LAZY_WEIGHTS, None)
    else:
        model.__dict__[LAZY_WEIGHTS] = store


def pending_weights(model: nn.Module) -> list[Tensor]:
    """The placeholders of ``model``'s weights still on disk (none for a model without a store)."""
    store = store_of(model)
    return list(store.pending) if store is not None else []


def store_of(model: nn.Module) -> WeightStore | None:
    """The store :func:`attach_weights` kept on ``model``; None when it has none (or after :func:`materialize`)."""
    meta = getattr(model, "meta", None)
    store = meta.get(LAZY_WEIGHTS) if isinstance(meta, dict) else model.__dict__.get(LAZY_WEIGHTS)
    return store if isinstance(store, WeightStore) and (store.pending or store.loaded or store.mapped) else None


def require_weights(model: nn.Module, what: str) -> None:
    """Refuse ``model`` while weights are still on disk or on ``meta``, saying what to do."""
    store = store_of(model)
    if store is not None and (store.pending or store.loaded):
        raise ValueError(
            f"{what} needs every weight at once, and {len(store.pending)} are still on disk (attach_weights): "
            "load them with mqbench.advanced_ptq.materialize(model) first (the memory of the whole "
            "model), or run only the block-by-block steps (gptq, calibrate) on the model as it is"
        )
    on_meta = [name for name, tensor in model.named_parameters() if tensor.is_meta][:4]
    if on_meta:
        raise ValueError(
            f"{what}: parameters are on the meta device and hold no values ({', '.join(on_meta)}, ...); give them "
            "their weights with mqbench.advanced_ptq.attach_weights(model, checkpoint) first"
        )


def materialize(model: nn.Module) -> nn.Module:
    """Load every weight still on disk into memory (written blocks stay memory-mapped); later passes no longer
    write blocks back. Returns ``model``."""
    store = store_of(model)
    if store is not None:
        store.load(list(store.pending), None)
        store.loaded.clear()
        store.mapped.clear()
    _keep_store(model, None)
    return model
