"""Shared fixtures; the model and batch helpers live in tiny_models.py (on pytest's pythonpath)."""
import pytest

from tiny_models import FAMILIES


@pytest.fixture(params=sorted(FAMILIES))
def family(request):
    return request.param
