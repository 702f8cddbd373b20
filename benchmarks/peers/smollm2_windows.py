"""SmolLM2-135M-Instruct's token windows for the peer benchmarks, drawn by this project (run in the project's venv).

Writes a ``.pt`` file ``{"calibration": LongTensor[n, 256], "evaluation": LongTensor[m, 257], "draws": {...}}``
with the same draws as ``benchmarks/llm_quantization.py --parts smollm2``:

* evaluation: ``text_windows(tokenizer, 257, 16, held_out=True, seed=1000)``, windows of 257 tokens of the standard
  library's held-out files: each predicts its tokens 1..256 from tokens 0..255, as the benchmark's
  ``window_perplexity`` does (16 x 256 predicted tokens);
* calibration: ``text_windows(tokenizer, 256, n, held_out=False, seed=1)``, windows of 256 tokens of the training
  files. The benchmark's draw 1 is the same call with n = 16; the seeded offsets come in order, so any n >= 16
  starts with exactly those 16 windows.

It prints the GGUF file that the peers load (``smollm2_path()``).

Run: .venv/bin/python benchmarks/peers/smollm2_windows.py [--calibration 32] [--evaluation 16] [--out FILE]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from mqbench.models.smollm2 import load_smollm2, smollm2_path, text_windows

HERE = Path(__file__).resolve().parent
EVALUATION = {"length": 257, "count": 16, "held_out": True, "seed": 1000}
CALIBRATION = {"length": 256, "held_out": False, "seed": 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibration", type=int, default=32, help="calibration windows of 256 tokens")
    parser.add_argument("--evaluation", type=int, default=EVALUATION["count"], help="held-out windows of 257 tokens")
    parser.add_argument("--out", type=Path, default=HERE / ".work" / "smollm2_windows.pt")
    args = parser.parse_args()

    _, tokenizer = load_smollm2()
    evaluation = text_windows(tokenizer, EVALUATION["length"], args.evaluation, held_out=True, seed=EVALUATION["seed"])
    calibration = text_windows(
        tokenizer, CALIBRATION["length"], args.calibration, held_out=False, seed=CALIBRATION["seed"]
    )
    draws = {
        "calibration": {**CALIBRATION, "count": args.calibration},
        "evaluation": {**EVALUATION, "count": args.evaluation},
        "source": "mqbench.models.smollm2.text_windows (standard library source: training / held-out files)",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"calibration": calibration, "evaluation": evaluation, "draws": draws}, args.out)
    print(f"calibration {tuple(calibration.shape)}, evaluation {tuple(evaluation.shape)} -> {args.out}")
    print(f"GGUF: {smollm2_path()}")


if __name__ == "__main__":
    main()
