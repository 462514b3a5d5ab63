"""Smoke test of an installed (non-editable) hf_paged, run by .ci/wheel_check.sh from outside the source tree.

    python wheel_smoke.py [--source REPO_ROOT]

Checks, one line each, then ``wheel smoke: N passed, M failed`` (exit status 1 on any failure):
  contents  (with --source) every module and .cu/.cuh file of the source tree is in the installed
            package, no source folder with .py files lacks its __init__.py, nothing else is installed
            next to hf_paged/, LICENSE and License-Expression are in the metadata
  import    every module of the installed package imports (pkgutil.walk_packages; nothing skipped:
            optional dependencies such as cupy are imported lazily, so every module must import), and
            every hf_paged module loaded (here and, at the end, by the checks below) comes from it
  cuda      the .cu/.cuh kernel sources are package data of hf_paged.cuda (importlib.resources)
  patch     hf_paged.patch(model); generate(cache_implementation="paged") == plain generate
  engine    hf_paged.LLM(model).generate(prompts) == plain generate, prompt by prompt
  pipeline  hf_paged.pipeline(...)(prompts) == the stock transformers pipeline, prompt by prompt

Self-contained on purpose (no import from tests/): a tiny random Llama and an offline word-level
tokenizer are built here.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.resources
import os
import pkgutil
import sys
import traceback
from pathlib import Path

DIST = "hf-paged"
# import name -> source folder; the same layout as setup.py's PACKAGE_DIR
SOURCE_LAYOUT = {"hf_paged": "hf_paged", "hf_paged.integrations": "integrations", "hf_paged.cuda": "cuda"}
KERNEL_SUFFIXES = (".cu", ".cuh")

VOCAB, PAD, EOS, BOS = 128, 0, 1, 2
MAX_NEW = 8
PROMPT_LENGTHS = (5, 3)          # two prompts of different lengths: the batch is left-padded


class CheckFailed(Exception):
    pass


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


# ------------------------------------------------------------------------------------------ package
def installed_root() -> Path:
    import hf_paged

    return Path(hf_paged.__file__).resolve().parent


def check_contents(source: Path) -> str:
    """Modules and kernel sources of the source tree vs the installed files (the dist's RECORD)."""
    expected_modules, expected_data, no_init = set(), set(), []
    for name, folder in SOURCE_LAYOUT.items():
        base = source / folder
        # Python files in a folder without __init__.py: not packaged (setup.py's rule), yet an editable
        # install imports such a folder as a namespace package, so only the wheel would lack it.
        no_init += sorted(str(d.relative_to(source)) for d in {f.parent for f in base.rglob("*.py")}
                          if not (d / "__init__.py").is_file())
        for init in sorted(base.rglob("__init__.py")):
            pkg_dir = init.parent
            rel = pkg_dir.relative_to(base)
            # a package only if every folder from the root down has an __init__.py (find_packages' rule)
            if any(not (base / Path(*rel.parts[:i]) / "__init__.py").is_file() for i in range(len(rel.parts))):
                continue
            pkg = ".".join((name, *rel.parts))
            for f in pkg_dir.iterdir():
                if f.suffix == ".py":
                    expected_modules.add(pkg if f.name == "__init__.py" else f"{pkg}.{f.stem}")
        if name == "hf_paged.cuda":
            expected_data |= {f.name for f in base.iterdir() if f.suffix in KERNEL_SUFFIXES}

    dist = importlib.metadata.distribution(DIST)
    files = [str(f) for f in dist.files or ()]
    expect(bool(files), f"{DIST}: no RECORD in {dist._path}")   # noqa: SLF001
    installed_modules = set()
    for f in files:
        parts = Path(f).parts
        if parts[0] == "hf_paged" and f.endswith(".py"):
            mod = ".".join(Path(f).with_suffix("").parts)
            installed_modules.add(mod[: -len(".__init__")] if mod.endswith(".__init__") else mod)
    installed_data = {Path(f).name for f in files
                      if Path(f).parts[:2] == ("hf_paged", "cuda") and Path(f).suffix in KERNEL_SUFFIXES}
    top = {Path(f).parts[0] for f in files}
    stray = sorted(t for t in top if t != "hf_paged" and not t.endswith(".dist-info") and t != "..")
    missing = sorted(expected_modules - installed_modules)
    extra = sorted(installed_modules - expected_modules)
    missing_data = sorted(expected_data - installed_data)
    licence = [f for f in files if ".dist-info/" in f and Path(f).name == "LICENSE"]
    problems = []
    if no_init:
        problems.append(f"folders with .py files but no __init__.py (left out of the wheel): {no_init}")
    if missing:
        problems.append(f"modules of the source tree missing from the wheel: {missing}")
    if extra:
        problems.append(f"modules in the wheel but not in the source tree (stale build?): {extra}")
    if missing_data:
        problems.append(f"kernel sources missing from the wheel: {missing_data}")
    if stray:
        problems.append(f"top-level entries besides hf_paged/: {stray}")
    if not licence:
        problems.append("no LICENSE in the dist-info")
    expression = dist.metadata.get("License-Expression")
    if expression != "Apache-2.0":
        problems.append(f"License-Expression is {expression!r}, want 'Apache-2.0'")
    expect(not problems, "; ".join(problems))
    return (f"{len(installed_modules)} modules, {len(installed_data)} kernel sources, {licence[0]}, "
            f"License-Expression {expression}")


def check_imports() -> str:
    import hf_paged

    root = installed_root()
    failed, imported = {}, []

    def onerror(name):               # a package walk_packages could not import (already recorded below)
        failed.setdefault(name, "".join(traceback.format_exception_only(*sys.exc_info()[:2])).strip())

    for info in pkgutil.walk_packages(hf_paged.__path__, "hf_paged.", onerror=onerror):
        try:
            module = importlib.import_module(info.name)
        except (Exception, SystemExit) as exc:   # noqa: BLE001 - report every failure, whatever it is
            tb = traceback.extract_tb(exc.__traceback__)
            where = f" ({tb[-1].filename}:{tb[-1].lineno})" if tb else ""
            failed[info.name] = f"{type(exc).__name__}: {exc}{where}"
            continue
        where = Path(getattr(module, "__file__", "") or "").resolve()
        if root not in where.parents:
            failed[info.name] = f"imported from {where}, not from the installed package {root}"
            continue
        imported.append(info.name)
    expect(not failed, f"{len(failed)} of {len(failed) + len(imported)} modules failed: "
           + " | ".join(f"{name}: {why}" for name, why in sorted(failed.items())))
    expect(len(imported) > 1, f"walk_packages found only {imported}")
    check_origins()
    return f"{len(imported) + 1} modules from {root}"


def check_origins() -> None:
    """Every hf_paged module loaded so far comes from the installed package (not from a source tree
    reached through an editable install's import hook or PYTHONPATH)."""
    root = installed_root()
    outside = {name: getattr(m, "__file__", None) for name, m in list(sys.modules.items())
               if (name == "hf_paged" or name.startswith("hf_paged.")) and m is not None
               and root not in Path(getattr(m, "__file__", None) or "/").resolve().parents}
    expect(not outside, f"modules loaded from outside the installed package {root}: {outside}")


def check_cuda_sources() -> str:
    names = sorted(p.name for p in importlib.resources.files("hf_paged.cuda").iterdir()
                   if p.name.endswith(KERNEL_SUFFIXES))
    expect(any(n.endswith(".cu") for n in names), f"no .cu file in hf_paged.cuda (found {names})")
    expect(any(n.endswith(".cuh") for n in names), f"no .cuh file in hf_paged.cuda (found {names})")
    for n in names:
        text = importlib.resources.files("hf_paged.cuda").joinpath(n).read_text()
        expect(len(text) > 0, f"hf_paged.cuda/{n} is empty")
    return ", ".join(names)


# --------------------------------------------------------------------------------------- generation
def tiny_model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256,
                         pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = EOS
    return model


def word_tokenizer():
    """Offline word-level tokenizer over the tiny vocabulary: token i is the word 'w<i>'."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(3, VOCAB)}
    vocab.update({"<pad>": PAD, "</s>": EOS, "<s>": BOS})
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", bos_token="<s>")
    tok.padding_side = "left"
    return tok


def prompts() -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def left_padded(rows):
    import torch

    width = max(map(len, rows))
    ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, row in enumerate(rows):
        ids[r, width - len(row):] = torch.tensor(row)
        mask[r, width - len(row):] = 1
    return ids, mask


def plain_generate(model, ids, mask, **extra):
    import torch

    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False,
                             pad_token_id=PAD, **extra)
    return out if isinstance(out, torch.Tensor) else out.sequences


def same(a, b, what: str) -> None:
    import torch

    expect(tuple(a.shape) == tuple(b.shape) and torch.equal(a, b), f"{what}: got {a.tolist()}, want {b.tolist()}")


def check_patch(model) -> str:
    import hf_paged

    ids, mask = left_padded(prompts())
    want = plain_generate(model, ids, mask)
    hf_paged.patch(model)
    try:
        got = plain_generate(model, ids, mask, cache_implementation="paged")
    finally:
        hf_paged.unpatch(model)
    same(got, want, "patched generate(cache_implementation='paged')")
    return f"batch {tuple(ids.shape)} left-padded, {got.shape[1] - ids.shape[1]} new tokens, token-for-token"


def check_engine(model) -> str:
    import torch

    import hf_paged

    rows = prompts()
    outs = hf_paged.LLM(model).generate(rows, max_new_tokens=MAX_NEW, do_sample=False)
    expect(len(outs) == len(rows), f"{len(outs)} outputs for {len(rows)} prompts")
    for i, (row, out) in enumerate(zip(rows, outs)):
        ids = torch.tensor([row])
        same(out.sequences, plain_generate(model, ids, torch.ones_like(ids)), f"engine request {i}")
    return f"{len(rows)} requests, each == generate on its prompt alone"


def check_pipeline(model) -> str:
    from transformers import pipeline

    import hf_paged

    tok = word_tokenizer()
    texts = [" ".join(f"w{t}" for t in row) for row in prompts()]
    kw = dict(max_new_tokens=MAX_NEW, do_sample=False)
    stock = pipeline("text-generation", model=model, tokenizer=tok)
    want = [stock(t, **kw) for t in texts]
    paged = hf_paged.pipeline("text-generation", model=model, tokenizer=tok)
    got = paged(texts, **kw)
    expect(got == want, f"hf_paged.pipeline gave {got}, the stock pipeline {want}")
    stats = paged.engine_stats()
    finished = stats.get("requests_finished") if isinstance(stats, dict) else getattr(stats, "requests_finished", None)
    expect(finished is None or finished == len(texts),
           f"the engine finished {finished} requests for {len(texts)} prompts (did the list take the engine path?)")
    return f"{len(texts)} text prompts == stock pipeline" + ("" if finished is None else ", through the engine")


# --------------------------------------------------------------------------------------------- main
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, help="repository root: check the wheel holds all of its modules")
    args = parser.parse_args()

    checks = []
    if args.source is not None:
        checks.append(("contents", lambda: check_contents(args.source.resolve())))
    checks += [("import", check_imports), ("cuda", check_cuda_sources)]
    model = None

    def with_model(fn):
        def run():
            nonlocal model
            if model is None:
                model = tiny_model()
            return fn(model)
        return run

    checks += [("patch", with_model(check_patch)), ("engine", with_model(check_engine)),
               ("pipeline", with_model(check_pipeline))]

    passed = failed = 0
    import_error = None
    for name, fn in checks:
        try:
            if import_error is not None and name != "contents":
                raise CheckFailed(f"not run: import hf_paged failed ({import_error})")
            detail = fn()
        except CheckFailed as exc:
            failed += 1
            print(f"FAIL  {name}: {exc}", flush=True)
        except (Exception, SystemExit) as exc:   # noqa: BLE001 - one check's error must not hide the others
            failed += 1
            print(f"FAIL  {name}: {type(exc).__name__}: {exc}", flush=True)
            traceback.print_exc(limit=-4, file=sys.stdout)
        else:
            passed += 1
            print(f"PASS  {name}: {detail}", flush=True)
        if name == "import" and "hf_paged" not in sys.modules:
            import_error = _where()
    try:                               # the generate checks may have loaded modules the walk did not see
        if import_error is None:
            check_origins()
    except (Exception, SystemExit) as exc:   # noqa: BLE001
        failed += 1
        print(f"FAIL  origins: {exc}", flush=True)
    print(f"wheel smoke: {passed} passed, {failed} failed (hf_paged from {_where()}, python {sys.executable})")
    return 1 if failed else 0


def _where() -> str:
    try:
        return str(installed_root())
    except (Exception, SystemExit) as exc:   # noqa: BLE001
        return f"<import failed: {type(exc).__name__}: {exc}>"


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
