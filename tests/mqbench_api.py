"""MQBench's public names (its modules' top-level names and the names its packages export), by module.

``PROVIDED`` is what this package gives under MQBench's module path; ``NOT_PROVIDED`` names each left out
and why. The list was taken from MQBench's sources (its main branch; scripts, forks and experimental
formats left out). tests/compat/test_mqbench_names.py keeps both lists true.
"""

PROVIDED = {
    "mqbench.prepare_by_platform": [
        "BackendType",
        "CustomedTracer",
        "FakeQuantizeDict",
        "ObserverDict",
        "ParamsTable",
        "get_qconfig_by_platform",
        "prepare_by_platform",
    ],
    "mqbench.convert_deploy": [
        "convert_deploy",
        "convert_merge_bn",
        "convert_onnx",
        "convert_onnx_qlinear",
        "deploy_qparams_nnie",
        "deploy_qparams_openvino",
        "deploy_qparams_ppl_cuda",
        "deploy_qparams_pplw8a16",
        "deploy_qparams_snpe",
        "deploy_qparams_tengine",
        "deploy_qparams_tensorrt",
        "deploy_qparams_tvm",
        "deploy_qparams_vitis",
    ],
    "mqbench.scheme": ["QuantizeScheme"],
    "mqbench.observer": [
        "ClipStdObserver",
        "EMAMSEObserver",
        "EMAMinMaxObserver",
        "EMAQuantileObserver",
        "LSQObserver",
        "LSQPlusObserver",
        "MSEObserver",
        "MinMaxFloorObserver",
        "MinMaxObserver",
        "ObserverBase",
        "PoTModeObserver",
    ],
    "mqbench.fuser_method_mappings": [
        "fuse_conv_freezebn",
        "fuse_conv_freezebn_relu",
        "fuse_custom_config_dict",
        "fuse_deconv_bn",
        "fuse_deconv_bn_relu",
        "fuse_deconv_freezebn",
        "fuse_deconv_freezebn_relu",
        "fuse_linear_bn",
    ],
    "mqbench.fusion_method": [
        "convert_nniqat_convbn",
        "convert_nniqat_convbnrelu",
        "convert_qnni_deconvbn",
        "convert_qnni_deconvbnrelu",
        "convert_qnni_linearbn",
        "convert_qnniqat_convbn",
        "convert_qnniqat_convbnrelu",
        "convert_qnniqat_deconvbn",
        "convert_qnniqat_deconvbnrelu",
        "convert_qnniqat_linearbn",
    ],
    "mqbench.advanced_ptq": [
        "CosineTempDecay",
        "LinearTempDecay",
        "LossFunction",
        "USE_DDP",
        "USE_LINK",
        "extract_block",
        "extract_layer",
        "extract_subgraph",
        "find_cur_node",
        "find_num_nodes",
        "find_used_times",
        "get_io_of_block",
        "insert_fake_modules",
        "layer_has_weights",
        "lp_loss",
        "node2modules",
        "prepare_fp_and_quant_model_for_ptq",
        "ptq_reconstruction",
        "qnode2fpnode",
        "save_inp_oup_data",
        "subgraph_reconstruction",
        "tensor_detach",
        "to_device",
    ],
    "mqbench.adaround": [
        "CosineTempDecay",
        "LinearTempDecay",
        "LossFunction",
        "USE_DDP",
        "USE_LINK",
        "adaround",
        "extract_block",
        "extract_layer",
        "extract_subgraph",
        "find_num_nodes",
        "lp_loss",
        "save_inp_oup_data",
        "subgraph_reconstruction",
    ],
    "mqbench.ptq_reconstruction": [
        "CosineTempDecay",
        "LinearTempDecay",
        "LossFunction",
        "USE_DDP",
        "USE_LINK",
        "extract_block",
        "extract_layer",
        "extract_subgraph",
        "find_num_nodes",
        "lp_loss",
        "ptq_reconstruction",
        "save_inp_oup_data",
        "subgraph_reconstruction",
    ],
    "mqbench.convert_onnx": [
        "LinearQuantizer_process",
        "NNIE_process",
        "remove_fakequantize_and_collect_params",
        "remove_fakequantize_and_collect_params_nnie",
    ],
    "mqbench.weight_equalization": [
        "ACT_TYPES",
        "COLLECT_TYPES",
        "FAKE_QUANT_TYPE",
        "POOL_TYPES",
        "dfq_weight_equalization",
        "get_weight_equalization_groups",
        "weight_equalize_conv_pair",
    ],
    "mqbench.custom_quantizer": [
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
    ],
    "mqbench.custom_quantizer.model_quantizer": ["ModelQuantizer"],
    "mqbench.custom_quantizer.academic_quantizer": ["AcademicQuantizer"],
    "mqbench.custom_quantizer.nlp_quantizer": ["AcademicNLPQuantizer"],
    "mqbench.custom_quantizer.onnx_qnn_quantizer": ["ONNXQNNQuantizer"],
    "mqbench.custom_quantizer.openvino_quantizer": ["OPENVINOQuantizer"],
    "mqbench.custom_quantizer.tengine_u8_quantizer": ["TengineQuantizer"],
    "mqbench.custom_quantizer.tensorrt_quantizer": ["TRTModelQuantizer", "TensorrtNLPQuantizer"],
    "mqbench.custom_quantizer.total_int_quantizer": ["TotalINTQuantizer"],
    "mqbench.custom_quantizer.vitis_quantizer": ["VitisQuantizer"],
    "mqbench.deploy": [
        "ONNXQLinearPass",
        "ONNXQNNPass",
        "remove_fakequantize_and_collect_params",
        "remove_fakequantize_and_collect_params_nnie",
        "remove_fakequantize_and_collect_params_stpu",
        "remove_fakequantize_and_collect_params_tengine",
        "replace_fakequantize_and_collect_params_openvino",
    ],
    "mqbench.deploy.deploy_linear": ["LinearQuantizer_process", "remove_fakequantize_and_collect_params"],
    "mqbench.deploy.deploy_nnie": ["NNIE_process", "remove_fakequantize_and_collect_params_nnie"],
    "mqbench.deploy.deploy_onnx_qlinear": ["ONNXQLinearPass"],
    "mqbench.deploy.deploy_onnx_qnn": ["ONNXQNNPass"],
    "mqbench.deploy.deploy_openvino": ["OPENVINO_process", "replace_fakequantize_and_collect_params_openvino"],
    "mqbench.deploy.deploy_stpu": ["STPU_process", "remove_fakequantize_and_collect_params_stpu"],
    "mqbench.deploy.deploy_tengine": ["Tengine_process", "remove_fakequantize_and_collect_params_tengine"],
    "mqbench.deploy.deploy_transformer": ["LinearQuantizer_process", "remove_fakequantize_and_collect_params_tf"],
    "mqbench.fake_quantize": [
        "AdaRoundFakeQuantize",
        "DSQFakeQuantize",
        "DoReFaFakeQuantize",
        "FixedFakeQuantize",
        "LearnableFakeQuantize",
        "NNIEFakeQuantize",
        "PACTFakeQuantize",
        "QDropFakeQuantize",
        "TqtFakeQuantize",
    ],
    "mqbench.fake_quantize.quantize_base": ["QuantizeBase"],
    "mqbench.fake_quantize.lsq": ["LearnableFakeQuantize", "grad_scale"],
    "mqbench.fake_quantize.fixed": ["FixedFakeQuantize"],
    "mqbench.fake_quantize.dorefa": ["DoReFaFakeQuantize"],
    "mqbench.fake_quantize.dsq": ["DSQFakeQuantize"],
    "mqbench.fake_quantize.nnie": ["NNIEFakeQuantize"],
    "mqbench.fake_quantize.pact": ["PACTFakeQuantize"],
    "mqbench.fake_quantize.tqt": ["TqtFakeQuantize"],
    "mqbench.fake_quantize.adaround_quantizer": ["AdaRoundFakeQuantize", "adaround_forward"],
    "mqbench.fake_quantize.qdrop_quantizer": ["QDropFakeQuantize", "round_ste"],
    "mqbench.mix_precision.mix_precision": [
        "ILP_bit_selection",
        "hawq",
        "mixprecision_bit_selection",
        "mixprecision_profiling",
        "mp_model_size",
        "prec_degradation_by_layer",
    ],
    "mqbench.mix_precision.hessian_per_layer": ["hessian_per_layer"],
    "mqbench.nn.intrinsic.modules": [
        "ConvBn2d",
        "ConvBnReLU2d",
        "ConvFreezebn2d",
        "ConvFreezebnReLU2d",
        "ConvReLU2d",
        "ConvTransposeBn2d",
        "ConvTransposeBnReLU2d",
        "ConvTransposeFreezebn2d",
        "ConvTransposeFreezebnReLU2d",
        "ConvTransposeReLU2d",
        "LinearBn1d",
    ],
    "mqbench.nn.intrinsic.modules.fused": [
        "ConvBn2d",
        "ConvBnReLU2d",
        "ConvFreezebn2d",
        "ConvFreezebnReLU2d",
        "ConvReLU2d",
        "ConvTransposeBn2d",
        "ConvTransposeBnReLU2d",
        "ConvTransposeReLU2d",
        "LinearBn1d",
    ],
    "mqbench.nn.intrinsic.qat.modules": [
        "ConvBn2d",
        "ConvBnReLU2d",
        "ConvFreezebn2d",
        "ConvFreezebnReLU2d",
        "ConvReLU2d",
        "ConvTransposeBn2d",
        "ConvTransposeBnReLU2d",
        "ConvTransposeFreezebn2d",
        "ConvTransposeFreezebnReLU2d",
        "ConvTransposeReLU2d",
        "LinearBn1d",
    ],
    "mqbench.nn.intrinsic.qat.modules.freezebn": ["ConvFreezebn2d", "ConvFreezebnReLU2d"],
    "mqbench.nn.intrinsic.qat.modules.linear_fused": ["LinearBn1d"],
    "mqbench.nn.intrinsic.qat.modules.deconv_fused": [
        "ConvTransposeBn2d",
        "ConvTransposeBnReLU2d",
        "ConvTransposeReLU2d",
    ],
    "mqbench.nn.qat.modules": ["Conv2d", "ConvTranspose2d", "Embedding", "Linear"],
    "mqbench.nn.qat.modules.conv": ["Conv2d"],
    "mqbench.nn.qat.modules.deconv": ["ConvTranspose2d"],
    "mqbench.quantization.qconfig_mapping_utils": ["get_flattened_qconfig_dict"],
    "mqbench.utils.registry": [
        "BACKEND_DEPLOY_FUNCTION",
        "DEFAULT_MODEL_QUANTIZER",
        "FUSED_MODULE_CONVERT_FUNCTION",
        "WEIGHT_EQUALIZATION_FUNCTION",
        "register_convert_function",
        "register_deploy_function",
        "register_model_quantizer",
        "register_weight_equalization_function",
    ],
    # MQBench's mqbench/utils/__init__.py is ``from .utils import *``: the helpers are names of the package too
    "mqbench.utils": [
        "USE_DDP",
        "USE_LINK",
        "deepcopy_graphmodule",
        "deepcopy_mixedmodule",
        "get_flattened_qconfig_dict",
        "getitem2node",
        "is_symmetric_quant",
        "is_tracing_state",
        "no_jit_trace",
        "pot_quantization",
        "sync_tensor",
        "topology_order",
    ],
    "mqbench.utils.utils": [
        "USE_DDP",
        "USE_LINK",
        "deepcopy_graphmodule",
        "deepcopy_mixedmodule",
        "get_flattened_qconfig_dict",
        "getitem2node",
        "is_symmetric_quant",
        "is_tracing_state",
        "no_jit_trace",
        "pot_quantization",
        "sync_tensor",
        "topology_order",
    ],
    "mqbench.utils.state": [
        "disable_all",
        "enable_all",
        "enable_calibration",
        "enable_calibration_quantization",
        "enable_calibration_woquantization",
        "enable_quantization",
    ],
    "mqbench.utils.hook": ["DataSaverHook", "PerChannelLoadHook", "StopForwardException"],
    "mqbench.utils.logger": [
        "MQBENCH_LOGGER_NAME",
        "QBENCH_LOGGER_NAME",
        "disable_logging",
        "fmt",
        "logger",
        "set_log_level",
        "stdout_handler",
    ],
    "mqbench.utils.profiling": [
        "QUANT_FUNCTION_TYPE",
        "QUANT_MODULE_TYPE",
        "cosine",
        "node2modules",
        "profile_summary",
        "profiling",
        "to_device",
        "update_model_with_dummy_module",
    ],
}

# Why a name is not provided: each names what replaces it here.
ONNX_PLUMBING = (
    "helpers that edit MQBench's own custom quantization nodes in its exported ONNX; this package's export writes "
    "standard QuantizeLinear/DequantizeLinear pairs and strips them itself (mqbench.deploy.strip); the deploy step "
    "is remove_fakequantize_and_collect_params"
)
CUSTOM_OP_NAMES = (
    "the op-type names of MQBench's custom ONNX quantization nodes, which this package never writes (its Q/DQ "
    "nodes are standard ONNX)"
)
TORCH_AO = (
    "part of torch.ao.quantization's FX machinery (fusion handlers, dtype configs, observed-graph passes), which "
    "this package does not use: prepare_by_platform does these steps (mqbench.backend_config for declarative "
    "dtype configs)"
)
SYMBOLICS = (
    "ONNX symbolic registrations for torch's fake_quantize ops; this package exports its quantizers through "
    "QuantizeBase.export_qparams and standard Q/DQ nodes"
)
AUTOGRAD_INTERNALS = (
    "the autograd functions inside MQBench's fake quantizers (with ONNX symbolics for its custom ops); use the "
    "fake quantizer classes (mqbench.fake_quantize) or mqbench.functional"
)
EQUALIZATION_INTERNALS = (
    "the fan-out count and graph walk of MQBench's equalization; get_weight_equalization_groups gives the pairs and "
    "mqbench.advanced_ptq.cross_layer_equalization equalizes a model (with a registered pair equalizer where one is)"
)
ACTIVATION_HESSIAN = (
    "the activation Hessian of MQBench's experimental profiling; mixed precision here measures weight and "
    "activation sensitivity directly (mqbench.mix_precision.search_mixed_precision)"
)
TYPE_VARIABLE = "a TypeVar of MQBench's type hints, not an API of its modules"
SOPHGO = "modules of the Sophgo TPU backend, which this package does not have"
BIAS_FAKE_QUANT = (
    "MQBench's experimental bias fake quantizer; biases deploy as int32 (scale = input scale x weight scale) in the "
    "formats that quantize them, computed at deploy"
)
FLOAT_FORMATS = "MQBench's floating-point (FP8-style) deploy step, not yet a format here"

NOT_PROVIDED = {
    ("mqbench.prepare_by_platform", "weighted_op_qint8_dtype_config"): TORCH_AO,
    ("mqbench.prepare_by_platform", "duplicate_reused_nodes"): TORCH_AO,
    ("mqbench.prepare_by_platform", "prepare_constant_dict"): TORCH_AO,
    ("mqbench.fuser_method_mappings", "ConvFreezebnReLUFusion"): TORCH_AO,
    **{
        (module, name): ONNX_PLUMBING
        for module in ("mqbench.convert_onnx", "mqbench.deploy.common")
        for name in (
            "update_inp2node_out2node",
            "prepare_data",
            "prepare_initializer",
            "parse_attrs",
            "get_constant_inputs",
            "OnnxPreprocess",
        )
    },
    ("mqbench.deploy.common", "ONNXGraph"): ONNX_PLUMBING,
    ("mqbench.deploy.utils", "ONNXGraph"): ONNX_PLUMBING,
    **{
        ("mqbench.convert_onnx", name): CUSTOM_OP_NAMES
        for name in ("perchannel_fakequantizer", "pertensor_fakequantizer", "all_fakequantizer")
    },
    **{
        (module, name): CUSTOM_OP_NAMES
        for module in (
            "mqbench.deploy.deploy_linear",
            "mqbench.deploy.deploy_openvino",
            "mqbench.deploy.deploy_float",
            "mqbench.deploy.deploy_transformer",
        )
        for name in ("PERCHANNEL_FAKEQUANTIZER", "PERTENSOR_FAKEQUANTIZER", "ALL_FAKEQUANTIZER")
    },
    ("mqbench.deploy.deploy_onnx_qnn", "FAKE_QUANTIZE_OP"): CUSTOM_OP_NAMES,
    ("mqbench.deploy.deploy_float", "FloatQuantizer_process"): FLOAT_FORMATS,
    ("mqbench.deploy.deploy_float", "remove_fakequantize_and_collect_params_flt"): FLOAT_FORMATS,
    ("mqbench.custom_symbolic_opset", "fake_quantize_per_tensor_affine"): SYMBOLICS,
    ("mqbench.custom_symbolic_opset", "fake_quantize_per_channel_affine"): SYMBOLICS,
    **{
        ("mqbench.weight_equalization", name): EQUALIZATION_INTERNALS
        for name in (
            "MATH_TYPE",
            "ALL_OP_TYPE",
            "collect_layer_group",
            "convert_equalization_groups",
        )
    },
    ("mqbench.fake_quantize.lsq", "FakeQuantizeLearnablePerchannelAffine"): AUTOGRAD_INTERNALS,
    **{
        ("mqbench.fake_quantize.dsq", name): AUTOGRAD_INTERNALS
        for name in (
            "dsq_function_per_tensor",
            "dsq_function_per_channel",
            "FakeQuantizeDSQPerchannel",
            "FakeQuantizeDSQPertensor",
        )
    },
    ("mqbench.fake_quantize.nnie", "NNIEQuantizeFunc"): AUTOGRAD_INTERNALS,
    **{
        ("mqbench.fake_quantize.tqt", name): AUTOGRAD_INTERNALS
        for name in ("scale_round", "scale_floor_ceil", "FakeQuantizeTqtAffine")
    },
    **{
        ("mqbench.mix_precision.hessian_per_layer", name): ACTIVATION_HESSIAN
        for name in ("FWDSaverHook", "BWDSaverHook", "hessian_per_layer_acti")
    },
    ("mqbench.nn.intrinsic.qat.modules.freezebn", "MOD"): TYPE_VARIABLE,
    ("mqbench.nn.intrinsic.qat.modules.deconv_fused", "MOD"): TYPE_VARIABLE,
    ("mqbench.nn.qat.modules", "Conv2d_sophgo"): SOPHGO,
    ("mqbench.nn.qat.modules.conv", "Conv2d_sophgo"): SOPHGO,
    ("mqbench.nn.qat.modules.deconv", "ConvTranspose2d_sophgo"): SOPHGO,
    **{
        ("mqbench.quantization.default_bias_fake_quant", name): BIAS_FAKE_QUANT
        for name in ("bias_fakeq_param", "bias_qscheme", "b_fakequantize", "b_qconfig", "bias_fake_quantizer")
    },
}

# Names that keep MQBench's name but raise, naming what replaces them (they cannot keep MQBench's meaning here).
RAISING = {
    ("mqbench.advanced_ptq", name)
    for name in (
        "extract_layer",
        "extract_block",
        "extract_subgraph",
        "find_num_nodes",
        "get_io_of_block",
        "find_used_times",
        "find_cur_node",
        "insert_fake_modules",
        "prepare_fp_and_quant_model_for_ptq",
    )
} | {
    (module, name)
    for module in ("mqbench.adaround", "mqbench.ptq_reconstruction")
    for name in ("extract_layer", "extract_block", "extract_subgraph", "find_num_nodes")
}
