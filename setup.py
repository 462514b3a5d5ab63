"""Package layout only; every piece of metadata lives in pyproject.toml.

The source folders do not mirror the import names, so the packages cannot be found by setuptools'
automatic discovery: folder ``hf_paged/`` is ``hf_paged``, folder ``integrations/`` is
``hf_paged.integrations`` and folder ``cuda/`` (the .cu/.cuh kernel sources) is ``hf_paged.cuda``.
Every folder with an ``__init__.py`` below one of those roots becomes a subpackage, so a new
subpackage needs no edit here.
"""
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).resolve().parent

# import name -> source folder, relative to this file (setup() wants relative, "/"-separated paths)
PACKAGE_DIR = {
    "hf_paged": "hf_paged",
    "hf_paged.integrations": "integrations",
    "hf_paged.cuda": "cuda",
}


def discover_packages() -> list[str]:
    packages = []
    for name, folder in PACKAGE_DIR.items():
        if not (HERE / folder / "__init__.py").is_file():
            raise SystemExit(f"setup.py: {folder}/__init__.py is missing (package {name})")
        packages.append(name)
        packages += [f"{name}.{sub}" for sub in find_packages(str(HERE / folder))]
    clashes = [p for p in packages if packages.count(p) > 1]
    if clashes:     # e.g. a folder hf_paged/integrations/ next to the top-level integrations/
        raise SystemExit(f"setup.py: packages found in two folders: {sorted(set(clashes))}")
    return sorted(packages)


setup(packages=discover_packages(), package_dir=PACKAGE_DIR)
