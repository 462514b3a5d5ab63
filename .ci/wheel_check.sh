#!/usr/bin/env bash
# Wheel check: build the wheel from the working tree, install it (not editable) into a throwaway venv
# and, from a directory outside the source tree, import every module and run a smoke generate through
# patch, the engine and the pipeline (.ci/wheel_smoke.py).
#
# The venv sees this python's site-packages (torch, transformers, ...: nothing is downloaded) through
# plain path entries in a .pth file, NOT through --system-site-packages: that would also run the .pth
# hooks there, among them the editable install's import finder, which answers for any hf_paged
# submodule the wheel lacks (a wheel missing hf_paged.engine would still import, from the source tree).
# The venv's own site-packages comes first, and the check fails unless hf_paged resolves inside it.
# Nothing is installed into this python.
# Everything happens in a mktemp directory (removed at exit; KEEP_WHEEL_CHECK=1 keeps it).
#   PYTHON=...                 the python to build with and to layer the venv on (default: python)
#   WHEEL_CHECK_ISOLATION=1    build in an isolated environment (fetches setuptools from PyPI); the
#                              default builds with this python's setuptools when it is recent enough (>=77)
set -euo pipefail
export PIP_DISABLE_PIP_VERSION_CHECK=1
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-python}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/hf_paged-wheel-check.XXXXXX")"
cleanup() {
    if [[ "${KEEP_WHEEL_CHECK:-0}" == 1 ]]; then echo "wheel check: kept $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
fail() { echo "wheel check: FAILED: $*" >&2; exit 1; }

# 1. A snapshot of the working tree as a fresh clone would have it (tracked and untracked files, not the
#    ignored ones): no stale build/ or *.egg-info can leak into the wheel, and concurrent edits do not
#    change the tree halfway through the build.
mkdir "$WORK/src" "$WORK/dist" "$WORK/run"
if git -C "$ROOT" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    (cd "$ROOT" && git ls-files -z --cached --others --exclude-standard) |
        while IFS= read -r -d '' f; do if [[ -f "$ROOT/$f" ]]; then printf '%s\0' "$f"; fi; done |
        tar -C "$ROOT" --null -T - -cf - | tar -C "$WORK/src" -xf -
else
    cp -a "$ROOT/." "$WORK/src/"
    rm -rf "$WORK/src/build" "$WORK/src/dist" "$WORK/src"/*.egg-info "$WORK/src"/.venv*
fi

# 2. Build the wheel.
build_flags=(--no-deps -q -w "$WORK/dist")
if [[ "${WHEEL_CHECK_ISOLATION:-0}" != 1 ]] &&
   "$PYTHON" -c 'import setuptools, sys; sys.exit(int(setuptools.__version__.split(".")[0]) < 77)' 2>/dev/null; then
    build_flags+=(--no-build-isolation)
fi
"$PYTHON" -m pip wheel "${build_flags[@]}" "$WORK/src" || fail "pip wheel ${build_flags[*]} could not build the wheel"
shopt -s nullglob
wheels=("$WORK"/dist/hf_paged-*.whl)
shopt -u nullglob
[[ ${#wheels[@]} -eq 1 ]] || fail "expected one hf_paged wheel in $WORK/dist, found: $(ls "$WORK/dist")"
WHEEL="${wheels[0]}"
echo "wheel check: built $(basename "$WHEEL") ($(du -k "$WHEEL" | cut -f1) KiB; ${build_flags[*]})"

# 3. Install it, not editable, into a throwaway venv that sees this python's packages but none of its
#    .pth hooks (see the top).
"$PYTHON" -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
SITE="$(cd "$WORK/run" && env -u PYTHONPATH "$VPY" -c 'import os, sysconfig; print(os.path.realpath(sysconfig.get_paths()["purelib"]))')"
(cd "$WORK/run" && env -u PYTHONPATH "$PYTHON" -c '
import os, site, sysconfig
dirs = [*site.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
if site.ENABLE_USER_SITE:
    dirs.append(site.getusersitepackages())
seen = []
for d in dirs:
    if os.path.isdir(d) and os.path.realpath(d) not in seen:
        seen.append(os.path.realpath(d))
print("\n".join(seen))') > "$SITE/zz_outer_site_packages.pth"
"$VPY" -m pip install -q --no-deps --force-reinstall --ignore-installed "$WHEEL"
FOUND="$(cd "$WORK/run" && env -u PYTHONPATH "$VPY" -c '
import importlib.util, os, sys
hooks = [f for f in sys.meta_path if "editable" in (getattr(f, "__module__", "") or "") + repr(f)]
assert not hooks, f"editable import hooks active in the venv: {hooks}"
s = importlib.util.find_spec("hf_paged")
print(os.path.realpath(s.origin) if s and s.origin else s)')" || fail "the venv is not clean (see above)"
[[ "$FOUND" == "$SITE/hf_paged/__init__.py" ]] ||
    fail "in the venv, hf_paged resolves to $FOUND, not to the installed wheel in $SITE (an editable install or PYTHONPATH shadows it)"
echo "wheel check: installed into $WORK/venv (hf_paged from $SITE/hf_paged; this python's site-packages as plain paths)"

# 4. Smoke test from outside the source tree (the script is copied there, so sys.path[0] holds no hf_paged).
cp "$ROOT/.ci/wheel_smoke.py" "$WORK/run/"
cd "$WORK/run"
env -u PYTHONPATH HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$VPY" wheel_smoke.py --source "$WORK/src" ||
    fail "the smoke test of the installed wheel failed (see the FAIL lines above)"
echo "wheel check: OK"
