"""Shared fixtures."""

import os

import pytest
import torch
from hypothesis import settings

# Timing deadlines flake on a shared 2-core machine; the properties are what is tested.
settings.register_profile("mqbench", deadline=None)
settings.load_profile("mqbench")

# The commands keep freed memory in the heap (mqbench.utils.memory); the tests that call them in this
# process must not change the test runner's allocator for every test after them. Tested on its own.
os.environ.setdefault("MQBENCH_KEEP_FREED_MEMORY", "0")

# `make test` runs the suite in one worker process per core (pytest-xdist): each worker then computes
# on one thread, and so do the processes it starts, so that the workers never wait on each other's threads.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


@pytest.fixture(params=[False, True], ids=["torchscript", "dynamo"])
def dynamo(request):
    return request.param


def pytest_report_header(config):
    """The facts that decide int8 results on this host, at the top of every run's output."""
    from mqbench.utils.host import describe_host

    return describe_host()
