"""Shared fixtures."""

import pytest


@pytest.fixture(params=[False, True], ids=["torchscript", "dynamo"])
def dynamo(request):
    return request.param
