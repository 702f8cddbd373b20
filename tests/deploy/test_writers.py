"""Parameter-file writers and readers: formats checked by formula, round trips, and deployments run in onnxruntime."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from types import MappingProxyType

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from backend_configs import ACADEMIC_8BIT
from mqbench.backends import ParamsTable, resolve_backend
from mqbench.convert_deploy import DeployContext, convert_deploy
from mqbench.deploy.onnx_graph import ort_session
from mqbench.deploy.qdq import insert_qdq
from mqbench.deploy.table import QParamTable, TensorQParams
from mqbench.deploy.writers import FORMATS, READERS, WRITERS
from mqbench.models import DigitsCNN
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.state import enable_calibration, enable_quantization

KEYS = ("clip_ranges", "calib_cache", "encodings", "ppl_json", "nnie_json", "vitis_json", "tengine_scale", "stpu_json")
WEIGHTS = {"w_conv": (0, 4), "w_deconv": (1, 3), "w_fc": (None, 1)}  # name -> (axis, channels)


# -- a small float model and tables shaped like each backend's ------------------------------------------------
def toy_model() -> onnx.ModelProto:
    """x -> Conv -> Relu -> ConvTranspose -> Flatten -> Gemm -> output (weights of three kinds of op)."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.standard_normal((4, 2, 3, 3)).astype(np.float32), "w_conv"),
        numpy_helper.from_array(rng.standard_normal((4, 3, 2, 2)).astype(np.float32), "w_deconv"),
        numpy_helper.from_array(rng.standard_normal((5, 192)).astype(np.float32), "w_fc"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w_conv"], ["conv"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["conv"], ["relu"], name="relu"),
        helper.make_node("ConvTranspose", ["relu", "w_deconv"], ["deconv"], name="deconv", strides=[2, 2]),
        helper.make_node("Flatten", ["deconv"], ["flat"], name="flatten"),
        helper.make_node("Gemm", ["flat", "w_fc"], ["output"], name="fc", transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "toy",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 4, 4])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, 5])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return onnx.shape_inference.infer_shapes(model)


def log_entry(rng: np.random.Generator, kind: str) -> TensorQParams:
    data_max = float(np.float32(rng.uniform(0.05, 5.0)))
    z = round(16 * np.log2(np.float64(np.float32(data_max)))) - 127
    scale = np.float32(2.0 ** (z / 16))
    return TensorQParams(np.array([scale]), np.array([0]), -128, 127, kind=kind, grid="log", data_max=data_max)


def linear_entry(
    rng: np.random.Generator, kind: str, qrange: tuple[int, int], symmetric: bool, channels: int, axis, pot=False
) -> TensorQParams:
    count = channels if axis is not None else 1
    scale = 2.0 ** -rng.integers(2, 12, count).astype(np.float64) if pot else rng.uniform(1e-4, 0.5, count)
    zero_point = np.zeros(count, np.int64) if symmetric else rng.integers(qrange[0], qrange[1] + 1, count)
    return TensorQParams(scale.astype(np.float32), zero_point, *qrange, axis=axis, kind=kind)


def toy_table(backend: str, seed: int = 0, per_channel: bool = True) -> QParamTable:
    """Entries for every quantizable tensor of the toy model, on the backend's grids (the output included)."""
    rng = np.random.default_rng(seed)
    spec = ParamsTable[backend]
    entries = {}
    for tensor in ("x", "w_conv", "relu", "w_deconv", "flat", "w_fc", "output"):
        kind = "weight" if tensor in WEIGHTS else "activation"
        axis, channels = WEIGHTS.get(tensor, (None, 1))
        axis = axis if per_channel else None
        if backend == "nnie" or (backend == "academic" and tensor == "flat"):  # academic: any quantizer
            entries[tensor] = log_entry(rng, kind)
            continue
        if spec.weight is None:  # academic: asymmetric activations, symmetric per-channel weights, some 4-bit
            scheme_range = (-128, 127) if kind == "weight" else ((0, 15) if tensor == "relu" else (0, 255))
            symmetric = kind == "weight"
        else:
            scheme = spec.weight.scheme if kind == "weight" else spec.activation.scheme
            scheme_range, symmetric = scheme.quant_range, scheme.symmetric
        pot = backend == "vitis"
        entries[tensor] = linear_entry(rng, kind, scheme_range, symmetric, channels, axis, pot)
    return QParamTable(entries)


def context_for(backend: str, table: QParamTable, folder: Path) -> DeployContext:
    model = toy_model()
    qdq, _ = insert_qdq(model, table)
    return DeployContext(ParamsTable[backend], "toy", folder, model, qdq, table, ["x"], ["output"])


def assert_same_entry(got: TensorQParams, want: TensorQParams, exact_scale: bool = True) -> None:
    assert got.kind == want.kind
    assert got.grid == want.grid
    assert (got.quant_min, got.quant_max, got.axis) == (want.quant_min, want.quant_max, want.axis)
    assert np.array_equal(got.zero_point, want.zero_point)
    if exact_scale:
        assert np.array_equal(got.scale.view(np.uint32), want.scale.view(np.uint32))
    else:  # within one float32 ulp
        assert np.all(np.abs(got.scale.astype(np.float64) - want.scale) <= np.spacing(want.scale))
    if want.grid == "log":
        assert np.float32(got.data_max) == np.float32(want.data_max)


ROUND_TRIPS = [
    ("academic", "clip_ranges"),
    ("academic_nlp", "clip_ranges"),
    ("snpe", "encodings"),
    ("pplw8a16", "ppl_json"),
    ("pplcuda", "ppl_json"),
    ("nnie", "nnie_json"),
    ("vitis", "vitis_json"),
    ("tengine_u8", "tengine_scale"),
    ("stpu", "stpu_json"),
]


@pytest.mark.parametrize(("backend", "key"), ROUND_TRIPS, ids=[f"{b}-{k}" for b, k in ROUND_TRIPS])
@pytest.mark.parametrize("per_channel", [True, False], ids=["per_channel", "per_tensor"])
def test_round_trip_is_exact(tmp_path, backend, key, per_channel):
    table = toy_table(backend, per_channel=per_channel)
    context = context_for(backend, table, tmp_path)
    path = WRITERS[key](context)
    assert Path(path).parent == tmp_path and Path(path).name.startswith("toy_")
    assert list(tmp_path.iterdir()) == [Path(path)]
    read = READERS[key](path, ParamsTable[backend], context.float_model)
    assert set(read) == set(table)
    for tensor, entry in table.items():
        assert_same_entry(read[tensor], entry)


@pytest.mark.parametrize("seed", range(5))
def test_clip_ranges_round_trip_tensorrt_within_one_ulp(tmp_path, seed):
    """TensorRT reads amax = float32(127 * scale) back as float32(amax / 127): at most one float32 ulp away."""
    table = toy_table("tensorrt", seed)
    context = context_for("tensorrt", table, tmp_path)
    path = WRITERS["clip_ranges"](context)
    read = READERS["clip_ranges"](path, ParamsTable["tensorrt"], context.float_model)
    assert set(read) == set(table)
    for tensor, entry in table.items():
        assert_same_entry(read[tensor], entry, exact_scale=False)
        amax = (entry.scale.astype(np.float64) * 127).astype(np.float32)
        assert np.array_equal(read[tensor].scale, (amax.astype(np.float64) / 127).astype(np.float32))


def test_clip_ranges_loses_a_scale_ulp_sometimes():
    """The documented loss is real and bounded: some float32 scales do not survive amax = 127 * scale."""
    scales = np.random.default_rng(1).uniform(1e-4, 1.0, 20000).astype(np.float32)
    back = ((scales.astype(np.float64) * 127).astype(np.float32).astype(np.float64) / 127).astype(np.float32)
    moved = np.abs(back.view(np.int32) - scales.view(np.int32))
    assert moved.max() == 1 and 0 < np.count_nonzero(moved) < 0.02 * scales.size


def test_calib_cache_round_trip_holds_activations_only(tmp_path):
    table = toy_table("tensorrt")
    context = context_for("tensorrt", table, tmp_path)
    path = WRITERS["calib_cache"](context)
    read = READERS["calib_cache"](path, ParamsTable["tensorrt"], context.float_model)
    assert set(read) == set(table.activations())
    for tensor in read:
        assert_same_entry(read[tensor], table[tensor])


# -- the formats, checked against their definitions ---------------------------------------------------------
def test_clip_ranges_layout(tmp_path):
    table = toy_table("tensorrt")
    data = json.loads(WRITERS["clip_ranges"](context_for("tensorrt", table, tmp_path)).read_text())
    ranges = data["tensorrt"]["blob_range"]
    assert set(ranges) == set(table) == set(data["qparams"])
    for tensor, entry in table.items():
        amax = [float(np.float32(127 * np.float64(s))) for s in entry.scale]  # symmetric [-127, 127]
        assert ranges[tensor] == (amax if entry.per_channel else amax[0])
        want = {k: v for k, v in entry.to_dict().items() if k != "consumers"}
        assert data["qparams"][tensor] == want


def test_clip_ranges_asymmetric_amax_is_the_larger_bound(tmp_path):
    entry = TensorQParams(np.array([0.1], np.float32), np.array([200]), 0, 255)
    table = QParamTable({"x": entry})
    data = json.loads(WRITERS["clip_ranges"](context_for("academic", table, tmp_path)).read_text())
    assert data["tensorrt"]["blob_range"]["x"] == float(np.float32(200 * np.float64(np.float32(0.1))))


def test_calib_cache_layout(tmp_path):
    entry = TensorQParams(np.array([0.5], np.float32), np.array([0]), -127, 127)
    other = TensorQParams(np.array([0.0123], np.float32), np.array([0]), -127, 127)
    weight = TensorQParams(np.array([0.25, 0.125], np.float32), np.array([0, 0]), -127, 127, axis=0, kind="weight")
    table = QParamTable({"x": entry, "relu": other, "w_conv": weight})
    lines = WRITERS["calib_cache"](context_for("tensorrt", table, tmp_path)).read_text().splitlines()
    assert re.fullmatch(r"TRT-\d+-\w+", lines[0])
    assert lines[1:] == [
        f"x: {struct.pack('>f', 0.5).hex()}",
        f"relu: {struct.pack('>f', np.float32(0.0123)).hex()}",
    ]
    assert lines[1] == "x: 3f000000"


@pytest.mark.parametrize(
    "entry",
    [
        TensorQParams(np.array([0.5], np.float32), np.array([3]), -128, 127),
        TensorQParams(np.array([0.5], np.float32), np.array([0]), 0, 255),
        log_entry(np.random.default_rng(0), "activation"),
    ],
    ids=["zero_point", "unsigned", "log"],
)
def test_calib_cache_refuses_what_tensorrt_cannot_hold(tmp_path, entry):
    with pytest.raises(ValueError, match="'x'"):
        WRITERS["calib_cache"](context_for("tensorrt", QParamTable({"x": entry}), tmp_path))


def test_snpe_encodings_by_formula(tmp_path):
    uint8 = TensorQParams(np.array([0.02], np.float32), np.array([115]), 0, 255)
    int8 = TensorQParams(np.array([0.25], np.float32), np.array([0]), -128, 127, kind="weight")
    table = QParamTable({"x": uint8, "w_fc": int8})
    data = json.loads(WRITERS["encodings"](context_for("snpe", table, tmp_path)).read_text())
    s = float(np.float32(0.02))
    assert data["activation_encodings"]["x"] == [
        {
            "bitwidth": 8,
            "min": float(np.float32(-115 * s)),
            "max": float(np.float32((255 - 115) * s)),
            "scale": s,
            "offset": -115,
            "is_symmetric": "False",
            "dtype": "int",
        }
    ]
    assert data["param_encodings"]["w_fc"] == [
        {
            "bitwidth": 8,
            "min": -32.0,
            "max": 31.75,
            "scale": 0.25,
            "offset": -128,
            "is_symmetric": "True",
            "dtype": "int",
        }
    ]
    # SNPE's reading of an unsigned code q: (q + offset) * scale covers exactly the table's levels.
    for entry, encoding in ((uint8, data["activation_encodings"]["x"][0]), (int8, data["param_encodings"]["w_fc"][0])):
        codes = np.arange(256)
        snpe_levels = (codes + encoding["offset"]) * np.float64(encoding["scale"])
        table_levels = (np.arange(entry.quant_min, entry.quant_max + 1) - entry.zero_point[0]) * np.float64(
            entry.scale[0]
        )
        assert np.array_equal(snpe_levels, table_levels)


def test_snpe_narrow_range_reads_back_as_full_range(tmp_path):
    """[-127, 127] cannot be expressed: the reader returns [-128, 127] with the same scale and zero point."""
    narrow = TensorQParams(np.array([0.1], np.float32), np.array([0]), -127, 127)
    context = context_for("snpe", QParamTable({"x": narrow}), tmp_path)
    read = READERS["encodings"](WRITERS["encodings"](context), ParamsTable["snpe"], context.float_model)
    assert (read["x"].quant_min, read["x"].quant_max) == (-128, 127)
    assert read["x"].scale[0] == narrow.scale[0] and read["x"].zero_point[0] == 0


def test_snpe_signed_grid_with_zero_point_reads_back_as_the_same_levels(tmp_path):
    signed = TensorQParams(np.array([0.1], np.float32), np.array([5]), -128, 127)
    context = context_for("snpe", QParamTable({"x": signed}), tmp_path)
    got = READERS["encodings"](WRITERS["encodings"](context), ParamsTable["snpe"], context.float_model)["x"]
    assert (got.quant_min, got.quant_max, int(got.zero_point[0])) == (0, 255, 133)
    levels = lambda e: (np.arange(e.quant_min, e.quant_max + 1) - int(e.zero_point[0])) * np.float64(e.scale[0])  # noqa: E731
    assert np.array_equal(levels(got), levels(signed))


def test_ppl_layout(tmp_path):
    table = toy_table("pplcuda")
    data = json.loads(WRITERS["ppl_json"](context_for("pplcuda", table, tmp_path)).read_text())
    assert list(data) == ["ppl"] and list(data["ppl"]) == list(table)
    weight = data["ppl"]["w_deconv"]
    entry = table["w_deconv"]
    assert weight["type"] == "biased" and weight["kind"] == "weight" and weight["axis"] == 1 and weight["bit"] == 8
    assert weight["step"] == [float(s) for s in entry.scale]
    assert weight["zero_point"] == entry.zero_point.tolist()
    assert weight["min"] == [
        float(np.float32((0 - z) * np.float64(s))) for s, z in zip(entry.scale, entry.zero_point, strict=True)
    ]
    assert weight["max"] == [
        float(np.float32((255 - z) * np.float64(s))) for s, z in zip(entry.scale, entry.zero_point, strict=True)
    ]
    x = data["ppl"]["x"]
    assert x["type"] == "biased" and x["kind"] == "activation" and "axis" not in x
    assert x["zero_point"] == int(table["x"].zero_point[0]) and x["step"] == float(table["x"].scale[0])


def test_ppl_sixteen_bit_range(tmp_path):
    entry = TensorQParams(np.array([3.05e-6], np.float32), np.array([29459]), 0, 65535)
    context = context_for("pplw8a16", QParamTable({"x": entry}), tmp_path)
    data = json.loads(WRITERS["ppl_json"](context).read_text())
    assert data["ppl"]["x"]["bit"] == 16
    read = READERS["ppl_json"](context.path("_clip_ranges.json"), ParamsTable["pplw8a16"], context.float_model)
    assert_same_entry(read["x"], entry)


def test_nnie_layout_and_scale(tmp_path):
    table = toy_table("nnie")
    context = context_for("nnie", table, tmp_path)
    data = json.loads(WRITERS["nnie_json"](context).read_text())
    params = data["nnie"]["gfpq_param_dict"]
    assert params == {tensor: entry.data_max for tensor, entry in table.items()}
    read = READERS["nnie_json"](context.path("_gfpq_param_dict.json"), ParamsTable["nnie"], context.float_model)
    for tensor, value in params.items():
        z = round(16 * np.log2(np.float64(np.float32(value)))) - 127
        assert read[tensor].scale[0] == np.float32(2.0 ** (z / 16))
        assert read[tensor].grid == "log" and read[tensor].data_max == value


def test_nnie_refuses_linear_entries(tmp_path):
    table = QParamTable({"x": TensorQParams(np.array([0.1]), np.array([0]), -128, 127)})
    with pytest.raises(ValueError, match="'x'"):
        WRITERS["nnie_json"](context_for("nnie", table, tmp_path))


@pytest.mark.parametrize(
    ("backend", "key", "extra"),
    [("pplcuda", "ppl_json", ("kind", "axis")), ("vitis", "vitis_json", ("kind", "bit_width", "fix_position"))],
)
def test_files_without_the_added_keys_read_as_mqbench_writes_them(tmp_path, backend, key, extra):
    """With only MQBench's keys per tensor, kind and channel axis come from the float model, the rest as written."""
    table = toy_table(backend)
    context = context_for(backend, table, tmp_path)
    path = WRITERS[key](context)
    data = json.loads(path.read_text())
    (section,) = data.values()
    for values in section.values():
        for name in extra:
            values.pop(name, None)
    path.write_text(json.dumps(data))
    read = READERS[key](path, ParamsTable[backend], context.float_model)
    assert list(read) == list(table)
    for tensor, entry in table.items():
        assert_same_entry(read[tensor], entry)


def test_vitis_fix_positions(tmp_path):
    table = QParamTable(
        {
            "x": TensorQParams(np.array([2.0**-5]), np.array([0]), -128, 127),
            "w_deconv": TensorQParams(
                np.array([2.0**-7, 2.0**-6, 2.0**3]), np.zeros(3), -128, 127, axis=1, kind="weight"
            ),
        }
    )
    data = json.loads(WRITERS["vitis_json"](context_for("vitis", table, tmp_path)).read_text())
    assert data == {
        "vitis": {
            "x": {"scale": 2.0**-5, "bit_width": 8, "fix_position": 5, "kind": "activation"},
            "w_deconv": {
                "scale": [2.0**-7, 2.0**-6, 2.0**3],
                "bit_width": 8,
                "fix_position": [7, 6, -3],
                "kind": "weight",
            },
        }
    }


@pytest.mark.parametrize(
    "entry",
    [
        TensorQParams(np.array([0.3]), np.array([0]), -128, 127),
        TensorQParams(np.array([2.0**-5, 0.2]), np.array([0, 0]), -128, 127, axis=0, kind="weight"),
        TensorQParams(np.array([2.0**-5]), np.array([3]), -128, 127),
        TensorQParams(np.array([2.0**-5]), np.array([0]), -127, 127),
    ],
    ids=["not_pot", "channel_not_pot", "zero_point", "narrow"],
)
def test_vitis_refuses_what_fixed_point_cannot_hold(tmp_path, entry):
    table = QParamTable({"w_conv" if entry.kind == "weight" else "relu": entry})
    with pytest.raises(ValueError, match=r"'w_conv'|'relu'"):
        WRITERS["vitis_json"](context_for("vitis", table, tmp_path))


def test_tengine_layout(tmp_path):
    table = toy_table("tengine_u8")
    lines = WRITERS["tengine_scale"](context_for("tengine_u8", table, tmp_path)).read_text().splitlines()
    want = []
    for tensor, entry in table.items():
        want += [f"{tensor} {float(s)!r} {int(z)}" for s, z in zip(entry.scale, entry.zero_point, strict=True)]
    assert lines == want
    assert sum(line.startswith("w_conv ") for line in lines) == 4  # one line per output channel


def test_tengine_refuses_a_range_the_file_cannot_say(tmp_path):
    table = QParamTable({"x": TensorQParams(np.array([0.1]), np.array([0]), -128, 127)})
    with pytest.raises(ValueError, match="'x'"):
        WRITERS["tengine_scale"](context_for("tengine_u8", table, tmp_path))


def test_stpu_layout(tmp_path):
    table = toy_table("stpu")
    data = json.loads(WRITERS["stpu_json"](context_for("stpu", table, tmp_path)).read_text())
    x, w = data["activation"]["x"], data["weight"]["w_conv"]
    s = float(table["x"].scale[0])
    assert x == {
        "scale": s,
        "zero_point": 0,
        "bits": 8,
        "min": float(np.float32(-127 * s)),
        "max": float(np.float32(127 * s)),
        "quant_min": -127,
        "quant_max": 127,
    }
    assert w["axis"] == 0 and len(w["scale"]) == 4 and w["zero_point"] == [0, 0, 0, 0]


def test_floats_read_back_to_the_same_float32_bits(tmp_path):
    """Every float written is the Python float of a float32: parsing it gives the same bits."""
    table = toy_table("pplcuda")
    text = WRITERS["ppl_json"](context_for("pplcuda", table, tmp_path)).read_text()
    for token in re.findall(r"-?\d+\.\d+(?:e-?\d+)?", text):
        value = float(token)
        assert float(np.float32(value)) == value


# -- malformed files --------------------------------------------------------------------------------------
MALFORMED = [
    ("clip_ranges", "tensorrt", "{not json", "not valid JSON"),
    ("clip_ranges", "tensorrt", '{"tensorrt": {}}', "blob_range"),
    ("clip_ranges", "tensorrt", '{"tensorrt": {"blob_range": {"x": "big"}}}', "'x'"),
    ("clip_ranges", "tensorrt", '{"tensorrt": {"blob_range": {"w_conv": [1.0, 2.0]}}}', "'w_conv'"),
    ("clip_ranges", "academic", '{"tensorrt": {"blob_range": {}}}', "qparams"),
    ("calib_cache", "tensorrt", "x: 3f000000\n", "header"),
    ("calib_cache", "tensorrt", "TRT-8600-EntropyCalibration2\nx: 3f0000\n", "line 2"),
    ("calib_cache", "tensorrt", "TRT-8600-EntropyCalibration2\nx: 00000000\n", "'x'"),
    ("encodings", "snpe", '{"activation_encodings": {"x": [{"bitwidth": 8}]}, "param_encodings": {}}', "'scale'"),
    ("encodings", "snpe", '{"activation_encodings": {}}', "param_encodings"),
    (
        "ppl_json",
        "pplcuda",
        '{"ppl": {"x": {"step": 0.1, "zero_point": 0.5, "min": 0, "max": 25.5, "bit": 8}}}',
        "'zero_point' of tensor 'x'",
    ),
    ("ppl_json", "pplcuda", "[]", "JSON object"),
    ("ppl_json", "pplcuda", '{"activation": {}, "weight": {}}', "'ppl'"),
    (
        "ppl_json",
        "pplcuda",
        '{"ppl": {"x": {"step": 0.1, "zero_point": 0, "min": 0, "max": 25.5, "bit": 8, "type": "per_tensor"}}}',
        "'x' has type 'per_tensor'",
    ),
    (
        "ppl_json",
        "pplcuda",
        '{"ppl": {"x": {"step": [0.1], "zero_point": 0, "min": [0], "max": [25.5], "bit": 8}}}',
        "'x' needs lists",
    ),
    ("nnie_json", "nnie", '{"nnie": {"gfpq_param_dict": {"x": -1.0}}}', "'x'"),
    ("vitis_json", "vitis", '{"vitis": {"x": {"scale": 0.3}}}', "'x'"),
    ("vitis_json", "vitis", '{"vitis": {"x": {"scale": 0.25, "fix_position": 3}}}', "'x'"),
    ("vitis_json", "vitis", '{"param": {}, "output": {}}', "'vitis'"),
    ("tengine_scale", "tengine_u8", "x 0.1\n", "line 1"),
    ("tengine_scale", "tengine_u8", "x 0.1 3\ny 0.2 4\nx 0.1 3\n", "consecutive"),
    ("stpu_json", "stpu", '{"activation": {"x": {"scale": 0.1, "zero_point": 0}}, "weight": {}}', "quant_min"),
]


@pytest.mark.parametrize(
    ("key", "backend", "text", "message"), MALFORMED, ids=[f"{m[0]}-{i}" for i, m in enumerate(MALFORMED)]
)
def test_malformed_files_raise_a_clear_error(tmp_path, key, backend, text, message):
    path = tmp_path / "bad.txt"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as error:
        READERS[key](path, ParamsTable[backend], toy_model())
    assert str(path) in str(error.value)


def test_registry_is_read_only_and_complete():
    assert isinstance(WRITERS, MappingProxyType) and isinstance(READERS, MappingProxyType)
    with pytest.raises(TypeError):
        WRITERS["x"] = print  # type: ignore[index]
    assert set(KEYS) <= set(WRITERS) and set(KEYS) <= set(READERS)
    for backend in {b for b, _ in DEPLOYS} | {"academic_nlp"}:
        files = {key for key in ParamsTable[backend].deploy if FORMATS[key].run is None}  # models are run instead
        assert set(ParamsTable[backend].deploy) <= set(WRITERS) and files <= set(READERS)


# -- deployments of DigitsCNN, read back and run in onnxruntime ---------------------------------------------
def names_in_file(key: str, path: str) -> set[str]:
    """The tensors a parameter file names, parsed here independently of the readers."""
    text = Path(path).read_text()
    if key == "calib_cache":
        return {line.rsplit(":", 1)[0] for line in text.splitlines()[1:] if line}
    if key == "tengine_scale":
        return {line.split()[0] for line in text.splitlines() if line}
    data = json.loads(text)
    paths = {
        "clip_ranges": [("tensorrt", "blob_range")],
        "encodings": [("activation_encodings",), ("param_encodings",)],
        "ppl_json": [("ppl",)],
        "nnie_json": [("nnie", "gfpq_param_dict")],
        "vitis_json": [("vitis",)],
        "stpu_json": [("activation",), ("weight",)],
    }[key]
    sections = []
    for keys in paths:
        section = data
        for part in keys:
            section = section[part]
        sections.append(section)
    return {name for section in sections for name in section}


def scalar_qparams(model: onnx.ModelProto) -> onnx.ModelProto:
    """Per-tensor Q/DQ scales and zero points as 0-d tensors, the ONNX per-tensor form.

    insert_qdq currently stores them with shape [1], which onnxruntime's QLinearAveragePool
    fusion rejects when a pool sits between two quantized tensors (the Vitis placement).
    """
    per_tensor = {
        name
        for node in model.graph.node
        if node.op_type in ("QuantizeLinear", "DequantizeLinear") and not any(a.name == "axis" for a in node.attribute)
        for name in node.input[1:]
    }
    for init in model.graph.initializer:
        if init.name in per_tensor and list(init.dims) == [1]:
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init).reshape(()), init.name))
    return model


DEPLOYS = [
    ("tensorrt", "clip_ranges"),
    ("tensorrt", "calib_cache"),
    ("tensorrt_nlp", "clip_ranges"),
    ("tensorrt_nlp", "calib_cache"),
    ("academic", "clip_ranges"),
    ("snpe", "encodings"),
    ("pplw8a16", "ppl_json"),
    ("pplcuda", "ppl_json"),
    ("nnie", "nnie_json"),
    ("vitis", "vitis_json"),
    ("tengine_u8", "tengine_scale"),
    ("stpu", "stpu_json"),
]
OUTPUT_LSB = {"vitis": 2, "nnie": 2}  # the rest: 1
QUANTIZED_OUTPUT = {"snpe", "pplw8a16", "pplcuda", "vitis", "tengine_u8", "stpu"}  # all-integer placements


@pytest.fixture(scope="module")
def deployments(tmp_path_factory):
    cache: dict[str, tuple] = {}

    def deploy(backend: str):
        if backend not in cache:
            torch.manual_seed(0)
            extra = {"prepare_custom_config_dict": ACADEMIC_8BIT} if backend == "academic" else {}
            qmodel = prepare_by_platform(DigitsCNN().eval(), backend, **extra)
            enable_calibration(qmodel)
            generator = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for _ in range(4):
                    qmodel(torch.randn(16, 1, 8, 8, generator=generator))
            enable_quantization(qmodel)
            qmodel.eval()
            folder = tmp_path_factory.mktemp(backend)
            dynamic = {"x": {0: "batch"}, "output": {0: "batch"}}
            result = convert_deploy(qmodel, backend, {"x": [1, 1, 8, 8]}, output_path=folder, dynamic_axes=dynamic)
            cache[backend] = (qmodel, result)
        return cache[backend]

    return deploy


def quantized_output(model: onnx.ModelProto, table: QParamTable) -> TensorQParams | None:
    """The entry of the network output, or of the tensor an Identity chain copies to it; None if unquantized."""
    producers = {out: node for node in model.graph.node for out in node.output}
    name = model.graph.output[0].name
    while name not in table and name in producers and producers[name].op_type == "Identity":
        name = producers[name].input[0]
    return table.get(name)


def output_layer(model: onnx.ModelProto) -> tuple[str, np.ndarray]:
    """The input tensor and the [out, in] weight of the Gemm that computes the network output."""
    producers = {out: node for node in model.graph.node for out in node.output}
    node = producers[model.graph.output[0].name]
    while node.op_type == "Identity":
        node = producers[node.input[0]]
    assert node.op_type == "Gemm"
    weight = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == node.input[1]))
    trans_b = any(a.name == "transB" and a.i for a in node.attribute)
    return node.input[0], (weight if trans_b else weight.T)


@pytest.mark.parametrize(("backend", "key"), DEPLOYS, ids=[f"{b}-{k}" for b, k in DEPLOYS])
def test_deployment_read_back_runs_like_the_simulation(deployments, backend, key):
    qmodel, result = deployments(backend)
    table = result.table
    assert key in result.artifacts and Path(result.artifacts[key]).is_file()
    in_file = names_in_file(key, result.artifacts[key])
    expected = set(table.activations()) if key == "calib_cache" else set(table)
    assert expected <= in_file, f"missing from the file: {sorted(expected - in_file)}"

    float_model = onnx.load(result.artifacts["deploy_onnx"])
    read = READERS[key](result.artifacts[key], resolve_backend(backend), float_model)
    # The file's values; where the format holds no weights (calib_cache), the deployment's.
    entries = {tensor: read.get(tensor, entry) for tensor, entry in table.items()}
    rebuilt, _ = insert_qdq(float_model, QParamTable(entries), use_consumers=False)
    session = ort_session(scalar_qparams(rebuilt), optimize=False)  # the file's arithmetic, any host

    x = torch.randn(64, 1, 8, 8, generator=torch.Generator().manual_seed(7))
    layer_input: list[np.ndarray] = []
    fc = dict(qmodel.named_modules())["fc"]
    hook = fc.register_forward_pre_hook(lambda module, args: layer_input.append(args[0].detach().numpy()))
    try:
        with torch.no_grad():
            simulated = qmodel(x).numpy()
    finally:
        hook.remove()
    (got,) = session.run(None, {"x": x.numpy()})
    difference = np.abs(got.astype(np.float64) - simulated)
    # Two float32 dequantized values differ from an exact multiple of the scale by their rounding.
    rounding = 4 * np.spacing(np.float32(np.abs(simulated).max()))

    output_entry = quantized_output(float_model, table)
    assert (output_entry is not None) == (backend in QUANTIZED_OUTPUT)
    lsb = OUTPUT_LSB.get(backend, 1)
    if output_entry is not None:
        assert output_entry.grid == "linear"
        assert difference.max() <= lsb * output_entry.scale[0] + rounding
    else:
        # Float output: a Gemm on a quantized input. Each input may sit up to 2 levels from the
        # simulation's (a rounding tie that onnxruntime's and PyTorch's float sums decide differently,
        # plus one such level carried in from the layer before), so output j may move by
        # sum_i |W_ji| * (2 levels at input i); float32 summation adds far less than 1e-6.
        tensor, weight = output_layer(float_model)
        entry = entries[tensor]
        inputs = np.abs(layer_input[0].astype(np.float64))
        if entry.grid == "log":  # a level is a factor 2**(1/16); near zero, the two smallest levels
            step = inputs * (2 ** (2 / 16) - 1) + 2 * 2 ** (1 / 16) * entry.scale[0]
        else:
            step = np.full_like(inputs, 2 * entry.scale[0])
        bound = step @ np.abs(weight.astype(np.float64)).T + 1e-6
        assert np.all(difference <= bound)
    if key != "clip_ranges" or resolve_backend(backend).weight is None:
        # A format that keeps the values exactly rebuilds the deployment's own model, bit for bit.
        reference, _ = insert_qdq(float_model, table, use_consumers=False)
        (want,) = ort_session(scalar_qparams(reference), optimize=False).run(None, {"x": x.numpy()})
        assert np.array_equal(got, want)


# -- the format records ------------------------------------------------------------------------------------
def test_every_format_is_one_record_that_verification_can_check():
    """A parameter file has a writer and a reader; a model a runner; every key a backend lists has a record."""
    from mqbench.deploy.writers import FORMATS

    for key, record in FORMATS.items():
        assert record.key == key
        assert (record.read is None) != (record.run is None), key  # checked one way, never both or neither
        assert record.write is not None or key == "onnx", key  # the Q/DQ model is the pipeline's own
        assert (record.run is None) == (record.serve is None), key  # a model is verified and served
    for name in ParamsTable:
        assert set(ParamsTable[name].deploy) <= set(FORMATS), name
    assert {key for key, record in FORMATS.items() if record.run is not None} == {
        "onnx",
        "qlinear_onnx",
        "openvino_onnx",
        "matmulnbits_onnx",
        "compressed_tensors",
        "gguf",
        "genai",
    }


def test_a_listed_artifact_without_a_writer_fails_before_the_export(tmp_path):
    import dataclasses

    from mqbench.backends import register_backend

    register_backend("nowriter", dataclasses.replace(ParamsTable["tensorrt"], name="nowriter", deploy=("npu_bin",)))
    try:
        qmodel = prepare_by_platform(torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3)).eval(), "nowriter")
        enable_calibration(qmodel)
        qmodel(torch.randn(2, 1, 6, 6))
        enable_quantization(qmodel)
        folder = tmp_path / "out"
        with pytest.raises(ValueError, match=r"lists the artifact\(s\) \['npu_bin'\].*register_deploy_function"):
            convert_deploy(qmodel, "nowriter", {"x": [1, 1, 6, 6]}, output_path=folder)
        assert not folder.exists()  # nothing written, the folder it created removed
    finally:
        ParamsTable.unregister("nowriter")
