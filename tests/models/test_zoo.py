"""The zoo's on-disk cache of trained weights: load instead of train, train anew on a new key or a bad file."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from mqbench.models import zoo


def _tiny() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, stride=4, bias=False),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 10),
    )


RECIPE = zoo.ZooRecipe(_tiny, steps=3, lr=1e-2, batch_size=8)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache directory, and a list recording every training run."""
    monkeypatch.setenv("MQBENCH_CACHE", str(tmp_path))
    monkeypatch.delenv("MQBENCH_ZOO_CACHE", raising=False)
    trained: list[zoo.ZooRecipe] = []
    train = zoo._train_classifier

    def counting(model, images, labels, recipe):
        trained.append(recipe)
        train(model, images, labels, recipe)

    monkeypatch.setattr(zoo, "_train_classifier", counting)
    return tmp_path / "zoo", trained


def _assert_same_model(a: zoo.ZooModel, b: zoo.ZooModel) -> None:
    first, second = a.model.state_dict(), b.model.state_dict()
    assert first.keys() == second.keys()
    assert all(torch.equal(first[key], second[key]) for key in first)
    with torch.no_grad():
        assert torch.equal(a.model(a.evaluation), b.model(b.evaluation))


def test_second_build_loads_instead_of_training(cache):
    directory, trained = cache
    first = zoo.build_zoo_model("tiny", RECIPE)
    assert len(trained) == 1
    (path,) = directory.iterdir()
    assert path.name.startswith("tiny-") and path.suffix == ".pt"
    second = zoo.build_zoo_model("tiny", RECIPE)
    assert len(trained) == 1
    _assert_same_model(first, second)
    assert not second.model.training
    # the BatchNorm re-estimation leaves the default momentum behind, trained or loaded
    assert [m.momentum for m in second.model.modules() if isinstance(m, nn.BatchNorm2d)] == [0.1]


@pytest.mark.parametrize(
    "change",
    ["name", "seed", "lr", "steps", "batch_size", "torch", "source"],
)
def test_a_change_of_key_trains_anew(cache, monkeypatch, change):
    directory, trained = cache
    zoo.build_zoo_model("tiny", RECIPE)
    name, recipe = "tiny", RECIPE
    if change == "name":
        name = "tiny2"
    elif change in ("seed", "steps", "batch_size"):
        recipe = dataclasses.replace(RECIPE, **{change: getattr(RECIPE, change) + 1})
    elif change == "lr":
        recipe = dataclasses.replace(RECIPE, lr=2 * RECIPE.lr)
    elif change == "torch":
        monkeypatch.setattr(torch, "__version__", torch.__version__ + "+other")
    else:  # an edit of the training code or of a module defining the model
        getsource = zoo.inspect.getsource
        monkeypatch.setattr(zoo.inspect, "getsource", lambda module: getsource(module) + "\n# edited\n")
    zoo.build_zoo_model(name, recipe)
    assert len(trained) == 2
    assert len(list(directory.iterdir())) == 2
    zoo.build_zoo_model(name, recipe)
    assert len(trained) == 2


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty", "other_model"])
def test_a_file_that_does_not_load_is_trained_anew_and_replaced(cache, damage):
    directory, trained = cache
    first = zoo.build_zoo_model("tiny", RECIPE)
    (path,) = directory.iterdir()
    whole = path.read_bytes()
    if damage == "garbage":
        path.write_bytes(b"not a checkpoint" * 10)
    elif damage == "truncated":
        path.write_bytes(whole[: len(whole) // 2])
    elif damage == "empty":
        path.write_bytes(b"")
    else:
        torch.save({"weight": torch.zeros(3)}, path)
    with pytest.warns(UserWarning, match="does not load"):
        second = zoo.build_zoo_model("tiny", RECIPE)
    assert len(trained) == 2
    _assert_same_model(first, second)  # training is deterministic on one machine
    assert [p.name for p in directory.iterdir()] == [path.name]  # replaced, no temporary left
    zoo.build_zoo_model("tiny", RECIPE)
    assert len(trained) == 2


def test_a_failed_write_leaves_no_partial_file(cache, monkeypatch):
    directory, _ = cache

    def failing_save(obj, file):
        file.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(zoo.torch, "save", failing_save)
    with pytest.warns(UserWarning, match="not writable"):
        zoo.build_zoo_model("tiny", RECIPE)
    assert list(directory.iterdir()) == []


def test_the_cache_can_be_turned_off(cache, monkeypatch):
    directory, trained = cache
    monkeypatch.setenv("MQBENCH_ZOO_CACHE", "0")
    assert zoo.zoo_cache_dir() is None
    zoo.build_zoo_model("tiny", RECIPE)
    zoo.build_zoo_model("tiny", RECIPE)
    assert len(trained) == 2
    assert not directory.exists()


def test_cache_location(monkeypatch, tmp_path):
    monkeypatch.delenv("MQBENCH_ZOO_CACHE", raising=False)
    monkeypatch.setenv("MQBENCH_CACHE", str(tmp_path))
    assert zoo.zoo_cache_dir() == tmp_path / "zoo"
    monkeypatch.delenv("MQBENCH_CACHE")
    assert zoo.zoo_cache_dir() == Path.home() / ".cache" / "mqbench" / "zoo"


SCRIPT = """
import sys
import torch
from torch import nn
from mqbench.models import zoo

def tiny():
    return nn.Sequential(nn.Conv2d(3, 4, 3, stride=4), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 64, 10))

if sys.argv[1] == "load":
    def refuse(*args):
        raise AssertionError("trained although the weights are cached")
    zoo._train_classifier = refuse
model = zoo.build_zoo_model("tiny", zoo.ZooRecipe(tiny, steps=2, lr=1e-2, batch_size=8)).model
print(sum(float(p.double().sum()) for p in model.state_dict().values() if p.is_floating_point()))
"""


def test_a_fresh_process_loads_the_weights_another_one_trained(tmp_path):
    script = tmp_path / "build_tiny.py"
    script.write_text(textwrap.dedent(SCRIPT))
    environment = {key: value for key, value in os.environ.items() if key != "MQBENCH_ZOO_CACHE"}
    environment["MQBENCH_CACHE"] = str(tmp_path)

    def run(mode: str) -> str:
        result = subprocess.run(
            [sys.executable, str(script), mode], capture_output=True, text=True, env=environment, check=False
        )
        assert result.returncode == 0, result.stderr
        return result.stdout

    trained = run("train")
    assert len(list((tmp_path / "zoo").iterdir())) == 1
    assert run("load") == trained
