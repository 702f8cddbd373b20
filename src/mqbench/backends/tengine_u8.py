"""The Tengine uint8 backend: all-integer plus concat, hardswish, sigmoid and the network outputs."""

from dataclasses import replace

from mqbench.backends.families import PER_TENSOR_WEIGHTS, TOTAL_INT
from mqbench.backends.spec import BackendSpec, QuantizerSpec
from mqbench.scheme import QuantScheme

__all__ = ["SPEC"]

_OPS = TOTAL_INT.inputs_of | {"hardswish", "sigmoid"}

SPEC = BackendSpec(
    name="tengine_u8",
    weight=QuantizerSpec(QuantScheme(8, symmetric=False)),
    activation=QuantizerSpec(QuantScheme(8, symmetric=False), observer="EMAMinMaxObserver"),
    placement=replace(TOTAL_INT, inputs_of=_OPS, outputs_of=_OPS, network_outputs=True),
    description="OPEN AI LAB Tengine, uint8",
    deploy=("tengine_scale",),
    ptq_recipe=PER_TENSOR_WEIGHTS,
)
