"""A small CNN trained on the 8x8 digits, shared by the reconstruction tests (trained once per session)."""

from __future__ import annotations

import pytest
import torch

from mqbench.app.training import train
from mqbench.data import load_digits_split
from mqbench.models import DigitsCNN


@pytest.fixture(scope="session")
def trained_digits_cnn():
    """(model, train split, test split): DigitsCNN after 6 epochs on the training split."""
    torch.manual_seed(0)
    train_split, test_split = load_digits_split()
    return train(DigitsCNN(), train_split, epochs=6, lr=3e-3), train_split, test_split
