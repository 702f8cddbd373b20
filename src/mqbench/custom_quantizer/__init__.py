"""Quantizer placement: the rule-driven ModelQuantizer, its extension points and MQBench's per-backend classes."""

from mqbench.custom_quantizer.academic_quantizer import AcademicQuantizer
from mqbench.custom_quantizer.model_quantizer import ModelQuantizer, register_model_quantizer
from mqbench.custom_quantizer.nlp_quantizer import AcademicNLPQuantizer
from mqbench.custom_quantizer.onnx_qnn_quantizer import ONNXQNNQuantizer
from mqbench.custom_quantizer.openvino_quantizer import OPENVINOQuantizer
from mqbench.custom_quantizer.tengine_u8_quantizer import TengineQuantizer
from mqbench.custom_quantizer.tensorrt_quantizer import TensorrtNLPQuantizer, TRTModelQuantizer
from mqbench.custom_quantizer.total_int_quantizer import TotalINTQuantizer
from mqbench.custom_quantizer.vitis_quantizer import VitisQuantizer

__all__ = [
    "AcademicNLPQuantizer",
    "AcademicQuantizer",
    "ModelQuantizer",
    "ONNXQNNQuantizer",
    "OPENVINOQuantizer",
    "TRTModelQuantizer",
    "TengineQuantizer",
    "TensorrtNLPQuantizer",
    "TotalINTQuantizer",
    "VitisQuantizer",
    "register_model_quantizer",
]
