"""The Xilinx Vitis AI backend: power-of-two scales on the outputs of every op."""

from mqbench.backends.spec import BackendSpec, Placement, PTQRecipe, QuantizerSpec
from mqbench.scheme import QuantScheme

__all__ = ["SPEC"]

SPEC = BackendSpec(
    name="vitis",
    weight=QuantizerSpec(
        QuantScheme(8, symmetric=True, pot_scale=True), fake_quantize="TqtFakeQuantize", observer="MinMaxFloorObserver"
    ),
    activation=QuantizerSpec(
        QuantScheme(8, symmetric=True, pot_scale=True), fake_quantize="TqtFakeQuantize", observer="PoTModeObserver"
    ),
    placement=Placement(
        outputs_of={"conv", "bn", "relu", "pool", "add", "mul", "concat", "interpolate", "linear", "deconv"},
        passthrough={"relu"},
        network_inputs=True,
        shared_inputs_of={"concat"},
    ),
    description="Xilinx Vitis AI DPU, power-of-two fixed point",
    deploy=("vitis_json",),
    lsb_tolerance=2,  # allowed per-tensor difference on this coarse grid
    ptq_recipe=PTQRecipe(equalize=True, bias_correction=True),
)
