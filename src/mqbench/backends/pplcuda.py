"""The PPL CUDA backend: all-integer with per-channel asymmetric weights."""

from mqbench.backends.families import CLIPPED, TOTAL_INT
from mqbench.backends.spec import BackendSpec, QuantizerSpec
from mqbench.scheme import QuantScheme

__all__ = ["SPEC"]

SPEC = BackendSpec(
    name="pplcuda",
    weight=QuantizerSpec(QuantScheme(8, symmetric=False, per_channel=True)),
    activation=QuantizerSpec(QuantScheme(8, symmetric=False)),
    placement=TOTAL_INT,
    description="OpenPPL CUDA, all-integer int8",
    deploy=("ppl_json",),
    ptq_recipe=CLIPPED,
)
