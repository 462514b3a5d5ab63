# Variant file for the KIVI study's one-forward emulation (kivi_lab.py, outside this repository; the same lab as
# kivi-lab-rule-20261205.py): the rule as built, with and without a Hadamard rotation of the values (keys as they
# are), and the other variants tried the same day.
#   OMP_NUM_THREADS=2 python kivi_lab.py this_file.py            (24 held-out passages, 32-token prompts)
#   LONG=480 OMP_NUM_THREADS=2 python kivi_lab.py this_file.py   (18 passages, 480-token prompts)
# 2026-12-05, 2 threads (perplexity change / KL per kind):
#   built (no rotation)   docs +0.15%/4.1e-03  comm -0.15%/5.6e-03  lice +0.65%/5.7e-03  all +0.22%/5.2e-03
#   vrot                  docs +0.06%/3.4e-03  comm +0.31%/5.3e-03  lice +0.10%/5.4e-03  all +0.16%/4.7e-03
#   LONG=480:
#   built (no rotation)   lice +0.63%/7.8e-03  comm +0.27%/5.6e-03  code +1.41%/8.3e-03  all +0.77%/7.2e-03
#   vrot                  lice +0.81%/7.4e-03  comm +0.59%/4.8e-03  code +1.18%/7.6e-03  all +0.86%/6.6e-03
# Tried at LONG=480 and not kept (KL all): value scale and minimum searched among shrunken ranges 8.7e-03, key
# ranges searched 7.2e-03, both with vrot 7.3e-03; keys quantised before RoPE (un-rotated by their position, then
# re-rotated: the kernel would have to apply RoPE to every key it reads) 6.1e-03 (keys alone: 5.3e-03 against
# 5.0e-03 after RoPE); 5-bit keys with 3-bit values (the same bytes) 9.8e-03, with vrot 6.5e-03; value groups of 32
# (over 0.30x bf16) 6.8e-03, with vrot 6.5e-03. Where the KL comes from: keys alone quantised 5.0e-03, values
# alone 1.8e-03; 5-bit keys (0.33x bf16) would halve it (3.1e-03).
exec(open("bench/results/kivi-lab-rule-20261205.py").read().split("VARIANTS = [")[0])  # noqa: S102 (V, sealed_mask)
VARIANTS = [
    V("built (no rotation)", sx=1, sink_tokens=1, pr="own"),  # noqa: F821
    V("vrot", sx=1, sink_tokens=1, pr="own", vrot=True),  # noqa: F821
]
