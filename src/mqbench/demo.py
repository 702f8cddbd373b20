"""The demo (:mod:`mqbench.app.demo`) and its training helpers (:mod:`mqbench.app.training`), by their old path."""

from mqbench.app.demo import DemoRow, format_table, run_demo
from mqbench.app.training import academic_config, calibrate, evaluate, train

__all__ = ["DemoRow", "academic_config", "calibrate", "evaluate", "format_table", "run_demo", "train"]
