"""Forward hooks that keep a module's inputs or outputs, and stop the forward pass early.

Reconstruction caches what each unit of a model reads and writes; MQBench's scripts use these
names directly.

Example:
    >>> import torch
    >>> from mqbench.utils.hook import DataSaverHook, StopForwardException
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
    >>> saver = DataSaverHook(store_input=True, store_output=True, stop_forward=True)
    >>> handle = model[0].register_forward_hook(saver)
    >>> try:
    ...     model(torch.ones(2, 4))
    ... except StopForwardException:
    ...     pass
    >>> handle.remove()
    >>> saver.input_store[0].shape, saver.output_store.shape
    (torch.Size([2, 4]), torch.Size([2, 3]))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["DataSaverHook", "PerChannelLoadHook", "StopForwardException"]


class StopForwardException(Exception):  # noqa: N818  (MQBench's name)
    """Raised by a hook to end a forward pass once what it needs has been seen."""


class DataSaverHook:
    """A forward hook keeping the module's input tuple (``input_store``) and output (``output_store``).

    With ``stop_forward``, it raises :class:`StopForwardException` after keeping them, so the rest
    of the model does not run.
    """

    def __init__(self, store_input: bool = False, store_output: bool = False, stop_forward: bool = False) -> None:
        self.store_input = store_input
        self.store_output = store_output
        self.stop_forward = stop_forward
        self.input_store: Any = None
        self.output_store: Any = None

    def __call__(self, module: nn.Module, input_batch: Any, output_batch: Any) -> None:
        if self.store_input:
            self.input_store = input_batch
        if self.store_output:
            self.output_store = output_batch
        if self.stop_forward:
            raise StopForwardException


class PerChannelLoadHook:
    """MQBench's state-dict pre-hook: resizes ``hook_param`` of ``module`` to the shapes in the state dict.

    Per-channel parameters are created with one element and take their channel count from the
    first calibration; loading a calibrated state dict into a fresh model needs them resized first.
    This package's quantizers and observers do it themselves; the hook is for user modules.
    """

    def __init__(self, module: nn.Module, hook_param: Sequence[str] = ("scale", "zero_point")) -> None:
        self.hook_param = tuple(hook_param)
        self.handle = module._register_load_state_dict_pre_hook(self, with_module=True)

    def __call__(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        for name in self.hook_param:
            key = prefix + name
            current = getattr(module, name, None)
            if key in state_dict and isinstance(current, torch.Tensor) and current.shape != state_dict[key].shape:
                current.data = current.data.new_empty(state_dict[key].shape)

    def close(self) -> None:
        self.handle.remove()
