"""MQBench's module name for the fusion tables; see :mod:`mqbench.fuser_method_mapping`."""

from mqbench.fuser_method_mapping import (
    FUSER_METHODS,
    QAT_MODULE_MAPPING,
    fuse_conv_freezebn,
    fuse_conv_freezebn_relu,
    fuse_custom_config_dict,
    fuse_deconv_bn,
    fuse_deconv_bn_relu,
    fuse_deconv_freezebn,
    fuse_deconv_freezebn_relu,
    fuse_linear_bn,
)

__all__ = [
    "FUSER_METHODS",
    "QAT_MODULE_MAPPING",
    "fuse_conv_freezebn",
    "fuse_conv_freezebn_relu",
    "fuse_custom_config_dict",
    "fuse_deconv_bn",
    "fuse_deconv_bn_relu",
    "fuse_deconv_freezebn",
    "fuse_deconv_freezebn_relu",
    "fuse_linear_bn",
]
