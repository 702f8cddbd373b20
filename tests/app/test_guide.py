"""docs/your_own_model.md, executed: its YAML files written, its commands run in order, in a folder that
holds what the guide assumes a user has (a model package, a checkpoint, an image folder)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from mqbench.data import load_digits_split
from run_helpers import SMALL_CNN_SOURCE

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "your_own_model.md"


# A Hugging Face classifier as a user's factory would return it (built from a config here, where no
# pretrained folder exists; from_pretrained on a local folder returns the same kind of model).
HF_SOURCE = """
import transformers


def bert_classifier(num_labels=3):
    config = transformers.BertConfig(
        vocab_size=40, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=16, num_labels=num_labels, attn_implementation="eager",
    )
    return transformers.BertForSequenceClassification(config).eval()
"""


def _user_files(folder: Path) -> None:
    from PIL import Image

    package = folder / "my_models"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "nets.py").write_text(SMALL_CNN_SOURCE)
    sys.path.insert(0, str(folder))
    try:
        from my_models.nets import small_cnn
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop("my_models.nets", None)
        sys.modules.pop("my_models", None)
    torch.manual_seed(0)
    (folder / "checkpoints").mkdir()
    torch.save(small_cnn(num_classes=3, width=8).state_dict(), folder / "checkpoints" / "small_cnn.pt")
    (package / "hf.py").write_text(HF_SOURCE)
    tokens = np.random.default_rng(0).integers(1, 40, size=(96, 8))
    (folder / "data").mkdir()
    np.savez(folder / "data" / "tokens.npz", x_train=tokens[:64], y_train=tokens[:64, 0] % 3, x_val=tokens[64:])
    train, test = load_digits_split()
    for split, data in (("train", train), ("val", test)):
        for index in range(120):
            label = int(data.labels[index])
            if label not in (0, 1, 7):
                continue
            target = folder / "data" / "digits_folder" / split / f"digit_{label}"
            target.mkdir(parents=True, exist_ok=True)
            pixels = (data.images[index, 0].numpy() * 255).round().astype(np.uint8)
            Image.fromarray(pixels, mode="L").resize((24, 20)).save(target / f"{index:04d}.png")


def _command(line: str) -> list[str]:
    words = shlex.split(line)
    if words[0] == "mqbench":
        return [sys.executable, "-m", "mqbench", *words[1:]]
    if words[0] == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *words[1:]]
    if words[0] == "python":
        return [sys.executable, *words[1:]]
    raise AssertionError(f"the guide runs a command the test does not know: {line}")


# The shipped example's PTQ command as the guide writes it; the session's run of it (tests/app/conftest.py, the
# same command in-process on the same file) supplies its run folder instead of a second identical run.
SHIPPED_PTQ = "mqbench ptq --config examples/ptq_resnet18_digits.yaml --output runs/ptq_resnet18 --quiet"


def test_the_guide_runs_as_written(tmp_path, ptq_example_run):
    text = GUIDE.read_text()
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    _user_files(tmp_path)
    blocks = re.findall(r"```(yaml|bash)\n(.*?)```", text, flags=re.S)
    assert [kind for kind, _ in blocks] == ["bash", "yaml", "bash", "yaml", "bash", "yaml", "bash", "bash"]
    assert SHIPPED_PTQ in blocks[0][1].splitlines()
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tmp_path)}
    for kind, body in blocks:
        if kind == "yaml":
            name = re.match(r"# file: (\S+)\n", body).group(1)
            (tmp_path / name).write_text(body)
            continue
        for line in body.strip().splitlines():
            if line == SHIPPED_PTQ:
                run, code = ptq_example_run
                assert code == 0
                shutil.copytree(run, tmp_path / "runs" / "ptq_resnet18")
                continue
            done = subprocess.run(
                _command(line), cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=600
            )
            assert done.returncode == 0, f"{line}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    for run in ("ptq_resnet18", "my_bert", "my_ptq", "my_qat"):
        results = json.loads((tmp_path / "runs" / run / "results.json").read_text())
        assert results["status"] == "finished" and results["verify"]["passed"], run
        assert (tmp_path / "runs" / run / "report.html").is_file()
    assert (tmp_path / "runs" / "ptq_resnet18_again" / "resnet18.onnx").is_file()
    qat = json.loads((tmp_path / "runs" / "my_qat" / "results.json").read_text())
    assert qat["training"]["processes"] == 2 and len(qat["training"]["history"]) == 2
