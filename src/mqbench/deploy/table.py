"""The qparam table types, where deployment code has always imported them (they live in :mod:`mqbench.qparams`)."""

from mqbench.grids import GRIDS
from mqbench.qparams import KINDS, QParamTable, TensorQParams, pot_exponent

__all__ = ["GRIDS", "KINDS", "QParamTable", "TensorQParams", "pot_exponent"]
