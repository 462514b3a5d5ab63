# Variant file for the KIVI study's one-forward emulation (kivi_lab.py, outside this repository): the study's
# best variant (sink + position rule) beside the rule as built. The study's posrule reads a query's own block
# from codes when the query is that block's last position (a block counts as sealed once position
# (b + 1) * 32 - 1 <= t); the built rule reads a query's own block in full precision at every position.
#   OMP_NUM_THREADS=1 python kivi_lab.py this_file.py            (24 held-out passages, 32-token prompts)
#   LONG=480 OMP_NUM_THREADS=1 python kivi_lab.py this_file.py   (18 passages, 480-token prompts)
# 2026-12-05, 1 thread (KL per kind, perplexity change):
#   sink1 excl posrule (lab)          docs +0.01%/4.1e-03  comm -0.30%/6.5e-03  lice +0.96%/6.9e-03  all +0.22%/5.8e-03
#   sink1 excl own-block rule (built) docs +0.16%/4.1e-03  comm -0.32%/5.6e-03  lice +0.65%/5.8e-03  all +0.16%/5.2e-03
#   LONG=480:
#   sink1 excl posrule (lab)          lice -0.63%/8.0e-03  comm +1.31%/5.4e-03  code +0.94%/9.0e-03  all +0.54%/7.5e-03
#   sink1 excl own-block rule (built) lice +0.63%/7.8e-03  comm +0.27%/5.6e-03  code +1.41%/8.3e-03  all +0.77%/7.2e-03
# The built pool decoded token by token (python -m bench kv-quant --sections held-out --formats auto,kivi
# [--prompt 480]): 4.1e-03 / 5.8e-03 / 5.8e-03, all 5.2e-03 (kv-quant-20261205-060458); long 7.8e-03 / 5.4e-03 /
# 8.2e-03, all 7.1e-03 (kv-quant-20261205-061527).
def V(name, sx=0, pr=False, **kw):
    v = Variant(name, **kw); v.sink_exclude = sx; v.posrule = pr; return v  # noqa: F821 (the lab's namespace)


_lab_mask = sealed_mask  # noqa: F821


def sealed_mask(T, P, open_blocks, sink_tokens, posrule=False):
    if posrule != "own":
        return _lab_mask(T, P, open_blocks, sink_tokens, posrule)
    t = torch.arange(T)  # noqa: F821
    m = (t[None, :] // BS) < (t[:, None] // BS)          # key block before the query's own block  # noqa: F821
    if sink_tokens:
        m[:, :sink_tokens] = False
    return m


VARIANTS = [
    V("sink1 excl posrule (lab)", sx=1, sink_tokens=1, pr=True),
    V("sink1 excl own-block rule (built)", sx=1, sink_tokens=1, pr="own"),
]
