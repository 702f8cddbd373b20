"""The PPL W8A16 backend: all-integer with 8-bit weights and 16-bit activations."""

from mqbench.backends.families import TOTAL_INT
from mqbench.backends.spec import BackendSpec, PTQRecipe, QuantizerSpec
from mqbench.scheme import QuantScheme

__all__ = ["SPEC"]

SPEC = BackendSpec(
    name="pplw8a16",
    weight=QuantizerSpec(QuantScheme(8, symmetric=False)),
    activation=QuantizerSpec(QuantScheme(16, symmetric=False), observer="EMAMinMaxObserver"),
    placement=TOTAL_INT,
    description="OpenPPL, 8-bit weights and 16-bit activations",
    deploy=("ppl_json",),
    ptq_recipe=PTQRecipe(equalize=True, bias_correction=True),
)
