"""The qparam table types, where deployment code has always imported them (they live in :mod:`mqbench.qparams`)."""

from mqbench.qparams import GRIDS, KINDS, QParamTable, TensorQParams, pot_exponent

__all__ = ["GRIDS", "KINDS", "QParamTable", "TensorQParams", "pot_exponent"]
