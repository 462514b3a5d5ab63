"""The OpenAI-compatible server as a Ray Serve deployment: two replicas answer what one engine answers."""
from __future__ import annotations

import socket

import openai
import pytest
import ray
from ray import serve
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_paged
from hf_paged.integrations import ray_serve
from tiny_models import make_model, word_tokenizer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    path = tmp_path_factory.mktemp("serve") / "llama"
    make_model("llama", seed=5).save_pretrained(path)
    word_tokenizer().save_pretrained(path)
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(ray_serve.application(str(path), num_replicas=2, num_cpus=0.5, served_model_name="tiny"),
                  name="hf_paged", route_prefix="/")
        yield path, openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    finally:
        serve.shutdown()
        ray.shutdown()


def test_two_replicas_answer_as_one_engine(deployed):
    path, client = deployed
    replicas = serve.status().applications["hf_paged"].deployments["hf_paged"].replica_states
    assert replicas.get("RUNNING") == 2, replicas
    prompts = ["w5 w9 w11", "w100 w3", " ".join(f"w{i}" for i in range(20, 60))]
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    want = hf_paged.LLM(model, AutoTokenizer.from_pretrained(path)).generate(prompts, max_new_tokens=6)
    for prompt, out in zip(prompts, want):
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0)
        assert got.choices[0].text == out.outputs[0].text
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model="tiny", prompt=prompt, max_tokens=6, temperature=0, stream=True))
        assert streamed == out.outputs[0].text
    assert [m.id for m in client.models.list()] == ["tiny"]


def test_bad_request_is_an_openai_error(deployed):
    _, client = deployed
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="tiny", prompt="w5", max_tokens=-3)


def test_ray_serve_owns_the_address_and_logging():
    with pytest.raises(ValueError, match=r"port=9000: on Ray Serve, set it with serve.start\(http_options"):
        ray_serve.application("unused", port=9000)
    with pytest.raises(ValueError, match="max_num_seqs must be an int >= 1, got 0"):   # now, not at deployment
        ray_serve.application("unused", max_num_seqs=0)
