"""Ray Data batch inference: a local cluster of two actors returns what one process's engine returns."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import ray
import torch

import hf_paged
from hf_paged.integrations import ray_data
from tiny_models import make_model, word_tokenizer

TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
                                       "OMP_NUM_THREADS": "1"}})
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("ray") / "llama"
    make_model("llama", seed=4).save_pretrained(path)
    word_tokenizer().save_pretrained(path)
    return path


def prompts(count: int, seed: int) -> list[str]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 24, (count,), generator=gen)
    return [" ".join(f"w{int(t)}" for t in torch.randint(3, 256, (int(n),), generator=gen)) for n in lengths]


def one_process(model_dir, texts, **settings):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    return hf_paged.LLM(model, AutoTokenizer.from_pretrained(model_dir)).generate(texts, **settings)


def dataset(texts):
    return ray.data.from_items([{"prompt": p, "i": i} for i, p in enumerate(texts)])


@pytest.mark.parametrize("settings", [dict(max_new_tokens=7),
                                      dict(max_new_tokens=5, do_sample=True, top_k=30, seed=9, num_return_sequences=2)],
                         ids=["greedy", "sampled-n2"])
def test_two_actors_return_one_process_outputs_in_order(cluster, model_dir, settings):
    texts = prompts(20, seed=1)
    want = one_process(model_dir, texts, **settings)
    rows = ray_data.generate(dataset(texts), str(model_dir), concurrency=2, batch_size=3, **settings).take_all()
    assert [r["i"] for r in rows] == list(range(len(texts)))
    n = settings.get("num_return_sequences", 1)
    for row, out in zip(rows, want):
        ids = [list(map(int, x)) for x in row["generated_token_ids"]] if n > 1 else [list(map(int, row["generated_token_ids"]))]
        assert ids == [c.token_ids for c in out.outputs]
        texts_got = list(row["generated_text"]) if n > 1 else [row["generated_text"]]
        assert texts_got == [c.text for c in out.outputs]
        assert row["error"] is None
    summary = ray_data.actor_summary(rows)
    assert 1 <= len(summary) <= 2, summary          # Ray may hand every batch to the actor that started first
    assert sum(s["requests"] for s in summary.values()) == len(texts)
    assert sum(s["generated_tokens"] for s in summary.values()) == sum(len(c.token_ids) for o in want for c in o.outputs)


def test_dead_actor_batch_is_retried_nothing_lost_or_duplicated(cluster, model_dir, tmp_path):
    from ray_actors import DiesOnce

    texts = prompts(12, seed=2)
    want = one_process(model_dir, texts, max_new_tokens=6)
    marker = tmp_path / "died"
    rows = ray_data.generate(dataset(texts), str(model_dir), concurrency=2, batch_size=2, max_new_tokens=6,
                             actor_class=DiesOnce, marker=str(marker), fail_index=5).take_all()
    assert marker.exists(), "the actor was meant to die once"
    assert [r["i"] for r in rows] == list(range(len(texts)))
    assert [list(map(int, r["generated_token_ids"])) for r in rows] == [o.outputs[0].token_ids for o in want]


def test_request_that_cannot_fit_is_a_row_with_its_error(cluster, model_dir):
    texts = ["w5 w6", " ".join(["w7"] * 600)]            # the second exceeds the tiny model's 512 positions
    rows = ray_data.generate(dataset(texts), str(model_dir), concurrency=1, batch_size=2, max_new_tokens=4).take_all()
    assert rows[0]["error"] is None and len(rows[0]["generated_token_ids"]) == 4
    assert rows[1]["finish_reason"] == "error" and "exceeds the model's context" in rows[1]["error"]


def test_a_row_that_cannot_be_a_request_fails_alone(model_dir):
    """An empty prompt, a token outside the vocabulary or a bad setting is that row's error, not the batch's (the
    engine's calls are all or none); a null in an int settings column (NaN, its other values floats) leaves the
    setting to the options. No cluster: the actor class called as Ray Data calls it."""
    import numpy as np
    actor = ray_data.PagedGenerator(str(model_dir), max_new_tokens=3, row_settings=("max_new_tokens",))
    prompts = np.empty(5, dtype=object)
    prompts[:] = ["w5 w6", "", [5, 10**6], "w7", "w8 w9"]
    out = actor({"prompt": prompts, "max_new_tokens": np.array([2.0, 4.0, 4.0, np.nan, -1.0])})
    assert [len(ids) if ids is not None else None for ids in out["generated_token_ids"]] == [2, None, None, 3, None]
    assert list(out["finish_reason"][1:3]) == ["error", "error"] and "empty prompt" in out["error"][1]
    assert "outside the model's vocabulary" in out["error"][2] and "max_new_tokens" in out["error"][4]
    alone = actor({"prompt": prompts[[0, 3]], "max_new_tokens": np.array([2.0, np.nan])})
    assert list(map(list, alone["generated_token_ids"])) == list(map(list, out["generated_token_ids"][[0, 3]]))


def test_missing_prompt_column_is_named(model_dir):
    actor = ray_data.PagedGenerator(str(model_dir), max_new_tokens=2)
    with pytest.raises(KeyError, match="no 'prompt' column"):
        actor({"text": ["w5"]})
    out = actor({"prompt": ["w5 w9"]})
    assert len(out["generated_token_ids"][0]) == 2


def test_importing_the_integration_imports_no_ray():
    code = ("import sys, hf_paged, hf_paged.integrations.ray_data, hf_paged.integrations.ray_serve; "
            "assert 'ray' not in sys.modules, 'ray imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
