import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mqbench.scheme import QuantScheme


@given(bits=st.integers(2, 16))
def test_signed_and_unsigned_ranges(bits):
    assert QuantScheme(bits=bits).quant_range == (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    assert QuantScheme(bits=bits, symmetric_range=True).quant_range == (-(2 ** (bits - 1)) + 1, 2 ** (bits - 1) - 1)
    assert QuantScheme(bits=bits, symmetric=False).quant_range == (0, 2**bits - 1)
    assert QuantScheme(bits=bits, unsigned=True).quant_range == (0, 2**bits - 1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bits": 1}, "between 2 and 16"),
        ({"bits": 17}, "between 2 and 16"),
        ({"bits": 8.0}, "must be an int"),
        ({"bits": True}, "must be an int"),
        ({"symmetric": False, "symmetric_range": True}, "symmetric_range needs symmetric"),
        ({"symmetric_range": True, "unsigned": True}, "cannot both be set"),
        ({"symmetric": False, "unsigned": True}, "unsigned is a symmetric grid"),
        ({"per_channel": True, "ch_axis": None}, "ch_axis must be an int"),
    ],
)
def test_invalid_combinations_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        QuantScheme(**kwargs)


def test_frozen():
    scheme = QuantScheme()
    with pytest.raises(AttributeError):
        scheme.bits = 4  # type: ignore[misc]


def test_observer_kwargs_and_mqbench_dict():
    scheme = QuantScheme.from_dict({"bit": 4, "symmetry": False, "per_channel": True, "pot_scale": False})
    assert scheme == QuantScheme(bits=4, symmetric=False, per_channel=True)
    kwargs = scheme.observer_kwargs()
    assert kwargs["qscheme"] == torch.per_channel_affine
    assert (kwargs["quant_min"], kwargs["quant_max"], kwargs["ch_axis"]) == (0, 15, 0)
    assert QuantScheme().observer_kwargs()["ch_axis"] == -1
    with pytest.raises(ValueError, match=r"unknown quantization scheme key 'bitz'.*valid keys: .*bit"):
        QuantScheme.from_dict({"bitz": 8})


def test_scale_dtype_is_checked_and_reaches_only_quantizers_whose_scale_an_observer_gives():
    from mqbench.backends import QuantizerSpec

    assert QuantScheme(4, per_channel=True, group_size=32, scale_dtype="float16").observer_kwargs()["scale_dtype"] == (
        "float16"
    )
    assert "scale_dtype" not in QuantScheme(4).observer_kwargs()
    with pytest.raises(ValueError, match="scale_dtype must be one of"):
        QuantScheme(4, scale_dtype="float8")
    scheme = QuantScheme(8, per_channel=True, scale_dtype="bfloat16")
    fixed = QuantizerSpec(scheme, "FixedFakeQuantize", "MinMaxObserver").factory()()
    fixed(torch.tensor([[0.3, -1.1], [2.0, 0.01]]))
    assert torch.equal(fixed.scale, fixed.scale.bfloat16().float())
    with pytest.raises(ValueError, match="learns or computes its own scale"):
        QuantizerSpec(scheme, "LearnableFakeQuantize", "MinMaxObserver").factory()()
