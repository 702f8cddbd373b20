"""MQBench's module path of ``get_flattened_qconfig_dict`` (see :mod:`mqbench.utils.utils`)."""

from mqbench.utils.utils import get_flattened_qconfig_dict

__all__ = ["get_flattened_qconfig_dict"]
