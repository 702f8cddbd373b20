"""MQBench's older import path of reconstruction PTQ (its ImageNet example imports it from here).

Example:
    >>> from mqbench.ptq_reconstruction import ptq_reconstruction
    >>> from mqbench.advanced_ptq import ptq_reconstruction as same
    >>> ptq_reconstruction is same
    True
"""

from mqbench.advanced_ptq import ptq_reconstruction

__all__ = ["ptq_reconstruction"]
