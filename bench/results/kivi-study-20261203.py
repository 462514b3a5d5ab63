import sys, time, torch
sys.path.insert(0, "/work/wt-kivi")
import hf_paged, hf_paged.kivi as kivi
from hf_paged.integrations.smollm2 import load_smollm2
from bench import kv_quant_decode as d
m, t = load_smollm2(verbose=False); hf_paged.patch(m)
texts = d.held_out_texts(t)
def run(bs):
    out = []
    for _, ids in texts:
        cache = hf_paged.PagedCache(m.config, kv_cache_dtype="kivi", dtype=m.dtype, block_size=bs)
        with torch.no_grad(), hf_paged.use_paged_attention(m):
            lg = [m(input_ids=ids[None, :32], past_key_values=cache).logits[0, -1]]
            for i in range(32, len(ids) - 1):
                lg.append(m(input_ids=ids[None, i:i+1], past_key_values=cache).logits[0, -1])
        lp = torch.stack(lg).float().log_softmax(-1)
        out.append(-lp.gather(-1, ids[32:, None])[:, 0])
    return float(torch.cat(out).mean().exp())
ref = 15.7006
for bs, g in [(64, 32), (32, 32)]:
    kivi.BLOCK_SIZE, kivi.VALUE_GROUP = bs, g
    b = kivi.KIVI.bytes_per_head_token(64) / 128
    t0 = time.time(); p = run(bs)
    print(f"BS={bs} G={g} bytes {b:.4f} ppl {p:.4f} {100*(p/ref-1):+.2f}% {time.time()-t0:.0f}s", flush=True)
