"""SASS gate: what the production build really emits, read from the cubins nvrtc_gate compiles.

nvrtc_gate.run_gate compiles every module with the options CuPy uses in production
(nvrtc_gate.production_options); here each model-dtype attention module (every NVRTC x arch pair) and
every module holding a kernel that a rule below names is disassembled with ``cuobjdump -sass`` (PyPI
wheels ``nvidia-cuda-cuobjdump`` and ``nvidia-cuda-nvdisasm``, pip-installed into the NVRTC cache like the NVRTC wheels; CUDA 13's
disassembler reads sm_80/sm_90 cubins of NVRTC 12.x too), its opcodes are counted per kernel, and
RULES are checked: required opcodes (cp.async -> LDGSTS, mma.sync -> HMMA), forbidden ones (local
memory: LDL/STL), no spills, and CTAs per SM at the benchmark shapes from registers and shared memory.

    python tests/backends/sass_gate.py [--full]   # compiles (nvrtc_gate), disassembles, prints, checks

Counts are static (instructions in the kernel's code), not executed instructions.
"""
from __future__ import annotations

import collections
import itertools
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import nvrtc_gate

from hf_paged.backends import kernel_registry as reg

# cuobjdump hands sm_80 cubins of NVRTC 12.x to nvdisasm, so both (the folder name carries the version)
TOOLS_VERSION = "13.4.92"
TOOLS = (f"nvidia-cuda-cuobjdump=={TOOLS_VERSION}", f"nvidia-cuda-nvdisasm=={TOOLS_VERSION}")
TOOLS_BIN = "nvidia/cu13/bin"                 # relative to the tools folder


@dataclass(frozen=True)
class Rule:
    """What every kernel whose name fully matches ``pattern`` must satisfy."""

    pattern: str
    why: str
    require: tuple[tuple[str, ...], ...] = ()   # each tuple: at least one of these opcodes
    forbid: tuple[str, ...] = ()                # none of these opcodes
    no_spill: bool = False                      # ptxas: 0 bytes of stack, spill stores and loads
    min_ctas: int = 0                           # CTAs per SM at every benchmark group it serves
    archs: tuple[str, ...] = ("sm_80", "sm_90")   # where min_ctas is required

    def matches(self, kernel: str) -> bool:
        return re.fullmatch(self.pattern, kernel) is not None

    @property
    def needs_sass(self) -> bool:
        return bool(self.require or self.forbid)


# The new kernels of issue 11 (pipelined CUDA-core decode, tensor-core ragged attention), then the
# older gate's rule for every decode kernel (also checked from ptxas alone by test_nvrtc_gate).
RULES = (
    # >= 2 CTAs/SM required on sm_90 (the benchmark machine, an H200). sm_80 fits one ragged CTA per SM
    # at head dims 128 and 256 (87 and 102 KB of shared memory of 164 KB); Q in registers or a swizzled,
    # unpadded layout would give A100 two. decode_fast fits 3 there.
    Rule(r"hfp_(decode_fast|ragged)_\w+", "new kernels: no local memory, >= 2 CTAs/SM on sm_90 at the benchmark "
         "shapes", forbid=("LDL", "STL"), no_spill=True, min_ctas=2, archs=("sm_90",)),
    Rule(r"hfp_decode_fast_(\w+_)?b?f16_d\d+", "pipelined decode: K/V tiles by cp.async", require=(("LDGSTS",),)),
    Rule(r"hfp_ragged_(\w+_)?b?f16_d\d+", "tensor-core attention: mma.sync and cp.async",
         require=(("HMMA", "HGMMA"), ("LDGSTS",))),
    Rule(rf"hfp_decode_fast_({'|'.join(reg.KV_FORMAT_TAGS.values())})_b?f16_d\d+",
         "quantised fast decode: codes and scales by cp.async", require=(("LDGSTS",),)),
    Rule(rf"hfp_ragged_({'|'.join(reg.KV_FORMAT_TAGS.values())})_b?f16_d\d+",
         "quantised tensor-core extend: codes and scales by cp.async, mma.sync on the dequantised tiles",
         require=(("HMMA", "HGMMA"), ("LDGSTS",))),
    Rule(r"hfp_decode_\w+", "decode never spills", no_spill=True),
)

# Benchmark shapes of issue 11: Llama-3-8B (32 query heads, head dim 128), GQA groups 1/4/8/16.
BENCH_HEAD_DIM = 128
BENCH_GROUPS = (1, 4, 8, 16)


@dataclass(frozen=True)
class ArchLimits:
    """Per-SM limits (CUDA C++ Programming Guide, "Technical Specifications per Compute Capability";
    granularities and the 1 KiB per-CTA reservation as in cuda_occupancy.h)."""

    smem_per_sm: int               # largest shared-memory carveout
    smem_per_cta: int              # opt-in maximum of one CTA (static + dynamic)
    regs_per_sm: int = 65536
    reg_unit: int = 256            # registers are allocated per warp in multiples of this
    sub_partitions: int = 4        # a warp's registers come from one of the 4 sub-partitions
    max_warps: int = 64
    max_ctas: int = 32
    smem_unit: int = 128
    smem_reserved: int = 1024      # per CTA, by the driver (sm_80+)


ARCH_LIMITS = {"sm_80": ArchLimits(164 * 1024, 163 * 1024), "sm_90": ArchLimits(228 * 1024, 227 * 1024)}


def ctas_per_sm(arch: str, registers: int, smem: int, threads: int = reg.THREADS) -> int:
    """Resident CTAs per SM (cudaOccMaxActiveBlocksPerMultiprocessor's arithmetic, default carveout
    preference) for ``registers`` per thread and ``smem`` bytes of static + dynamic shared memory."""
    lim = ARCH_LIMITS[arch]
    warps = -(-threads // 32)
    regs_per_warp = -(-registers * 32 // lim.reg_unit) * lim.reg_unit
    by_regs = (lim.regs_per_sm // lim.sub_partitions // regs_per_warp) * lim.sub_partitions // warps
    smem_alloc = -(-(smem + lim.smem_reserved) // lim.smem_unit) * lim.smem_unit
    if smem > lim.smem_per_cta:
        return 0
    by_smem = lim.smem_per_sm // smem_alloc
    return min(lim.max_ctas, lim.max_warps // warps, by_regs, by_smem)


# --- disassembly ----------------------------------------------------------------------------------

_FUNCTION = re.compile(r"^\s*Function : (\w+)", re.MULTILINE)
# "/*0090*/   @!P0 LDG.E.128.CONSTANT R4, desc[...] ;"  (encoding lines are "/* 0x... */")
_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P[0-9T]\s+)?([A-Z][A-Z0-9_]*)((?:\.[A-Z0-9_]+)*)", re.MULTILINE)


def count_opcodes(sass: str) -> dict[str, collections.Counter]:
    """Static opcode counts per kernel of ``cuobjdump -sass`` text: each base opcode (``LDS``), and
    ``LDS.128`` / ``LDG.128`` / ``STS.128`` for 16-byte accesses, ``MUFU.EX2`` etc. for MUFU."""
    counts: dict[str, collections.Counter] = {}
    starts = [(m.start(), m.group(1)) for m in _FUNCTION.finditer(sass)] + [(len(sass), "")]
    for (begin, kernel), (end, _) in itertools.pairwise(starts):
        counter = counts.setdefault(kernel, collections.Counter())
        for m in _INSTRUCTION.finditer(sass, begin, end):
            base, modifiers = m.group(1), m.group(2).split(".")[1:]
            counter[base] += 1
            if "128" in modifiers:
                counter[f"{base}.128"] += 1
            if base == "MUFU" and modifiers:
                counter[f"MUFU.{modifiers[0]}"] += 1
    return counts


def install_tools() -> Path:
    """The folder of cuobjdump and nvdisasm, pip-installing their wheels into the NVRTC cache first
    if needed."""
    return nvrtc_gate.pip_target(f"sass-tools-{TOOLS_VERSION}", TOOLS, f"{TOOLS_BIN}/nvdisasm") / TOOLS_BIN


def disassemble(cubin: bytes, tools: Path | None = None) -> dict[str, collections.Counter]:
    """Opcode counts per kernel of one cubin."""
    tools = tools or install_tools()
    env = {**os.environ, "PATH": f"{tools}{os.pathsep}{os.environ.get('PATH', '')}",
           "NVDISASM_PATH": str(tools / "nvdisasm")}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        proc = subprocess.run([str(tools / "cuobjdump"), "-sass", f.name], capture_output=True, text=True, env=env,
                              check=False)
    if proc.returncode:
        raise RuntimeError(f"cuobjdump -sass failed ({proc.returncode}): {proc.stderr.strip()}")
    return count_opcodes(proc.stdout)


@dataclass
class SassResult:
    opcodes: dict = field(default_factory=dict)    # (toolkit, arch, kernel) -> Counter


def wants_sass(module: tuple[str, int, str], kernels, rules=RULES) -> bool:
    """Model-dtype attention modules, and any module holding a kernel an opcode rule names."""
    attention = module[0] == reg.ATTENTION_SOURCE and module[1] and not module[2]
    return bool(attention) or any(r.needs_sass and r.matches(k) for r in rules for k in kernels)


def run_sass(gate: nvrtc_gate.GateResult, jobs: int = 2, rules=RULES) -> SassResult:
    tool = install_tools()
    todo = [key for key, entries in gate.entries.items() if wants_sass(key[2], entries, rules)]
    result = SassResult()
    with ThreadPoolExecutor(jobs) as pool:
        for (toolkit, arch, _), counts in zip(todo, pool.map(lambda k: disassemble(gate.cubins[k], tool), todo)):
            for kernel, counter in counts.items():
                result.opcodes[(toolkit, arch, kernel)] = counter
    return result


# --- rules ----------------------------------------------------------------------------------------

_SPECS = {spec.name: spec for spec in reg.all_kernels()}
NO_SMEM_FUNCTION = "registry has no kernel_smem_bytes yet"


def dynamic_smem(kernel: str, group: int) -> int | None:
    """Dynamic shared memory (bytes) of a launch of ``kernel`` for GQA group ``group`` at the
    benchmark shapes (long prompts for extend), from the registry's ``kernel_smem_bytes(spec, group
    [, q_per_cta])``; None where the kernel does not serve that group (uses_decode_fast is false, or
    kernel_smem_bytes raises ValueError) or, for a new kernel, the registry has no kernel_smem_bytes
    (older registries: attention_smem_bytes as cuda_backend sizes the old kernels)."""
    spec = _SPECS.get(kernel)
    if spec is None or not spec.head_dim:
        return 0                                     # cache ops, reduce: no dynamic shared memory
    if kernel.startswith("hfp_decode_fast_") and hasattr(reg, "uses_decode_fast") \
            and not reg.uses_decode_fast(group, spec.head_dim):
        return None                                  # larger groups decode on the ragged kernel
    if hasattr(reg, "kernel_smem_bytes"):
        try:
            if kernel.startswith("hfp_extend_"):     # long prompts: as many tokens per CTA as fit
                return reg.kernel_smem_bytes(spec, group, max(1, reg.MAX_ROWS // group))
            return reg.kernel_smem_bytes(spec, group)
        except ValueError:
            return None
    if any(r.min_ctas and r.matches(kernel) for r in RULES):
        return None
    elem = 4 if "_f32_" in kernel else 2
    if kernel.startswith("hfp_extend_"):
        return reg.attention_smem_bytes(spec.head_dim, elem, group * max(1, reg.MAX_ROWS // group))
    return reg.attention_smem_bytes(spec.head_dim, elem, group)


@dataclass(frozen=True)
class Occupancy:
    toolkit: str
    arch: str
    kernel: str
    group: int
    registers: int
    smem: int | None        # static + dynamic bytes; None: unknown (see dynamic_smem)
    ctas: int | None


def occupancy(gate: nvrtc_gate.GateResult, kernels=None, smem_of=dynamic_smem) -> list[Occupancy]:
    """CTAs per SM for each benchmark group, of the compiled kernels at the benchmark head dim (and
    of kernels without one); ``kernels``: a name filter (default: all)."""
    rows = []
    for (toolkit, arch, kernel), usage in sorted(gate.usage.items()):
        dim = re.search(r"_d(\d+)$", kernel)
        if (kernels and not kernels(kernel)) or (dim and int(dim.group(1)) != BENCH_HEAD_DIM):
            continue
        for group in BENCH_GROUPS:
            dyn = smem_of(kernel, group)
            smem = None if dyn is None else usage.static_smem + dyn
            ctas = None if smem is None else ctas_per_sm(arch, usage.registers, smem)
            rows.append(Occupancy(toolkit, arch, kernel, group, usage.registers, smem, ctas))
    return rows


def check(gate: nvrtc_gate.GateResult, sass: SassResult, rules=RULES, smem_of=dynamic_smem) -> tuple[list[str], list[str]]:
    """(violations, notes). Notes: rules that matched no kernel yet, occupancy rows not computable."""
    violations, notes = [], []
    for rule in rules:
        matched = sorted(k for k in gate.usage if rule.matches(k[2]))
        if not matched:
            notes.append(f"no kernel matches {rule.pattern!r} yet ({rule.why})")
        for key in matched:
            usage, ops = gate.usage[key], sass.opcodes.get(key)
            where = "/".join(key)
            if rule.no_spill and (usage.stack or usage.spill_stores or usage.spill_loads):
                violations.append(f"{where}: stack {usage.stack}, spill {usage.spill_stores}/{usage.spill_loads} "
                                  f"bytes ({rule.why})")
            if rule.needs_sass and ops is None:
                violations.append(f"{where}: not disassembled ({rule.why})")
                continue
            for any_of in rule.require:
                if not any(ops[o] for o in any_of):
                    violations.append(f"{where}: no {'/'.join(any_of)} in the SASS ({rule.why})")
            for opcode in rule.forbid:
                if ops[opcode]:
                    violations.append(f"{where}: {ops[opcode]} {opcode} in the SASS ({rule.why})")
        if rule.min_ctas and matched:
            names = {k[2] for k in matched}
            unknown = []
            for row in occupancy(gate, kernels=names.__contains__, smem_of=smem_of):
                where = f"{row.toolkit}/{row.arch}/{row.kernel} group {row.group}"
                if row.ctas is None:
                    unknown.append(where)
                elif row.ctas < rule.min_ctas and row.arch in rule.archs:
                    violations.append(f"{where}: {row.ctas} CTAs/SM < {rule.min_ctas} ({row.registers} registers, "
                                      f"{row.smem} B shared memory; {rule.why})")
            if unknown:
                why = NO_SMEM_FUNCTION if not hasattr(reg, "kernel_smem_bytes") else "groups the kernel does not serve"
                notes.append(f"{len(unknown)} occupancy rows not computed ({why}), e.g. {unknown[0]}")
    return violations, notes


# --- report ---------------------------------------------------------------------------------------

COLUMNS = ("LDGSTS", "LDSM", "HMMA", "LDS", "LDS.128", "SHFL", "FFMA", "MUFU", "LDL", "STL", "LDG.128")


def format_table(gate: nvrtc_gate.GateResult, sass: SassResult, kernels=None, smem_of=dynamic_smem) -> str:
    """One row per disassembled (kernel, arch, NVRTC): registers, shared memory (static + the largest
    dynamic over the benchmark groups), spill bytes, static opcode counts (HMMA includes HGMMA) and
    the fewest CTAs/SM over the benchmark groups ("?": unknown shared memory)."""
    head = (f"{'kernel':<26}{'arch':>6}{'nvrtc':>6}{'regs':>5}{'smem':>8}{'spill':>6}"
            + "".join(f"{c:>8}" for c in COLUMNS) + f"{'CTAs/SM':>8}")
    lines = [head]
    for toolkit, arch, kernel in sorted(sass.opcodes, key=lambda k: (k[2], k[1], k[0])):
        if kernels and not kernels(kernel):
            continue
        usage, ops = gate.usage.get((toolkit, arch, kernel)), sass.opcodes[(toolkit, arch, kernel)]
        if usage is None:
            continue
        dyns = [smem_of(kernel, g) for g in BENCH_GROUPS]
        known = [d for d in dyns if d is not None]
        smem = f"{usage.static_smem + max(known)}" if known else "?"
        ctas = min((ctas_per_sm(arch, usage.registers, usage.static_smem + d) for d in known), default=None)
        counts = "".join(f"{ops[c] + (ops['HGMMA'] if c == 'HMMA' else 0):>8}" for c in COLUMNS)
        lines.append(f"{kernel:<26}{arch:>6}{toolkit:>6}{usage.registers:>5}{smem:>8}"
                     f"{usage.spill_stores + usage.spill_loads:>6}{counts}{ctas if ctas is not None else '?':>8}")
    return "\n".join(lines)


def default_rows(kernel: str) -> bool:
    """The rows printed by default: the benchmark head dim and kernels of any head dim (reduce,
    merge); the full table goes to sass_report.txt."""
    return kernel.endswith(f"_d{BENCH_HEAD_DIM}") or re.search(r"_d\d+$", kernel) is None


if __name__ == "__main__":
    start = time.perf_counter()
    gate = nvrtc_gate.run_gate(full=True if "--full" in sys.argv[1:] else None)
    compiled = time.perf_counter()
    sass = run_sass(gate)
    print(f"compiled {len(gate.cubins)} modules in {compiled - start:.0f} s; disassembled "
          f"{sum(wants_sass(k[2], e) for k, e in gate.entries.items())} in {time.perf_counter() - compiled:.0f} s")
    (nvrtc_gate.cache_root() / "sass_report.txt").write_text(format_table(gate, sass) + "\n")
    print(format_table(gate, sass, kernels=default_rows))
    violations, notes = check(gate, sass)
    print("\n".join(["", *notes, *(f"FAIL {v}" for v in violations)]))
    print(f"wrote {nvrtc_gate.cache_root() / 'sass_report.txt'}")
    sys.exit(1 if violations else 0)
