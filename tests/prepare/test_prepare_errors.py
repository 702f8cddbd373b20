"""Bad input to prepare_by_platform: clear errors naming the valid choices."""

import pytest
import torch
from torch import nn

from mqbench.backends import ParamsTable
from mqbench.prepare_by_platform import BackendType, prepare_by_platform


def small():
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).eval()


def test_unknown_backend_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown backend 'tensorrtt'; valid backends: academic, tensorrt"):
        prepare_by_platform(small(), "tensorrtt")
    with pytest.raises(ValueError, match="a backend is named by a BackendType"):
        prepare_by_platform(small(), 3)


def test_backend_names_are_case_insensitive_and_enum_members_work():
    for backend in (BackendType.SNPE, "SNPE", "snpe", ParamsTable["snpe"]):
        prepared = prepare_by_platform(small(), backend)
        assert any(name.endswith("post_act_fake_quantizer") for name, _ in prepared.named_modules())


def test_unknown_config_keys_name_the_valid_ones():
    with pytest.raises(
        ValueError, match=r"unknown prepare_custom_config_dict key 'leaf_modules'; valid keys: .*leaf_module"
    ):
        prepare_by_platform(small(), "tensorrt", {"leaf_modules": []})
    with pytest.raises(ValueError, match=r"unknown extra_qconfig_dict key 'w_bits'; valid keys: w_observer"):
        prepare_by_platform(small(), "tensorrt", {"extra_qconfig_dict": {"w_bits": 4}})
    with pytest.raises(ValueError, match=r"unknown extra_fuse_dict key 'patterns'"):
        prepare_by_platform(small(), "tensorrt", {"extra_fuse_dict": {"patterns": {}}})


@pytest.mark.parametrize(
    ("qscheme", "message"),
    [
        ({"bit": 1, "symmetry": True, "per_channel": False, "pot_scale": False}, "bits must be between 2 and 16"),
        ({"bit": 8, "symmetric": False, "symmetric_range": True}, "symmetric_range needs symmetric"),
        ({"bits": 8, "granularity": "tensor"}, "unknown quantization scheme key 'granularity'; valid keys"),
    ],
)
def test_bad_scheme_values(qscheme, message):
    with pytest.raises(ValueError, match=message):
        prepare_by_platform(small(), "tensorrt", {"extra_qconfig_dict": {"w_qscheme": qscheme}})


def test_unknown_observer_or_quantizer_names():
    with pytest.raises(ValueError, match=r"unknown observer 'MinMaxObservr'; registered: .*MinMaxObserver"):
        prepare_by_platform(small(), "tensorrt", {"extra_qconfig_dict": {"a_observer": "MinMaxObservr"}})
    with pytest.raises(ValueError, match=r"unknown fake quantizer 'LSQ'; registered: .*LearnableFakeQuantize"):
        prepare_by_platform(small(), "tensorrt", {"extra_qconfig_dict": {"w_fakequantize": "LSQ"}})


def test_extra_qconfig_overrides_reach_the_quantizers():
    config = {
        "extra_qconfig_dict": {
            "w_qscheme": {"bit": 4, "symmetry": True, "per_channel": True, "pot_scale": False},
            "a_observer": "MSEObserver",
            "a_observer_extra_args": {"p": 2.4},
            "w_fakeq_params": {"use_grad_scaling": False},
        }
    }
    prepared = prepare_by_platform(small(), "tensorrt", config)
    conv = prepared.get_submodule("0")
    # the keys given replace the backend's; its narrow range (symmetric_range) is kept
    assert (conv.weight_fake_quant.quant_min, conv.weight_fake_quant.quant_max) == (-7, 7)
    assert conv.weight_fake_quant.use_grad_scaling is False
    activation = next(m for n, m in prepared.named_modules() if n.endswith("post_act_fake_quantizer"))
    assert type(activation.activation_post_process).__name__ == "MSEObserver"
    assert activation.activation_post_process.p == 2.4
    # the backend's own spec is left as it was
    assert ParamsTable["tensorrt"].weight.scheme.bits == 8


def test_input_model_is_not_modified():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    prepare_by_platform(model, "vitis")
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert [type(m).__name__ for m in model] == ["Conv2d", "BatchNorm2d", "ReLU"]


def test_register_backend_takes_a_spec_and_refuses_to_overwrite_silently():
    import dataclasses

    from mqbench.backends import register_backend

    with pytest.raises(ValueError, match="register_backend expects a BackendSpec or a BackendConfig, got dict"):
        register_backend("mynpu", {"weight": None})
    with pytest.raises(ValueError, match="backend 'tensorrt' is already registered; pass replace=True"):
        register_backend("tensorrt", dataclasses.replace(ParamsTable["tensorrt"], description="changed"))
    assert ParamsTable["tensorrt"].description == "NVIDIA TensorRT, explicit int8 quantization"
