"""The verify command's deploy-and-check helpers (:mod:`mqbench.app.check`), by their old path."""

from mqbench.app.check import (
    DeployCheck,
    accuracy,
    deploy_and_verify,
    deployed_runner,
    lsb_tolerance,
    reduce_range_config,
    run_verify_command,
)

__all__ = [
    "DeployCheck",
    "accuracy",
    "deploy_and_verify",
    "deployed_runner",
    "lsb_tolerance",
    "reduce_range_config",
    "run_verify_command",
]
