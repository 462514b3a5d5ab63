"""Fixtures of the integration tests."""
import pytest


@pytest.fixture(scope="session")
def smollm2():
    """``hf_paged.integrations.smollm2``, once its real weights are known to be installed (a missing
    package fails the test with the install command: the real-model tests are never skipped)."""
    from hf_paged.integrations import smollm2 as module

    try:
        module.gguf_path()
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        pytest.fail(f"{exc}\nThis test needs the real weights: {module.INSTALL_COMMAND}", pytrace=False)
    return module
