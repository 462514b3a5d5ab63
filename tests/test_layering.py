"""The package reads top-down: the core (``hf_paged/``) never imports the integrations, and no module
imports, even inside a function, one that leads back to it."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# folder -> package name, as setup.py installs them
LAYOUT = {"hf_paged": ROOT / "hf_paged", "hf_paged.integrations": ROOT / "integrations"}
# The application layer on top of both: the public face and the demo (which loads SmolLM2).
APPS = {"hf_paged", "hf_paged.demo", "hf_paged.cli", "hf_paged.__main__"}


def _modules() -> dict[str, Path]:
    found = {}
    for package, folder in LAYOUT.items():
        for path in folder.rglob("*.py"):
            if package == "hf_paged" and path.is_relative_to(LAYOUT["hf_paged.integrations"]):
                continue
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every hf_paged module ``name`` imports, at module level or inside functions."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in node.names]
        else:
            continue
        out.update(t for t in targets if t in known)
    return out


def _graph():
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def test_the_core_never_imports_the_integrations():
    graph = _graph()
    offenders = {name: sorted(t for t in targets if t.startswith("hf_paged.integrations"))
                 for name, targets in graph.items()
                 if not name.startswith("hf_paged.integrations") and name not in APPS}
    offenders = {k: v for k, v in offenders.items() if v}
    assert not offenders, f"core modules importing integrations: {offenders}"
    assert len(graph) > 20, "the module scan found too little"


def test_no_import_cycles():
    graph = _graph()
    graph.pop("hf_paged")     # the public face re-exports everything; nothing inside imports it
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            if nxt in graph and not state.get(nxt):
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if not state.get(node):
            visit(node)


def test_the_kernel_folder_leaves_nvidias_cuda_namespace_importable(tmp_path):
    """From the repository root, ``cuda/`` (our kernel sources, installed as ``hf_paged.cuda``) is also the
    top-level ``cuda``: it must not hide NVIDIA's namespace package of that name (``cuda.pathfinder``, which
    CuPy 14 imports on import; ``cuda.bindings``). A stand-in portion later on sys.path stays importable."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    (tmp_path / "cuda" / "pathfinder").mkdir(parents=True)             # a namespace portion, as NVIDIA's
    (tmp_path / "cuda" / "pathfinder" / "__init__.py").write_text("FOUND = True\n")
    code = ("import sys; sys.path[:0] = [sys.argv[1], sys.argv[2]]; import cuda.pathfinder; "
            "assert cuda.pathfinder.FOUND; import hf_paged.cuda")
    done = subprocess.run([sys.executable, "-c", code, str(ROOT), str(tmp_path)], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
