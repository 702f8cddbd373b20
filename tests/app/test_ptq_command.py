"""`mqbench ptq --config`: MQBench's YAML layout checked key by key, the shipped examples on the bundled
digits, a user's own model, checkpoint and image folder, and a run folder whose figures are re-measured
here independently (the saved state dict reloaded, the deployed ONNX run on onnxruntime)."""

from __future__ import annotations

import importlib
import json
import textwrap
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
import yaml

from mqbench.advanced_ptq import restore_smoothing
from mqbench.app.config import ConfigError, load_config, parse_config
from mqbench.app.ptq import ptq_recipe
from mqbench.app.runs import RunFolder, output_index, prediction
from mqbench.backends import ParamsTable, PTQRecipe
from mqbench.cli import main
from mqbench.data import load_digits_split
from mqbench.models.zoo import digits_rgb, zoo_model
from mqbench.prepare_by_platform import prepare_by_platform
from run_helpers import SMALL_CNN_SOURCE

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def test_mqbench_s_application_layout_loads_with_its_reconstruction_keys():
    config = load_config(EXAMPLES / "ptq_qdrop_resnet18_digits.yaml")
    recon = config["quantize"]["reconstruction"]
    assert config["quantize"]["quantize_type"] == "advanced_ptq"
    assert recon["prob"] == 0.5 and recon["b_range"] == [20, 2] and recon["round_mode"] == "learned_hard_sigmoid"
    assert config["extra_prepare_dict"]["extra_qconfig_dict"]["w_qscheme"]["p"] == 2.4
    assert config["data"]["path"] is None  # the embedded default
    assert config["process"]["seed"] == 1005


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            {"quantize": {"quantize_typ": "naive_ptq"}},
            r"unknown key 'quantize\.quantize_typ'; valid keys: algorithm, algorithm_config, backend,",
        ),
        (
            {"quantize": {"quantize_type": "post_training"}},
            r"'quantize\.quantize_type' must be naive_ptq, advanced_ptq, weight_only, ptq, qat, got 'post_training'",
        ),
        (
            {"quantize": {"deploy": {"name": "x"}}},
            r"unknown key 'quantize\.deploy\.name'; valid keys: deploy_to",
        ),
        ({"data": {"batch_size": 0}}, r"'data\.batch_size' must be a positive integer, got 0"),
        ({"data": {"mean": [0.5, 0.5]}}, r"'data\.mean' must be a list of 1 or 3 numbers"),
        ({"model": {"type": ""}}, r"'model\.type' must be a model name or an import path"),
        ({"trainer": {}}, r"unknown section 'trainer'; valid sections: data, extra_prepare_dict, mixed_precision"),
        (
            {"quantize": {"quantize_type": "advanced_ptq"}},
            r"quantize\.quantize_type is advanced_ptq but quantize\.reconstruction is",
        ),
        ([1, 2], r"a configuration is a mapping of sections, got list"),
        (
            {"quantize": {"recipe": {"equalise": True}}},
            r"'quantize\.recipe' must be null \(the backend's recipe\), plain, or a mapping of activation_observer",
        ),
        ({"quantize": {"recipe": {"bias_correction": "yes"}}}, r"'quantize\.recipe' must be null"),
    ],
)
def test_every_key_is_checked_with_the_file_the_key_and_the_valid_choices(raw, message):
    with pytest.raises(ConfigError, match=r"^my\.yaml: " + message):
        parse_config(raw, "my.yaml")


def test_the_calibration_recipe_is_the_backend_s_plain_or_the_configured_one():
    qmodel = prepare_by_platform(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU()).eval(), "snpe")
    assert ptq_recipe(None, qmodel) == ParamsTable["snpe"].ptq_recipe
    assert ptq_recipe("plain", qmodel) == PTQRecipe()
    assert ptq_recipe({"equalize": True}, qmodel) == PTQRecipe(equalize=True)
    with pytest.raises(ConfigError, match=r"quantize\.recipe\.activation_observer: .*unknown observer 'Percentile'"):
        ptq_recipe({"activation_observer": "Percentile"}, qmodel)


def test_a_missing_or_broken_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="no such configuration file"):
        load_config(tmp_path / "absent.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("quantize: [unclosed\n")
    with pytest.raises(ConfigError, match=r"broken\.yaml: not valid YAML"):
        load_config(broken)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", r"empty\.yaml: the file is empty \(no sections\); a run configuration needs at least a quantize section"),
        ("# only a comment\n", r"the file is empty"),
        ("{}\n", r"the file is empty"),
        (
            "model: {type: resnet18}\n",
            r"missing the quantize section \(quantize\.backend\) and extra_prepare_dict\.extra_qconfig_dict",
        ),
        ("quantize: {cali_batchsize: 2}\n", r"missing quantize\.backend and extra_prepare_dict\.extra_qconfig_dict"),
    ],
)
def test_an_empty_file_or_one_without_a_backend_says_what_is_missing(text, message, tmp_path, capsys):
    config = tmp_path / "empty.yaml"
    config.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(config)
    with pytest.raises(SystemExit) as exit_info:
        main(["ptq", "--config", str(config), "--output", str(tmp_path / "run"), "--quiet"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "empty.yaml" in error and "Academic's" not in error and not (tmp_path / "run").exists()
    config.write_text("model: {type: resnet18}\nquantize: {backend: academic}\n")  # named: prepare checks its keys
    assert load_config(config)["quantize"]["backend"] == "academic"


def test_a_run_folder_file_is_whole_or_absent(tmp_path):
    folder = RunFolder(tmp_path / "run")
    folder.write_text("results.json", "old, complete\n")

    def interrupted(path):
        path.write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        folder._replace("results.json", interrupted)
    assert (tmp_path / "run" / "results.json").read_text() == "old, complete\n"
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["results.json"]


def _onnx_accuracy(path: Path, images: torch.Tensor, labels: torch.Tensor, batch: int = 64) -> float:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    # as written (float ops on dequantized values): a TensorRT Q/DQ model stands for its hardware, and
    # onnxruntime's fused int8 kernels would add this CPU's saturation (no VNNI) to the comparison
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    logits = np.concatenate(
        [session.run(None, {name: images[i : i + batch].numpy()})[0] for i in range(0, len(images), batch)]
    )
    return int((logits.argmax(1) == labels.numpy()).sum()) / len(labels)


def test_the_shipped_ptq_example_runs_and_its_figures_are_what_an_independent_measurement_gives(ptq_example_run):
    run, code = ptq_example_run
    assert code == 0
    results = json.loads((run / "results.json").read_text())
    assert results["status"] == "finished" and results["verify"]["passed"]
    assert {p.name for p in run.iterdir()} == {
        "config.yaml",
        "quantized_state_dict.pt",
        "deploy",
        "verify.txt",
        "results.json",
        "report.md",
        "report.html",
        "checksums.sha256",
    }
    resolved = yaml.safe_load((run / "config.yaml").read_text())
    assert resolved["quantize"]["backend"] == "Tensorrt" and resolved["data"]["max_eval"] is None  # defaults filled

    _, test = load_digits_split()
    images, labels = digits_rgb(test.images), test.labels
    model = zoo_model("resnet18").model
    with torch.no_grad():
        float_accuracy = int((model(images).argmax(1) == labels).sum()) / len(labels)
    assert results["accuracy"]["float"] == pytest.approx(float_accuracy, abs=1e-12)

    qmodel = prepare_by_platform(model, "tensorrt", {})
    saved = torch.load(run / "quantized_state_dict.pt", weights_only=True)
    restore_smoothing(qmodel, saved)
    qmodel.load_state_dict(saved)
    qmodel.eval()
    with torch.no_grad():
        simulated = int((qmodel(images).argmax(1) == labels).sum()) / len(labels)
    assert results["accuracy"]["simulated"] == pytest.approx(simulated, abs=1e-12)

    deployed = _onnx_accuracy(run / "deploy" / "resnet18.onnx", images, labels)
    assert results["accuracy"]["deployed_artifact"] == "onnx"
    assert results["accuracy"]["deployed"] == pytest.approx(deployed, abs=1e-12)
    report = (run / "report.md").read_text()
    assert f"| float | {100 * float_accuracy:.2f} % |" in report
    assert "Verdict: passed." in report


def _write_images(root: Path, split: str, images: torch.Tensor, labels: torch.Tensor, classes: list[int]) -> None:
    from PIL import Image

    for index, (image, label) in enumerate(zip(images, labels, strict=True)):
        if int(label) not in classes:
            continue
        folder = root / split / f"digit_{int(label)}"
        folder.mkdir(parents=True, exist_ok=True)
        pixels = (image[0].numpy() * 255).round().astype(np.uint8)
        Image.fromarray(pixels, mode="L").resize((24, 20)).save(folder / f"{index:04d}.png")


def test_a_user_model_checkpoint_and_image_folder(tmp_path, user_modules):
    from PIL import Image

    train, test = load_digits_split()
    classes = [0, 1, 7]
    data = tmp_path / "digits_folder"
    _write_images(data, "train", train.images[:200], train.labels[:200], classes)
    _write_images(data, "val", test.images[:60], test.labels[:60], classes)
    package = tmp_path / "my_models"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "nets.py").write_text(SMALL_CNN_SOURCE)
    importlib.invalidate_caches()  # the package was written after its directory went on sys.path
    from my_models.nets import small_cnn

    torch.manual_seed(0)
    net = small_cnn(num_classes=3, width=8).eval()
    torch.save({"state_dict": {f"module.{k}": v for k, v in net.state_dict().items()}}, tmp_path / "ckpt.pt")
    config = tmp_path / "user.yaml"
    config.write_text(
        textwrap.dedent(
            """
            model: {type: "my_models.nets:small_cnn", kwargs: {num_classes: 3, width: 8}, path: ckpt.pt}
            data: {path: digits_folder, batch_size: 16, input_size: 16, test_resize: 18}
            quantize: {quantize_type: naive_ptq, cali_batchsize: 2, backend: OPENVINO, verify_samples: 8}
            extra_prepare_dict: {reduce_range: true}  # 7-bit weights: exact on CPUs with or without VNNI
            """
        )
    )
    code = main(["ptq", "--config", str(config), "--output", "run", "--quiet"])
    assert code == 0
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["data"]["classes"] == ["digit_0", "digit_1", "digit_7"]
    val_count = sum(1 for i in range(60) if int(test.labels[i]) in classes)
    assert results["data"]["val_samples"] == val_count
    assert results["data"]["calibration_samples"] == 32
    assert results["backend"] == "openvino" and results["verify"]["passed"]

    # the float accuracy, from the checkpoint's model and the folder read here with the documented transform
    mean = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)
    images, labels = [], []
    for label, name in enumerate(["digit_0", "digit_1", "digit_7"]):
        for file in sorted((data / "val" / name).glob("*.png")):
            picture = Image.open(file).convert("RGB")  # 24 x 20: shorter side to 18, then the centre 16 x 16
            picture = picture.resize((round(24 * 18 / 20), 18))
            left, top = (picture.size[0] - 16) // 2, (picture.size[1] - 16) // 2
            picture = picture.crop((left, top, left + 16, top + 16))
            pixels = torch.tensor(np.asarray(picture), dtype=torch.float32).permute(2, 0, 1) / 255.0
            images.append((pixels - mean) / std)
            labels.append(label)
    with torch.no_grad():
        logits = net(torch.stack(images))
    expected = int((logits.argmax(1) == torch.tensor(labels)).sum()) / len(labels)
    assert results["accuracy"]["float"] == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ({"type": "no_such_model"}, "is not a zoo model"),
        ({"type": "no_such_package.nets:factory"}, "cannot import 'no_such_package.nets'"),
        ({"type": "resnet18", "kwargs": {"num_classes": 1000}}, "is built by its own recipe and takes none"),
        ({"type": "resnet18", "path": "absent.pt"}, "no such checkpoint file"),
    ],
)
def test_a_model_that_cannot_be_built_is_a_usage_error(model, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "bad.yaml"
    config.write_text(yaml.safe_dump({"model": model, "quantize": {"backend": "tensorrt"}}))
    with pytest.raises(SystemExit) as exit_info:
        main(["ptq", "--config", str(config), "--output", "run", "--quiet"])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_shipped_qdrop_example_reconstructs_deploys_and_verifies(tmp_path):
    raw = yaml.safe_load((EXAMPLES / "ptq_qdrop_resnet18_digits.yaml").read_text())
    raw["quantize"]["reconstruction"]["max_count"] = 10  # the example's recipe, shortened for the suite
    raw["quantize"]["cali_batchsize"] = 1
    config = tmp_path / "qdrop.yaml"
    config.write_text(yaml.safe_dump(raw))
    run = tmp_path / "run"
    assert main(["ptq", "--config", str(config), "--output", str(run), "--quiet"]) == 0
    results = json.loads((run / "results.json").read_text())
    assert results["method"] == "advanced_ptq" and results["verify"]["passed"]
    assert "reconstruction" in results["seconds"]
    assert (run / "deploy" / "resnet18_w2a4.onnx").is_file()


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"quantize": {"backend": "tpu9000"}}, "quantize.backend: "),
        ({"extra_prepare_dict": {"extra_qconfig_dict": {"w_observer": "NoSuchObserver"}}}, "extra_prepare_dict: "),
    ],
)
def test_a_backend_or_prepare_option_that_does_not_exist_is_a_usage_error_and_the_run_says_failed(
    raw, message, tmp_path, capsys
):
    config = tmp_path / "bad.yaml"
    config.write_text(yaml.safe_dump(raw))
    with pytest.raises(SystemExit) as exit_info:
        main(["ptq", "--config", str(config), "--output", str(tmp_path / "run"), "--quiet"])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert json.loads((tmp_path / "run" / "results.json").read_text())["status"] == "failed"


def test_mqbench_s_imagenet_configs_parse_as_they_ship():
    """The layout of MQBench's configs/{adaround,brecq,qdrop}/r18_2_4.yaml with their ImageNet sections."""
    from advanced_ptq.test_mqbench_ptq_script import CONFIG, METHODS
    from mqbench.advanced_ptq import ReconstructionConfig

    imagenet = """
    model:
        type: resnet18
        kwargs:
            num_classes: 1000
        path: /path-of-pretrained
    data:
        path: /path-of-imagenet
        batch_size: 64
        num_workers: 4
        pin_memory: True
        input_size: 224
        test_resize: 256
    """
    for method in METHODS.values():
        text = CONFIG.format(**method, output="./").split("model:")[0] + textwrap.dedent(imagenet)
        raw = yaml.safe_load(text)
        raw["quantize"]["backend"] = "Academic"
        config = parse_config(raw, "r18_2_4.yaml")
        assert config["data"]["input_size"] == 224 and config["model"]["kwargs"] == {"num_classes": 1000}
        ReconstructionConfig.from_mapping(config["quantize"]["reconstruction"])  # every key known


# MQBench's configs/min_max/r18_8_8.yaml key for key (its configs/mse ones differ in the observers),
# with the data and model sections adapted to the bundled digits and the zoo, as its example expects.
MQBENCH_MIN_MAX = """
extra_prepare_dict:
    extra_qconfig_dict:
        w_observer: MinMaxObserver
        a_observer: EMAMinMaxObserver
        w_fakequantize: FixedFakeQuantize
        a_fakequantize: FixedFakeQuantize
        w_qscheme:
            bit: 8
            symmetry: False
            per_channel: True
            pot_scale: False
        a_qscheme:
            bit: 8
            symmetry: False
            per_channel: False
            pot_scale: False
quantize:
    quantize_type: ptq # support ptq or qat
    cali_batchsize: 16
model:
    type: resnet18
data:
    batch_size: 8
    max_eval: 64
process:
    seed: 1005
"""


def test_mqbench_s_older_quantize_type_names_resolve_as_its_configs_mean_them():
    raw = yaml.safe_load(MQBENCH_MIN_MAX)
    assert parse_config(raw, "r18_8_8.yaml")["quantize"]["quantize_type"] == "naive_ptq"
    raw["quantize"]["reconstruction"] = {"pattern": "block", "max_count": 10}
    assert parse_config(raw, "r18_2_4.yaml")["quantize"]["quantize_type"] == "advanced_ptq"
    raw["quantize"]["quantize_type"] = "qat"
    assert parse_config(raw, "qat.yaml")["quantize"]["quantize_type"] == "qat"


def test_mqbench_s_min_max_config_runs_and_a_qat_config_is_sent_to_mqbench_qat(tmp_path, capsys):
    config = tmp_path / "r18_8_8.yaml"
    config.write_text(MQBENCH_MIN_MAX)
    run = tmp_path / "run"
    assert main(["ptq", "--config", str(config), "--output", str(run), "--quiet"]) == 0
    results = json.loads((run / "results.json").read_text())
    assert results["method"] == "naive_ptq" and results["verify"]["passed"]
    assert results["recipe"] == ParamsTable["academic"].ptq_recipe.describe() == "plain calibration"
    assert yaml.safe_load((run / "config.yaml").read_text())["quantize"]["quantize_type"] == "naive_ptq"
    config.write_text(MQBENCH_MIN_MAX.replace("quantize_type: ptq", "quantize_type: qat"))
    with pytest.raises(SystemExit) as exit_info:
        main(["ptq", "--config", str(config), "--output", str(tmp_path / "qat_run"), "--quiet"])
    assert exit_info.value.code == 2
    assert "quantize.quantize_type is qat: run this configuration with mqbench qat" in capsys.readouterr().err


HF_MODELS = """
import torch
import transformers


def tiny_bert(num_labels=3):
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=16, num_labels=num_labels, attn_implementation="eager",
    )
    return transformers.BertForSequenceClassification(config).eval()
"""


def _token_data(folder: Path) -> Path:
    generator = np.random.default_rng(0)
    tokens = generator.integers(1, 40, size=(160, 8))
    labels = tokens[:, 0] % 3
    path = folder / "tokens.npz"
    np.savez(path, x_train=tokens[:96], y_train=labels[:96], x_val=tokens[96:], y_val=labels[96:])
    return path


@pytest.mark.parametrize("command", ["ptq", "qat"])
def test_a_hugging_face_model_through_its_tracer(command, tmp_path, user_modules):
    """transformers 4.x: traced with HFTracer; 5.x (no HFTracer): captured with torch.export."""
    pytest.importorskip("transformers")
    user_modules("hf_models", HF_MODELS)
    raw = {
        "model": {"type": "hf_models:tiny_bert", "tracer": "huggingface"},
        "data": {"path": str(_token_data(tmp_path)), "batch_size": 16},
        "quantize": {"backend": "tensorrt_nlp", "cali_batchsize": 2, "verify_samples": 16},
        "training": {"epochs": 1, "max_steps": 2, "lr": 0.01},
    }
    config = tmp_path / "bert.yaml"
    config.write_text(yaml.safe_dump(raw))
    assert main([command, "--config", str(config), "--output", "run", "--quiet"]) == 0
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["status"] == "finished" and results["verify"]["passed"], results["verify"]
    # The deployed model's accuracy, measured again here on onnxruntime from the artifact and the .npz
    # (in the run's batches: a random model's near-equal scores may round apart in another batch shape).
    arrays = np.load(tmp_path / "tokens.npz")
    artifact = results["accuracy"]["deployed_artifact"]
    assert [i.name for i in ort.InferenceSession(results["artifacts"][artifact]).get_inputs()] == ["input_ids"]
    tokens, labels = torch.from_numpy(arrays["x_val"].astype(np.int64)), torch.from_numpy(arrays["y_val"])
    deployed = _onnx_accuracy(Path(results["artifacts"][artifact]), tokens, labels, batch=16)
    assert results["accuracy"]["deployed"] == pytest.approx(deployed, abs=1e-12)
    assert results["accuracy"]["float"] is not None and results["accuracy"]["simulated"] is not None


def test_hugging_face_settings_are_checked(tmp_path):
    with pytest.raises(ConfigError, match=r"'model\.input_names' is for model\.tracer: huggingface"):
        parse_config({"model": {"input_names": ["input_ids"]}}, "x.yaml")
    with pytest.raises(ConfigError, match=r"'model\.tracer' must be null \(torch\.fx\) or huggingface"):
        parse_config({"model": {"tracer": "hf"}}, "x.yaml")
    from mqbench.app.sources import load_data

    with pytest.raises(ConfigError, match=r"a Hugging Face model reads token ids from a \.npz file"):
        load_data(parse_config({}, "x.yaml")["data"], token_ids=True)
    floats = tmp_path / "floats.npz"
    np.savez(floats, x_train=np.zeros((2, 4), np.float32), x_val=np.zeros((2, 4), np.float32))
    with pytest.raises(ConfigError, match=r"x_train must hold integer token ids, got float32"):
        load_data(parse_config({"data": {"path": str(floats)}}, "x.yaml")["data"], token_ids=True)


DATASET_FACTORY = """
import torch

from mqbench.data import load_digits_split
from mqbench.models.zoo import digits_rgb


class Digits(torch.utils.data.Dataset):
    classes = [str(i) for i in range(10)]

    def __init__(self, split, count):
        self.images, self.labels = digits_rgb(split.images[:count]), split.labels[:count]

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return self.images[index], int(self.labels[index])


def digits(count=64):
    train, test = load_digits_split()
    return {"train": Digits(train, count), "val": Digits(test, count)}


def one_dataset():
    return Digits(load_digits_split()[0], 8)
"""


def test_a_python_dataset_factory(tmp_path, user_modules, capsys):
    user_modules("my_data", DATASET_FACTORY)
    raw = {
        "model": {"type": "resnet18"},
        "data": {"factory": "my_data:digits", "kwargs": {"count": 48}, "batch_size": 16},
        "quantize": {"backend": "Tensorrt", "cali_batchsize": 2, "verify_samples": 8},
    }
    config = tmp_path / "factory.yaml"
    config.write_text(yaml.safe_dump(raw))
    assert main(["ptq", "--config", str(config), "--output", "run", "--quiet"]) == 0
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["status"] == "finished" and results["verify"]["passed"]
    assert results["data"]["source"] == "my_data:digits" and results["data"]["val_samples"] == 48
    assert results["data"]["classes"] == [str(i) for i in range(10)]
    _, test = load_digits_split()
    with torch.no_grad():
        float_accuracy = zoo_model("resnet18").model(digits_rgb(test.images[:48])).argmax(1) == test.labels[:48]
    assert results["accuracy"]["float"] == pytest.approx(int(float_accuracy.sum()) / 48, abs=1e-12)

    for data, message in (
        ({"factory": "my_data:one_dataset"}, "returned Digits; it returns the training and validation datasets"),
        ({"factory": "my_data:absent"}, "data.factory 'my_data:absent': 'my_data' has no callable 'absent'"),
        ({"factory": "my_data:digits", "path": "x.npz"}, "'data.path' and 'data.factory' both given"),
    ):
        config.write_text(yaml.safe_dump({**raw, "data": data}))
        with pytest.raises(SystemExit) as exit_info:
            main(["ptq", "--config", str(config), "--output", "bad", "--quiet"])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


def test_mqbench_s_hugging_face_trainer_layout_is_named_with_what_to_write_instead():
    """MQBench's vit_example / swint / nlp_example configs: their sections are Trainer arguments."""
    raw = {
        "quant": {
            "a_qconfig": {"quantizer": "FixedFakeQuantize", "observer": "EMAMSEObserver", "bit": 8},
            "w_qconfig": {"quantizer": "FixedFakeQuantize", "observer": "MinMaxObserver", "bit": 8},
            "calibrate": 1024,
            "backend": "academic",
        },
        "model": {"model_name_or_path": "/root/pretrained-models/vit-base-patch16-224"},
        "train": {"seed": 42, "do_train": False, "learning_rate": 1.0e-5},
        "progress": {"log_level": "passive"},
    }
    with pytest.raises(ConfigError) as error:
        parse_config(raw, "config.yaml")
    message = str(error.value)
    assert message.startswith("config.yaml: this is the layout of MQBench's Hugging Face Trainer examples")
    assert "extra_prepare_dict.extra_qconfig_dict" in message and "model.tracer: huggingface" in message


TWO_HEADS_SOURCE = """
import torch
from torch import nn

from mqbench.models.zoo import zoo_model


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = zoo_model("resnet18").model

    def forward(self, x):
        scores = self.net(x)
        return {"aux": torch.neg(scores), "scores": scores}  # aux's top class is the least likely one


def build():
    return TwoHeads().eval()
"""


def test_the_output_that_holds_the_class_scores_is_chosen_by_key_or_index(tmp_path, user_modules, capsys):
    user_modules("two_heads", TWO_HEADS_SOURCE)
    settings = {"model": {"type": "two_heads:build", "output": "scores"}, "data": {"max_eval": 96}}
    settings["quantize"] = {"backend": "tensorrt", "cali_batchsize": 2, "verify_samples": 8}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(settings))
    assert main(["ptq", "--config", str(tmp_path / "run.yaml"), "--output", "run", "--quiet"]) == 0
    accuracy = json.loads((tmp_path / "run" / "results.json").read_text())["accuracy"]
    # the deployed model's second output is the scores: deployed and simulated agree, far from aux's 0
    assert accuracy["float"] > 0.8, accuracy
    assert abs(accuracy["simulated"] - accuracy["float"]) < 0.05, accuracy
    assert abs(accuracy["deployed"] - accuracy["simulated"]) < 0.03, accuracy

    from two_heads import build  # the same choice by index; by default, a mapping's first value

    x = digits_rgb(load_digits_split()[1].images[:64])
    labels = load_digits_split()[1].labels[:64]
    with torch.no_grad():
        output = build()(x)
    assert prediction(output, 1) is output["scores"] and prediction(output, "scores") is output["scores"]
    assert output_index(output, "scores") == 1 and output_index(output, None) == 0
    assert float((prediction(output).argmax(1) == labels).float().mean()) < 0.1  # aux: the least likely class
    for output, message in (("logits", "give one of its tensor keys"), (2, "returns 2 tensor(s)")):
        config = tmp_path / "bad.yaml"
        config.write_text(yaml.safe_dump(settings | {"model": {"type": "two_heads:build", "output": output}}))
        with pytest.raises(SystemExit) as exit_info:
            main(["ptq", "--config", str(config), "--output", "run_bad", "--quiet"])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err
