"""Tensor-parallel checks, run by test_tensor_parallel.py under ``torchrun --nproc-per-node 2`` (gloo).

argv: a directory holding one saved tiny model per family (``<dir>/<family>``). Every rank loads each
model twice: sharded (``tp_plan="auto"``) and whole (what one process runs). The sharded, patched
model must generate the tokens the whole model's default path generates — greedy on a left-padded
batch, beam search, sampling with a seed — and the engine on the sharded model must return what the
engine on the whole model returns, with allocator states identical on both ranks after every step.
Any difference raises, so the process exits non-zero and the test fails with the message.
"""
from __future__ import annotations

import os
import sys

import torch
from transformers import AutoModelForCausalLM

import hf_paged
from hf_paged.parallel import tensor_parallel_ranks
from tiny_models import make_batch, sequences


def generate_checks(family: str, solo, tp) -> None:
    ids, mask = make_batch([5, 11, 3, 8], seed=7)
    cases = {
        "greedy": dict(do_sample=False, max_new_tokens=10),
        "beams": dict(do_sample=False, num_beams=3, num_return_sequences=2, max_new_tokens=6),
        "sampling": dict(do_sample=True, top_k=20, temperature=0.9, max_new_tokens=10),
    }
    for name, kwargs in cases.items():
        torch.manual_seed(11)
        want = sequences(solo.generate(input_ids=ids, attention_mask=mask, **kwargs))
        torch.manual_seed(11)       # every rank draws from the same seed, as transformers' TP needs
        got = sequences(tp.generate(input_ids=ids, attention_mask=mask, cache_implementation="paged", **kwargs))
        assert torch.equal(want, got), f"{family} generate {name}: tensor-parallel paged {got.tolist()} != one " \
                                       f"process {want.tolist()}"


def engine_run(model, ranks=None) -> tuple[list, list]:
    """Outputs of a small engine workload (tight pool: preemptions), and the allocator state per step."""
    engine = hf_paged.Engine(model, num_blocks=10, block_size=4, max_num_seqs=4)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (6, 13, 3, 9, 17)]
    for i, prompt in enumerate(prompts):
        settings = dict(max_new_tokens=8, ignore_eos=True)
        if i == 3:
            settings.update(do_sample=True, seed=5, top_p=0.9, num_return_sequences=2)
        engine.add_request(prompt, **settings)
    states = []
    with engine.session():
        while engine.has_work:
            engine.step()
            engine.check_invariants()
            states.append(engine.allocator_state())
            if ranks is not None:
                mine, *others = ranks.gather(states[-1])
                assert all(o == mine for o in others), f"allocator states differ between ranks at step {len(states)}"
    outputs = [[c.token_ids for c in engine.output(r).outputs] for r in range(len(prompts))]
    return outputs, engine.stats()["preemptions"]


def main(root: str) -> None:
    rank = int(os.environ["RANK"])
    for family in sorted(os.listdir(root)):
        path = os.path.join(root, family)
        tp = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto").eval()
        solo = AutoModelForCausalLM.from_pretrained(path).eval()
        ranks = tensor_parallel_ranks(tp)
        assert ranks.size == 2, ranks.size
        geometry = hf_paged.model_geometry(tp)
        assert geometry.num_kv_heads * 2 == solo.config.num_key_value_heads, geometry
        with torch.inference_mode():
            hf_paged.patch(tp)
            generate_checks(family, solo, tp)
            want, _ = engine_run(solo)
            got, preemptions = engine_run(tp, ranks)
            hf_paged.unpatch(tp)
        assert got == want, f"{family} engine: tensor-parallel {got} != one process {want}"
        assert preemptions > 0, f"{family}: the tight pool was meant to force preemptions"
        if rank == 0:
            print(f"tp ok: {family} (local KV heads {geometry.num_kv_heads}, engine preemptions {preemptions})",
                  flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
