"""Shared fixtures."""

import pytest
from hypothesis import settings

# Timing deadlines flake on a shared 2-core machine; the properties are what is tested.
settings.register_profile("mqbench", deadline=None)
settings.load_profile("mqbench")


@pytest.fixture(params=[False, True], ids=["torchscript", "dynamo"])
def dynamo(request):
    return request.param


def pytest_report_header(config):
    """The facts that decide int8 results on this host, at the top of every run's output."""
    from mqbench.utils.host import describe_host

    return describe_host()
