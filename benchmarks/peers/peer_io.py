"""What every peer script reads: its command line (the model's folder written by ``run.py``, the folder to write
to, the threads) and that folder's ``data.pt``. The peer scripts import it from their own folder; it needs only
torch, which every peer venv has, and never mqbench."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch


def peer_parser(doc: str | None) -> argparse.ArgumentParser:
    """The arguments every peer script takes; a script adds its own before parsing."""
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    parser.add_argument("work", type=Path, help="the model's folder written by run.py (float.pt2, float.onnx, data.pt)")
    parser.add_argument("out", type=Path)
    parser.add_argument("--threads", type=int, default=2)
    return parser


def read_work(args: argparse.Namespace) -> dict[str, Any]:
    """Sets torch's threads and returns ``data.pt``: the calibration and evaluation samples, the float outputs."""
    torch.set_num_threads(args.threads)
    return torch.load(args.work / "data.pt", weights_only=True)
