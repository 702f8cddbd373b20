"""Models whose forward takes a dict (a detector's ``forward(self, batch)``) deploy and verify: every form of
``dummy_input`` convert_deploy accepts for them, the ONNX inputs named after the dict's keys, the written ONNX
file on onnxruntime against the prepared model, and a clear error for each form that cannot work."""

from __future__ import annotations

import inspect
import os

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from backend_configs import host_config
from mqbench.convert_deploy import convert_deploy
from mqbench.deploy.onnx_graph import ort_session
from mqbench.deploy.verify import verify_deploy
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.state import enable_calibration, enable_quantization

BACKENDS = ["tensorrt", "openvino", "snpe"]


class DictDetector(nn.Module):
    """conv + BN + ReLU on ``batch["image"]``, scaled per channel by ``batch["scale"]``; two heads."""

    def __init__(self, keys: tuple[str, str] = ("image", "scale"), as_dict: bool = True) -> None:
        super().__init__()
        self.keys = keys
        self.as_dict = as_dict
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.cls = nn.Conv2d(8, 4, 1)
        self.box = nn.Conv2d(8, 2, 1)
        with torch.no_grad():  # running statistics that fold into the conv as a real change of its weights
            self.stem[1].running_mean.uniform_(-0.5, 0.5)
            self.stem[1].running_var.uniform_(0.5, 2.0)

    def forward(self, batch):
        features = self.stem(batch[self.keys[0]]) * batch[self.keys[1]]
        if self.as_dict:
            return {"cls": self.cls(features), "box": self.box(features)}
        return self.cls(features), self.box(features)


class NestedDetector(DictDetector):
    """The scale one level down: ``batch["meta"]["scale"]``; the heads as a tuple holding a list."""

    def forward(self, batch):
        features = self.stem(batch["image"]) * batch["meta"]["scale"]
        return self.cls(features), [self.box(features)]


def batch(seed: int, keys: tuple[str, str] = ("image", "scale")) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    image = torch.randn(1, 3, 16, 16, generator=generator)
    return {keys[0]: image, keys[1]: torch.rand(1, 8, 1, 1, generator=generator) + 0.5}


def nested(seed: int) -> dict:
    flat = batch(seed)
    return {"image": flat["image"], "meta": {"scale": flat["scale"]}}


def calibrated(model: nn.Module, backend: str, batches, config: dict | None = None) -> nn.Module:
    """Prepared (with the settings under which this host's runtime serves the backend's arithmetic, where one
    serves it: the host verdict then counts), calibrated, quantizing."""
    torch.manual_seed(0)
    qmodel = prepare_by_platform(model.eval(), backend, {**(host_config(backend) or {}), **(config or {})})
    enable_calibration(qmodel)
    with torch.no_grad():
        for inputs in batches:
            qmodel(inputs)
    enable_quantization(qmodel)
    return qmodel


@pytest.fixture(scope="module", params=BACKENDS)
def detector(request):
    torch.manual_seed(0)
    return request.param, calibrated(DictDetector(), request.param, [batch(seed) for seed in range(3)])


def onnx_input_names(result) -> list[str]:
    return [value.name for value in onnx.load(result.artifacts["onnx"]).graph.input]


def outputs_of(value) -> list[np.ndarray]:
    """The model's output tensors in the order the deployment returns them (dict values, tuples, lists)."""
    leaves = torch.utils._pytree.tree_leaves(value)
    return [leaf.detach().numpy() for leaf in leaves]


def assert_onnx_matches_the_prepared_model(qmodel, result, inputs, feeds) -> None:
    """The written Q/DQ file on onnxruntime (graph optimizations off: the Q/DQ pairs run as written, not as the
    CPU's int8 kernels) against the prepared model's own output on the same inputs."""
    session = ort_session(result.artifacts["onnx"], optimize=False)
    got = session.run(result.output_names, {name: tensor.numpy() for name, tensor in feeds.items()})
    with torch.no_grad():
        expected = outputs_of(qmodel.eval()(inputs))
    assert len(got) == len(expected)
    scales = {out: entry.scale for entry in result.table.values() for out in entry.extra.get("outputs", ())}
    for name, runtime, simulated in zip(result.output_names, got, expected, strict=True):
        diff = float(np.abs(runtime - simulated).max())
        if name in scales:  # a quantized output: both sit on its grid, at most a rounding apart
            assert diff <= 1.5 * float(np.max(scales[name])), name
        else:
            # A float output (a head's conv): both sides compute the same float32 products of the same quantized
            # inputs and weights and differ only in summation order, a few ulps of the largest value; a tensor
            # quantized on another side of a rounding step would differ by a whole step of its grid (1/255 of
            # its range), far above this bound.
            assert diff <= 1e-5 * max(1.0, float(np.abs(simulated).max())), name


# -- the forms of dummy_input -----------------------------------------------------------------------
FORMS = {
    "dict": lambda inputs: inputs,  # the dict the model is called with
    "tuple": lambda inputs: (inputs,),  # a one-element tuple of it
    "args_kwargs": lambda inputs: (inputs, {}),  # torch.onnx.export's (args, kwargs)
}


@pytest.mark.parametrize("form", list(FORMS))
def test_every_form_deploys_with_inputs_named_after_the_keys_and_verifies(detector, form, tmp_path):
    backend, qmodel = detector
    result = convert_deploy(qmodel, backend, dummy_input=FORMS[form](batch(5)), output_path=tmp_path)
    assert result.input_names == ["image", "scale"]
    assert onnx_input_names(result) == ["image", "scale"]
    inputs = batch(7)
    for given in (inputs, (inputs,), (inputs, {}), {"scale": inputs["scale"], "image": inputs["image"]}):
        report = verify_deploy(qmodel, result, given)
        assert report.passed, report.failures()
    assert_onnx_matches_the_prepared_model(qmodel, result, inputs, inputs)


def test_a_dict_argument_keeps_its_keys_after_positional_and_keyword_inputs(tmp_path):
    """(positional tensor, {keyword: tensor}) for the prepared model's forward, which takes the keys as arguments."""
    torch.manual_seed(0)
    qmodel = calibrated(DictDetector(as_dict=False), "tensorrt", [batch(seed) for seed in range(3)])
    assert list(inspect.signature(qmodel.forward).parameters) == ["image", "scale"]
    inputs = batch(5)
    result = convert_deploy(
        qmodel, "tensorrt", dummy_input=(inputs["image"], {"scale": inputs["scale"]}), output_path=tmp_path
    )
    assert onnx_input_names(result) == ["image", "scale"]
    assert verify_deploy(qmodel, result, batch(6)).passed


def test_nested_dicts_flatten_in_order_and_verify_by_onnx_name(tmp_path):
    torch.manual_seed(0)
    qmodel = calibrated(NestedDetector(), "tensorrt", [nested(seed) for seed in range(3)])
    result = convert_deploy(qmodel, "tensorrt", dummy_input=(nested(5), {}), output_path=tmp_path)
    assert result.input_names == ["image", "scale"]
    assert onnx_input_names(result) == ["image", "scale"]
    inputs = nested(8)
    by_name = {"image": inputs["image"], "scale": inputs["meta"]["scale"]}
    for given in (inputs, (inputs,), by_name):
        report = verify_deploy(qmodel, result, given)
        assert report.passed, report.failures()
    assert_onnx_matches_the_prepared_model(qmodel, result, inputs, by_name)


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_dict_the_forward_reads_whole_is_its_one_argument(capture, tmp_path):
    """Keys that cannot be argument names keep the forward as ``forward(batch)``: the dict is batch's value."""
    keys = ("rgb-image", "scale")
    torch.manual_seed(0)
    config = {"capture": capture} if capture == "fx" else {"capture": capture, "example_inputs": (batch(0, keys),)}
    qmodel = calibrated(DictDetector(keys), "openvino", [batch(seed, keys) for seed in range(3)], config)
    assert list(inspect.signature(qmodel.forward).parameters) == ["batch"]
    for number, form in enumerate((batch(5, keys), (batch(5, keys),), (batch(5, keys), {}), {"batch": batch(5, keys)})):
        result = convert_deploy(qmodel, "openvino", dummy_input=form, output_path=tmp_path / str(number))
        assert onnx_input_names(result) == ["rgb-image", "scale"]
    inputs = batch(9, keys)
    for given in (inputs, (inputs, {}), {"batch": inputs}):
        report = verify_deploy(qmodel, result, given)
        assert report.passed, report.failures()
    assert_onnx_matches_the_prepared_model(qmodel, result, inputs, inputs)


def test_a_dict_for_a_forward_reading_a_tensor_still_names_the_input(tmp_path):
    """A dict whose key is not a parameter of a forward that reads its argument as a tensor: name -> tensor."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    qmodel = calibrated(model, "tensorrt", [torch.randn(1, 3, 8, 8) for _ in range(2)])
    result = convert_deploy(qmodel, "tensorrt", dummy_input={"pixels": torch.randn(1, 3, 8, 8)}, output_path=tmp_path)
    assert onnx_input_names(result) == ["pixels"]
    assert verify_deploy(qmodel, result, {"pixels": torch.randn(1, 3, 8, 8)}).passed


def test_the_export_captured_detector_deploys_and_verifies(tmp_path):
    torch.manual_seed(0)
    config = {"capture": "export", "example_inputs": (batch(0),)}
    qmodel = calibrated(DictDetector(), "tensorrt", [batch(seed) for seed in range(3)], config)
    assert list(inspect.signature(qmodel.forward).parameters) == ["image", "scale"]
    for number, form in enumerate((batch(5), (batch(5), {}))):
        result = convert_deploy(qmodel, "tensorrt", dummy_input=form, output_path=tmp_path / str(number))
        assert onnx_input_names(result) == ["image", "scale"]
        inputs = batch(6)
        for given in (inputs, (inputs,), (inputs, {})):
            report = verify_deploy(qmodel, result, given)
            assert report.passed, report.failures()
        assert_onnx_matches_the_prepared_model(qmodel, result, inputs, inputs)


# -- forms that cannot work ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trt_detector():
    torch.manual_seed(0)
    return calibrated(DictDetector(), "tensorrt", [batch(seed) for seed in range(3)])


def refused(qmodel, dummy_input, folder, error=ValueError, match=""):
    target = folder / "out"
    with pytest.raises(error, match=match):
        convert_deploy(qmodel, "tensorrt", dummy_input=dummy_input, output_path=target)
    assert not target.exists()  # nothing written, no folder left behind


def test_a_dict_value_that_is_not_a_tensor_is_named(trt_detector, tmp_path):
    inputs = batch(0)
    refused(trt_detector, {"image": inputs["image"], "scale": 0.5}, tmp_path, match=r"scale is a float, not a tensor")
    refused(
        trt_detector,
        ({"image": inputs["image"], "scale": [1.0, 2.0]}, {}),
        tmp_path,
        match=r"image\['scale'\]\[0\] is a float, not a tensor.*Give it as a tensor",
    )


def test_keys_the_model_does_not_read_are_named_with_the_keys_it_reads(trt_detector, tmp_path):
    inputs = batch(0)
    renamed = {"img": inputs["image"], "s": inputs["scale"]}
    refused(trt_detector, renamed, tmp_path, match=r"keys \['img', 's'\] match none.*reads the keys \['image', 'sc")
    refused(trt_detector, (renamed,), tmp_path, match=r"keys \['img', 's'\] match none")
    extra = {**inputs, "mask": torch.ones(1, 1, 16, 16)}
    refused(trt_detector, extra, tmp_path, match=r"\['mask'\] are not parameters.*\['image', 'scale'\]")
    refused(trt_detector, (extra, {}), tmp_path, match=r"keys \['mask'\] that the model does not read")


def test_a_structure_the_model_cannot_take_says_how_to_call_it(trt_detector, tmp_path):
    inputs = batch(0)
    refused(
        trt_detector,
        ([inputs["image"], inputs["scale"]], {}),
        tmp_path,
        RuntimeError,
        r"does not run on inputs \(\[\[1, 3, 16, 16\], \[1, 8, 1, 1\]\],\).*forward\(image, scale=None\) takes it",
    )


def test_forms_that_are_no_inputs_are_refused(trt_detector, tmp_path):
    refused(trt_detector, {}, tmp_path, match=r"dummy_input is an empty dict; it must be a tensor, a tuple")
    refused(trt_detector, ({}, {}), tmp_path, match=r"dummy_input holds no tensor")
    refused(trt_detector, {0: torch.zeros(1)}, tmp_path, match=r"a dict's keys must be strings.*got \[0\]")
    refused(trt_detector, np.zeros((1, 3, 16, 16)), tmp_path, match=r"dummy_input must be a tensor.*got ndarray")


def test_verify_names_inputs_that_do_not_fit_the_deployment(trt_detector, tmp_path):
    result = convert_deploy(trt_detector, "tensorrt", dummy_input=batch(5), output_path=tmp_path)
    inputs = batch(6)
    with pytest.raises(ValueError, match=r"match none.*The deployment has inputs \['image', 'scale'\]"):
        verify_deploy(trt_detector, result, {"img": inputs["image"], "s": inputs["scale"]})
    with pytest.raises(ValueError, match=r"the deployment has inputs \['image', 'scale'\]; got 1 input tensor"):
        verify_deploy(trt_detector, result, inputs["image"])
    assert os.path.isfile(result.artifacts["onnx"])
