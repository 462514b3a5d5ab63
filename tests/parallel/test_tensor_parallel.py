"""hf_paged under transformers' tensor parallelism: 2 CPU processes (torchrun, gloo) against one."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tiny_models import make_model

HERE = Path(__file__).parent
# GQA in all three; llama holds 2 KV heads per rank, qwen2 and glm one.
SHAPES = {"llama": dict(num_attention_heads=8, num_key_value_heads=4), "qwen2": {}, "glm": {}}


def torchrun(script: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--standalone", str(script), *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


def test_generate_and_engine_match_one_process(tmp_path):
    for family, shape in SHAPES.items():
        make_model(family, seed=1, **shape).save_pretrained(tmp_path / family)
    run = torchrun(HERE / "tp_worker.py", str(tmp_path))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    for family in SHAPES:
        assert f"tp ok: {family}" in run.stdout


def test_kv_heads_fewer_than_ranks_refused(tmp_path):
    make_model("glm4").save_pretrained(tmp_path / "glm4")      # one KV head, two ranks
    script = tmp_path / "refuse.py"
    # Each rank writes its own file: two ranks printing to one pipe interleave their words.
    script.write_text(
        "import os, sys, hf_paged\n"
        "from pathlib import Path\n"
        "from transformers import AutoModelForCausalLM\n"
        "model = AutoModelForCausalLM.from_pretrained(sys.argv[1], tp_plan='auto')\n"
        "out = Path(sys.argv[2]) / f\"rank{os.environ['RANK']}.txt\"\n"
        "try:\n"
        "    hf_paged.model_geometry(model)\n"
        "    out.write_text('accepted')\n"
        "except hf_paged.families.UnsupportedModelError as e:\n"
        "    out.write_text(f'refused: {e}')\n")
    run = torchrun(script, str(tmp_path / "glm4"), str(tmp_path))
    assert run.returncode == 0, run.stderr[-4000:]
    for rank in range(2):
        said = (tmp_path / f"rank{rank}.txt").read_text()
        assert said.startswith("refused: tensor parallelism over 2 ranks needs num_key_value_heads (1)"), said
