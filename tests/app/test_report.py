"""The run report: its per-tensor SQNR against a formula written here, and report.html as a real browser
(headless Chromium) renders it, every plot decoded."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess

import numpy as np
import torch

from mqbench.app.report import layer_errors
from mqbench.models.zoo import zoo_model
from mqbench.prepare_by_platform import prepare_by_platform
from mqbench.utils.state import enable_calibration, enable_quantization

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHECK = """
<script>
window.addEventListener("load", () => {
  const size = i => (i.complete ? i.naturalWidth + "x" + i.naturalHeight : "pending");
  const images = [...document.images].map(i => i.id + ":" + size(i));
  document.body.setAttribute("data-images", images.join(" "));
});
</script>
"""


def _render(html_file, tmp_path):
    assert CHROMIUM, "headless Chromium is needed to check the report (the Makefile installs Debian's chromium)"
    checked = tmp_path / "checked.html"
    checked.write_text(html_file.read_text().replace("</body>", CHECK + "</body>"))
    flags = ["--headless=new", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000"]
    dom = subprocess.run(
        [CHROMIUM, *flags, "--dump-dom", checked.as_uri()], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    shot = tmp_path / "report.png"
    subprocess.run(
        [CHROMIUM, *flags, f"--screenshot={shot}", "--window-size=1200,2000", html_file.as_uri()],
        capture_output=True,
        timeout=120,
        check=True,
    )
    return dom, shot


def test_the_report_renders_in_a_browser_with_every_plot(ptq_example_run, tmp_path):
    from PIL import Image

    run, code = ptq_example_run
    assert code == 0
    dom, shot = _render(run / "report.html", tmp_path)
    images = dict(item.split(":") for item in re.search(r'data-images="([^"]*)"', dom).group(1).split())
    assert set(images) == {"plot-accuracy", "plot-layer_errors", "plot-lsb"}
    for name, size in images.items():
        width, height = (int(v) for v in size.split("x"))
        assert width > 100 and height > 100, (name, size)  # decoded PNGs, not broken images
    results = json.loads((run / "results.json").read_text())
    assert f"{100 * results['accuracy']['deployed']:.2f} %" in dom
    with Image.open(shot) as picture:
        colours = picture.convert("RGB").getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 50  # the page drew text and plots, not a blank canvas


def test_layer_errors_are_the_sqnr_of_each_quantized_tensor():
    model = zoo_model("resnet18").model
    qmodel = prepare_by_platform(model, "tensorrt")
    images = zoo_model("resnet18").calibration[:16]
    enable_calibration(qmodel)
    with torch.no_grad():
        qmodel(images)
    enable_quantization(qmodel)
    rows = {row["tensor"]: row for row in layer_errors(qmodel, images)}
    layer = dict(qmodel.named_modules())["conv1"]
    quantizer = layer.weight_fake_quant
    scale, zero_point = (t.detach().numpy().astype(np.float64) for t in quantizer.export_qparams())
    weight = layer.folded_weight_and_bias()[0] if hasattr(layer, "folded_weight_and_bias") else layer.weight
    w = weight.detach().numpy().astype(np.float64)
    s, z = scale.reshape(-1, 1, 1, 1), zero_point.reshape(-1, 1, 1, 1)
    q = (np.clip(np.round(w / s) + z, quantizer.quant_min, quantizer.quant_max) - z) * s
    expected = 10 * math.log10((w**2).sum() / ((q - w) ** 2).sum())
    assert rows["conv1"]["kind"] == "weight" and rows["conv1"]["bits"] == 8
    assert abs(rows["conv1"]["sqnr_db"] - expected) < 0.01
    # an activation: the network input's quantizer sees the images themselves in both models
    act = dict(qmodel.named_modules())["x_post_act_fake_quantizer"]
    scale, zero_point = (float(t.detach().reshape(-1)[0]) for t in act.export_qparams())
    x = images.numpy().astype(np.float64)
    xq = (np.clip(np.round(x / scale) + zero_point, act.quant_min, act.quant_max) - zero_point) * scale
    expected = 10 * math.log10((x**2).sum() / ((xq - x) ** 2).sum())
    assert rows["x_post_act_fake_quantizer"]["kind"] == "activation"
    assert abs(rows["x_post_act_fake_quantizer"]["sqnr_db"] - expected) < 0.01
