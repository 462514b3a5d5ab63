"""Shared fixtures; the model and batch helpers live in tiny_models.py."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_models import FAMILIES  # noqa: E402


@pytest.fixture(params=sorted(FAMILIES))
def family(request):
    return request.param
