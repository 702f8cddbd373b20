"""Shared fixtures."""

import pytest
from hypothesis import settings

# Timing deadlines flake on a shared 2-core machine; the properties are what is tested.
settings.register_profile("mqbench", deadline=None)
settings.load_profile("mqbench")


@pytest.fixture(params=[False, True], ids=["torchscript", "dynamo"])
def dynamo(request):
    return request.param
