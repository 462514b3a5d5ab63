"""KIVI's read rule and attention sink (hf_paged.kivi): a query at position t reads its own block (t // 32) in
full precision and earlier blocks from their codes, position 0 from the sink store.

- exact state: the sink row is stored and left out of block 0's key range; a block decoded token by token
  stores what one write stores; a prefill takes no open slot for the blocks it fills, a chunk that seals an
  open block and opens the next holds one; copy-on-write, growth, release and the prefix store move sinks;
- the PyTorch path against a brute-force reading of the rule from the written states (the CPU kernel equals
  the PyTorch path: tests/backends/test_cpu_kernel_quant.py);
- outputs do not depend on how a prompt is split: a PagedCache fed token by token, in one forward or in
  chunks, generate with prefill_chunk_size or prefix hits, and the engine with a small token budget, prefix
  hits or preemption give the logits of one whole prefill within 1e-5 (fp32, tiny models), unless a code
  rounded the other way on float noise (checked to be only that; see ``SealLog``);
- negative controls: with the old step-based reads, or without the sink, these tests fail.
"""
from __future__ import annotations

import pytest
import torch

import hf_paged
from hf_paged.backends import TorchBackend
from hf_paged.blocks import BlockPool, BlockTable
from hf_paged.cache import KVPools
from hf_paged.cache.prefix_store import PrefixStore, copy_blocks_between
from hf_paged.kivi import BLOCK_SIZE, KiviPool, KiviWrite, rotated_values, write_kv as kivi_write_kv
from hf_paged.kv_formats import kv_format
from hf_paged.plan import packed_plan
from tiny_models import VOCAB, left_padded, make_model, patched

BS, H, D = BLOCK_SIZE, 2, 64
TOL = 1e-5          # logits of two splits of the same tokens, when every stored code is the same


def _pools(blocks=6, open_slots=8) -> KVPools:
    pools = KVPools(make_model("llama").config, kv_format=kv_format("kivi"))
    pools.open_slots = open_slots
    pools.allocate_pools(blocks, BS, torch.float32, torch.device("cpu"))
    return pools


def _write(pools, slots, positions, seed=0, scale=None):
    """Random K/V [N, H, D] written at ``slots`` / ``positions`` in every layer (``scale`` [N]: per-row
    magnitudes); returns (keys, values)."""
    gen = torch.Generator().manual_seed(seed)
    key, value = (torch.randn(len(slots), H, D, generator=gen) for _ in range(2))
    if scale is not None:
        key, value = key * scale.view(-1, 1, 1), value * scale.view(-1, 1, 1)
    for layer in range(len(pools.key_pools)):
        pools.write(layer, key.view(1, -1, H, D).transpose(1, 2), value.view(1, -1, H, D).transpose(1, 2),
                    torch.tensor(slots), positions=torch.tensor(positions))
    return key, value


def _key_range(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 (scale, minimum) per (head, channel) of key rows [BS', H, D], as the codec stores them."""
    low, high = rows.amin(0), rows.amax(0)
    scale = ((high - low) / 15).to(torch.bfloat16)
    return torch.where(scale > 0, scale, torch.ones_like(scale)), low.to(torch.bfloat16)


# ------------------------------------------------------------------------------------------ exact state
def check_sink_state(pools) -> None:
    """Block 0 written whole, its row 0 an outlier 50x the others: the sink holds row 0 of keys and values
    exactly and the keys' channel range is that of rows 1..31; block 1 (no position 0) ranges over all rows."""
    scale = torch.ones(2 * BS)
    scale[0] = scale[BS] = 50.0
    key, value = _write(pools, list(range(2 * BS)), list(range(2 * BS)), seed=3, scale=scale)
    k_pool, v_pool = pools.key_pools[0], pools.value_pools[0]
    assert k_pool.sink.num_held == 1 and k_pool.sink.slot(1) == -1, "one sink: block 0 holds position 0"
    assert torch.equal(k_pool.sink.rows[:, k_pool.sink.slot(0)], key[0])
    stored = rotated_values(v_pool, value[0], pools.kivi_ops(v_pool.device))        # values: rotated
    assert torch.equal(v_pool.sink.rows[:, v_pool.sink.slot(0)], stored)
    for block, rows in ((0, key[1:BS]), (1, key[BS:])):
        stored_scale, stored_low = k_pool.scales[:, block, 0], k_pool.scales[:, block, 1]
        expect_scale, expect_low = _key_range(rows)
        assert torch.equal(stored_scale, expect_scale) and torch.equal(stored_low, expect_low), block
    assert torch.equal(k_pool.dequantize_blocks(torch.tensor([0]))[:, 0, 0], key[0]), "row 0 read from the sink"


def test_sink_is_kept_and_left_out_of_block_0s_key_range():
    check_sink_state(_pools())


def test_a_block_decoded_token_by_token_stores_what_one_write_stores():
    whole, steps = _pools(), _pools()
    key, value = _write(whole, list(range(BS)), list(range(BS)), seed=4)
    for layer in range(len(steps.key_pools)):
        for t in range(BS):
            steps.write(layer, key[t].view(1, H, 1, D), value[t].view(1, H, 1, D), torch.tensor([t]),
                        positions=torch.tensor([t]))
    for a, b in zip(whole.key_pools + whole.value_pools, steps.key_pools + steps.value_pools):
        assert torch.equal(a.data[:, 0], b.data[:, 0]) and torch.equal(a.scales[:, 0], b.scales[:, 0])
        assert torch.equal(a.sink.rows[:, a.sink.slot(0)], b.sink.rows[:, b.sink.slot(0)])
        assert b.open.num_held == 0 and b.fresh.blocks == [0]


def test_a_prefill_takes_no_open_slot_for_the_blocks_it_fills_and_its_fresh_rows_end_with_the_step():
    pools = _pools(blocks=12, open_slots=1)
    n = 10 * BS + 5
    key, _ = _write(pools, list(range(n)), list(range(n)), seed=5)
    k_pool = pools.key_pools[0]
    assert k_pool.open.rows.shape[1] == 1 and k_pool.open.num_held == 1, "only the last, partial block is open"
    assert k_pool.fresh.blocks == list(range(10)) and k_pool.fresh.rows.shape[1] == 10
    assert torch.equal(k_pool.own_blocks(torch.tensor([3]))[:, 0], key[3 * BS:4 * BS].transpose(0, 1))
    pools.end_step()
    assert k_pool.fresh.blocks == [] and k_pool.fresh.rows.numel() == 0 and int(k_pool.fresh.block_slot.max()) == -1
    assert torch.equal(k_pool.own_blocks(torch.tensor([3])), k_pool.dequantize_blocks(torch.tensor([3])))


def test_a_chunk_that_seals_an_open_block_and_opens_the_next_holds_one_slot():
    pools = _pools(open_slots=1)
    first, _ = _write(pools, list(range(10)), list(range(10)), seed=6)
    second, _ = _write(pools, list(range(10, 40)), list(range(10, 40)), seed=7)
    k_pool = pools.key_pools[0]
    assert k_pool.open.rows.shape[1] == 1, "block 0's slot went back before block 1 took one"
    assert k_pool.open.slot(0) == -1 and k_pool.open.slot(1) >= 0 and k_pool.fresh.blocks == [0]
    own = k_pool.own_blocks(torch.tensor([0, 1])).transpose(0, 2)                 # [BS, blocks, H, D]
    assert torch.equal(own[:10, 0], first) and torch.equal(own[10:, 0], second[:22]) and torch.equal(own[:8, 1], second[22:])


def test_copy_on_write_growth_release_and_the_prefix_store_move_sinks():
    pools = _pools(blocks=4)
    key, _ = _write(pools, list(range(5)), list(range(5)), seed=8)           # block 0 open, with the sink
    pools.copy_blocks([(0, 2)])                                               # a fork writes into its copy
    _write(pools, [2 * BS + 5], [5], seed=9)
    for pool in pools.key_pools:
        assert pool.sink.slot(2) >= 0 and pool.sink.slot(2) != pool.sink.slot(0)
        assert torch.equal(pool.sink.rows[:, pool.sink.slot(2)], pool.sink.rows[:, pool.sink.slot(0)])
    pools.grow_pools(3)
    assert torch.equal(pools.key_pools[0].sink.rows[:, pools.key_pools[0].sink.slot(2)], key[0])
    assert pools.key_pools[0].sink.block_slot.tolist()[4:] == [-1, -1, -1]
    _write(pools, list(range(5, BS)), list(range(5, BS)), seed=10)            # block 0 sealed: the sink stays
    store = PrefixStore(make_model("llama").config, pools.geometry, pools.kv_format, BS, 2**20, torch.float32)
    store.allocate_pools(store.num_blocks, BS, torch.float32, torch.device("cpu"))
    assert store.pool_bytes <= 2**20, "a sink row per block is within the store's budget"
    assert store.key_pools[0].open.rows.shape[1] == 0 and store.key_pools[0].sink.rows.shape[1] == store.num_blocks
    copy_blocks_between(pools, store, [0], [1])
    for mine, theirs in zip(store.key_pools + store.value_pools, pools.key_pools + pools.value_pools):
        assert mine.open.num_held == 0 and mine.sink.slot(1) >= 0
        assert torch.equal(mine.dequantize_blocks(torch.tensor([1])), theirs.dequantize_blocks(torch.tensor([0])))
    block_pool = BlockPool(7, BS)
    block_pool.free_listeners.append(pools.release_blocks)
    held = [block_pool.take() for _ in range(3)]
    block_pool.release(held)                                                  # blocks 0..2 plain free
    assert all(p.sink.num_held == 0 and p.open.num_held == 0 for p in pools.key_pools + pools.value_pools)


def test_a_caches_pools_share_their_entries_and_hold_what_pools_of_their_own_hold():
    """KVPools' pools (one KiviMaps for the device, changed once per write, copy, release, growth) against
    standalone pools per layer (each with its own maps, changed by its own calls): the same entries, rows,
    codes and scales after every operation. Both on the PyTorch path, so every byte must agree."""
    pools = KVPools(make_model("llama").config, backend=TorchBackend(), kv_format=kv_format("kivi"))
    pools.open_slots = 2
    pools.allocate_pools(6, BS, torch.float32, torch.device("cpu"))
    layers = len(pools.key_pools)
    assert len(pools.kivi_maps) == 1 and all(p.maps is pools.kivi_maps[0] for p in pools.key_pools + pools.value_pools)
    alone = [(KiviPool.new(True, H, 6, BS, D, torch.float32, "cpu", 2),
              KiviPool.new(False, H, 6, BS, D, torch.float32, "cpu", 2, rotation=pools.value_pools[i].rotation))
             for i in range(layers)]
    gen = torch.Generator().manual_seed(11)

    def write(slots, positions):
        plan = KiviWrite.of(torch.tensor(slots), torch.tensor(positions), BS)
        for layer in range(layers):
            key, value = (torch.randn(len(slots), H, D, generator=gen) for _ in range(2))
            pools.write(layer, key.view(1, -1, H, D).transpose(1, 2), value.view(1, -1, H, D).transpose(1, 2),
                        torch.tensor(slots), positions=torch.tensor(positions))
            kivi_write_kv(*alone[layer], key, value, plan)

    def check(what):
        for layer in range(layers):
            for a, b in zip((pools.key_pools[layer], pools.value_pools[layer]), alone[layer]):
                assert a.open.held == b.open.held and a.sink.held == b.sink.held, f"{what}: entries"
                assert torch.equal(a.data, b.data) and torch.equal(a.scales, b.scales), f"{what}: codes"
                for store in ("open", "sink"):
                    mine, theirs = getattr(a, store), getattr(b, store)
                    assert torch.equal(mine.block_slot, theirs.block_slot), f"{what}: {store} map"
                    for slot in mine.held.values():
                        assert torch.equal(mine.rows[:, slot], theirs.rows[:, slot]), f"{what}: {store} rows"
                assert a.fresh.blocks == b.fresh.blocks and torch.equal(a.fresh.rows, b.fresh.rows), f"{what}: fresh"

    # seq A: blocks 0, 1, 2 (70 tokens), seq B: block 3 (5 tokens): two whole blocks sealed, two open, sinks
    write(list(range(70)) + [3 * BS + p for p in range(5)], list(range(70)) + list(range(5)))
    check("prefill")
    write([70, 3 * BS + 5], [70, 5])
    check("decode")
    pools.copy_blocks([(2, 4)])                                               # a fork of A's open block
    for k, v in alone:
        for pool in (k, v):
            pool.copy_open([(2, 4)])
            pool.data[:, 4], pool.scales[:, 4] = pool.data[:, 2], pool.scales[:, 2]
    check("copy-on-write")
    write([71, 4 * BS + 71 - 2 * BS], [71, 71])
    check("both forks decode")
    pools.release_blocks([3])                                                 # B finished
    for k, _ in alone:
        k.maps.release([3])
    for _, v in alone:
        v.maps.release([3])
    check("release")
    pools.grow_pools(3)
    alone = [tuple(p.with_tensors(torch.cat([p.data, p.data.new_zeros((H, 3, *p.data.shape[2:]))], 1),
                                  torch.cat([p.scales, p.scales.new_ones((H, 3, *p.scales.shape[2:]))], 1)) for p in pair)
             for pair in alone]
    check("growth")
    write(list(range(72, 96)) + [6 * BS + p for p in range(BS)], list(range(72, 96)) + list(range(BS)))
    check("A's block 2 sealed from its slot, a new sequence in a grown block")
    pools.end_step()
    assert all(p.fresh.rows.numel() == 0 for p in pools.key_pools + pools.value_pools)
    assert int(pools.kivi_maps[0].fresh.block_slot.max()) == -1


def test_a_shared_pool_refuses_a_copy_of_its_own():
    pools = _pools()
    with pytest.raises(RuntimeError, match="KVPools.copy_blocks"):
        pools.key_pools[0].copy_open([(0, 1)])


# ------------------------------------------------------------------------ the PyTorch path, brute force
def _reference_quantise(rows: torch.Tensor, is_key: bool, skip_first: bool) -> torch.Tensor:
    """rows fp32 [BS, D] of one head -> what their 4-bit codes decode to (keys per channel, row 0 out of the
    range with a sink; values per token over groups of min(D, 64))."""
    x = rows if is_key else rows.unflatten(-1, (-1, min(D, 64)))
    ranged = x[1:] if is_key and skip_first else x
    dim = 0 if is_key else -1
    low, high = ranged.amin(dim, keepdim=True), ranged.amax(dim, keepdim=True)
    scale = ((high - low) / 15).to(torch.bfloat16).float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    low = low.to(torch.bfloat16).float()
    out = ((x - low) / scale).round().clamp(0, 15) * scale + low
    return out if is_key else out.flatten(-2)


def test_the_pytorch_path_reads_what_the_rule_says():
    """Two sequences, one packed step after earlier writes: row 0 holds 41 tokens (writes of 10, 30 and 1)
    and gets 40 more (block 1 sealed from its slot, block 2 opened), row 1 is a prompt of 70 (blocks 0 and
    1 filled and sealed by the step). Each query's output equals softmax attention (float64) over keys and
    values built from the written states: its own block as written, earlier blocks through a reference
    quantiser (block 0's keys ranged over rows 1..31), position 0 as written."""
    gen = torch.Generator().manual_seed(12)
    k, v = (KiviPool.new(is_key, H, 8, BS, D, torch.float32, "cpu", 2) for is_key in (True, False))
    tables = [[5, 2, 7], [0, 4, 6]]
    states = {row: (torch.zeros(96, H, D), torch.zeros(96, H, D)) for row in (0, 1)}

    def write(tokens):
        keys, values = (torch.randn(len(tokens), H, D, generator=gen) for _ in range(2))
        keys[:, :, 5] += 3.0                                                   # an outlier channel
        for i, (row, p) in enumerate(tokens):
            states[row][0][p], states[row][1][p] = keys[i], values[i]
        slots = torch.tensor([tables[row][p // BS] * BS + p % BS for row, p in tokens])
        positions = torch.tensor([p for _, p in tokens])
        k.write(keys, slots, positions)
        v.write(values, slots, positions)

    for chunk in ((0, 10), (10, 40), (40, 41)):
        write([(0, p) for p in range(*chunk)])
    step = [(0, p) for p in range(41, 81)] + [(1, p) for p in range(70)]
    write(step)
    plan = packed_plan([(BlockTable(tables[0], 81), 41, 40), (BlockTable(tables[1], 70), 0, 70)], BS,
                       torch.device("cpu"))
    query = torch.randn(len(step), 2 * H, D, generator=gen)
    out = TorchBackend().prepare(plan).attend(query, k, v, 0.125, 0)
    for i, (row, t) in enumerate(step):
        keys, values = (s[:t + 1].clone().double() for s in states[row])
        for j in range(t // BS):                                               # blocks before the query's own
            block = slice(j * BS, (j + 1) * BS)
            for h in range(H):
                keys[block, h] = _reference_quantise(states[row][0][block, h], True, j == 0).double()
                values[block, h] = _reference_quantise(states[row][1][block, h], False, j == 0).double()
        keys[0], values[0] = states[row][0][0].double(), states[row][1][0].double()      # the sink
        q = query[i].double().view(H, 2, D)
        probs = torch.softmax(torch.einsum("hgd,thd->hgt", q, keys) * 0.125, -1)
        expect = torch.einsum("hgt,thd->hgd", probs, values).reshape(2 * H, D)
        torch.testing.assert_close(out[i].double(), expect, atol=2e-5, rtol=2e-5, msg=f"row {row} position {t}")


# --------------------------------------------------------------------- outputs independent of the split
class SealLog:
    """Every block sealed while it is installed: (is_key, rows fp32 [Hkv, BS, D], codes, scales). Two runs
    of the same tokens seal the same rows up to float noise (the reads are the same); a value that lies on a
    rounding boundary can still round the other way. ``flips`` finds those and checks that they are only
    that."""

    def __init__(self, monkeypatch):
        self.seals = []
        original = KiviPool.quantize_blocks

        def recording(pool, rows, sink=None):
            codes, scales = original(pool, rows, sink)
            for i in range(rows.shape[1]):
                self.seals.append((pool.is_key, rows[:, i].float().clone(), codes[:, i].clone(), scales[:, i].clone()))
            return codes, scales
        monkeypatch.setattr(KiviPool, "quantize_blocks", recording)

    def take(self) -> list:
        seals, self.seals = self.seals, []
        return seals


def flips(reference: list, seals: list) -> int:
    """How many of ``seals`` store other codes or scales than the reference seal of the same rows. Each must be
    float noise on a rounding boundary: rows within 1e-4 of the reference's, codes one step apart at most,
    scales and minima one bf16 step apart at most."""
    count = 0
    for is_key, rows, codes, scales in seals:
        candidates = [s for s in reference if s[0] == is_key and s[1].shape == rows.shape]
        distance = torch.stack([(rows - s[1]).abs().max() for s in candidates])
        _, ref_rows, ref_codes, ref_scales = candidates[int(distance.argmin())]
        assert float(distance.min()) <= 1e-4 * float(rows.abs().max()), "a sealed block that the reference never sealed"
        if torch.equal(codes, ref_codes) and torch.equal(scales.view(torch.int16), ref_scales.view(torch.int16)):
            continue
        count += 1
        nibbles = [torch.stack([c & 15, c >> 4], -1).int() for c in (codes, ref_codes)]
        assert int((nibbles[0] - nibbles[1]).abs().max()) <= 1, "codes more than one step apart"
        a, b = scales.float(), ref_scales.float()
        assert bool(((a - b).abs() <= torch.maximum(a.abs(), b.abs()) * 2 ** -7).all()), "scales more than a bf16 step apart"
    return count


def assert_same_outputs(reference, output, ref_seals, seals, what: str) -> None:
    """``output`` equals ``reference`` within TOL when every seal stored the reference's codes; after a rounding
    flip (``flips``) within 1e-2, the effect of one code step."""
    n = flips(ref_seals, seals)
    worst = max(float((a - b).abs().max()) for a, b in zip(reference, output))
    assert worst <= (TOL if n == 0 else 1e-2), f"{what}: logits differ by {worst:.2e} ({n} rounding flips)"


def cache_logits(model, ids: torch.Tensor, pieces: list[int], backend=None) -> torch.Tensor:
    """fp32 logits [T, V] of ``ids`` [T] fed to a kivi PagedCache in forwards of ``pieces`` tokens."""
    cache = hf_paged.PagedCache(model.config, kv_cache_dtype="kivi", block_size=BS, dtype=model.dtype, backend=backend)
    out, start = [], 0
    with torch.no_grad(), patched(model), hf_paged.use_paged_attention(model):
        for n in pieces:
            out.append(model(input_ids=ids[None, start:start + n], past_key_values=cache).logits[0].float())
            start += n
    return torch.cat(out)


SPLITS = {"token by token": [1] * 100, "chunks of 5": [5] * 20, "uneven": [7, 30, 1, 40, 22]}


def check_splits(model, backend, log, splits=SPLITS) -> None:
    ids = torch.randint(3, VOCAB, (100,), generator=torch.Generator().manual_seed(21))
    whole = cache_logits(model, ids, [100], backend)
    ref_seals = log.take()
    for name, pieces in splits.items():
        out = cache_logits(model, ids, pieces, backend)
        assert_same_outputs([whole], [out], ref_seals, log.take(), name)


@pytest.mark.parametrize("kernel", [True, False], ids=["cpu-kernel", "pytorch"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "glm4"])
def test_paged_cache_logits_do_not_depend_on_how_the_tokens_are_split(one_torch_thread, monkeypatch, family, kernel):
    """100 tokens (blocks 0..3) through a PagedCache: one forward, token by token, chunks of 5, uneven chunks."""
    check_splits(make_model(family, seed=3), None if kernel else TorchBackend(), SealLog(monkeypatch))


def _generate(model, ids, mask, **kw):
    return model.generate(input_ids=ids, attention_mask=mask, cache_implementation="paged", max_new_tokens=6,
                          do_sample=False, output_logits=True, return_dict_in_generate=True, **kw)


def test_generate_with_prefill_chunks_and_prefix_hits_gives_one_prefills_logits(one_torch_thread, monkeypatch):
    """Left-padded rows sharing a 70-token prefix: a whole prefill; prefill_chunk_size=9; prefix caching across
    calls, whose second call hits where each row's hit ends on a block boundary (pads 32 apart) and takes no
    hit where the rows' pads disagree modulo 32 (a row would continue inside a cached, sealed block)."""
    model = make_model("qwen3", seed=5)
    gen = torch.Generator().manual_seed(6)
    prefix = torch.randint(3, VOCAB, (70,), generator=gen).tolist()
    aligned = left_padded([prefix + torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (3, 35)])
    misaligned = left_padded([prefix + torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (3, 9, 17)])
    log = SealLog(monkeypatch)
    with patched(model, block_size=BS, kv_cache_dtype="kivi"):
        whole = [_generate(model, *batch) for batch in (aligned, misaligned)]
        ref_seals = log.take()
        chunked = _generate(model, *aligned, prefill_chunk_size=9)
        assert torch.equal(chunked.sequences, whole[0].sequences)
        assert_same_outputs(whole[0].logits, chunked.logits, ref_seals, log.take(), "prefill_chunk_size=9")
    with patched(model, block_size=BS, kv_cache_dtype="kivi", enable_prefix_caching=True):
        for batch, expect_hits, ref in ((aligned, (96 - 32) + 96, whole[0]), (misaligned, 0, whole[1])):
            _generate(model, *batch)
            log.take()
            hit = _generate(model, *batch)
            assert hf_paged.last_stats(model)["prefix_hit_tokens"] == expect_hits
            assert torch.equal(hit.sequences, ref.sequences)
            assert_same_outputs(ref.logits, hit.logits, ref_seals, log.take(), f"prefix hits of {expect_hits} tokens")


def _engine_logprobs(llm, prompts, prompt_logprobs: bool = True) -> tuple[list, list]:
    """(token ids, log-probabilities [n] of each request: its new tokens', then its prompt tokens' when asked),
    greedy. (A request asking prompt log-probabilities takes no prefix hit.)"""
    outs = llm.generate(prompts, max_new_tokens=10, do_sample=False, ignore_eos=True, logprobs=0,
                        prompt_logprobs=0 if prompt_logprobs else None)
    values = []
    for o in outs:
        entries = o.outputs[0].logprobs + (o.prompt_logprobs[1:] if prompt_logprobs else [])
        values.append(torch.tensor([lp.logprob for entry in entries for lp in entry.values()]))
    return [o.outputs[0].token_ids for o in outs], values


def test_the_engine_gives_one_prefills_logits_with_chunks_prefix_hits_and_preemption(one_torch_thread, monkeypatch):
    """Four prompts of 58..124 tokens, three sharing a 64-token prefix: the engine with room for everything and
    a large token budget against a token budget of 16 (chunked prefills over many steps), prefix caching (a
    second pass hits), and a pool of 13 blocks, too few for the sequences' growth (preemption and recompute).
    Log-probabilities of the new tokens and of every prompt token (those of a prefill's queries)."""
    model = make_model("llama", seed=7)
    gen = torch.Generator().manual_seed(8)
    prefix = torch.randint(3, VOCAB, (64,), generator=gen).tolist()
    prompts = [prefix + torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (28, 60, 5)]
    prompts.append(torch.randint(3, VOCAB, (58,), generator=gen).tolist())     # 12 blocks, 15 with 10 new tokens
    log = SealLog(monkeypatch)
    common = dict(kv_cache_dtype="kivi", block_size=BS, max_num_seqs=4)
    tokens, ref = _engine_logprobs(hf_paged.LLM(model, num_blocks=40, enable_prefix_caching=False, **common), prompts)
    ref_seals = log.take()
    chunked = hf_paged.LLM(model, num_blocks=40, enable_prefix_caching=False, max_num_batched_tokens=16, **common)
    got_tokens, got = _engine_logprobs(chunked, prompts)
    assert got_tokens == tokens and chunked.engine.counters.steps >= 343 // 16 + 9    # 343 prompt tokens
    assert_same_outputs(ref, got, ref_seals, log.take(), "max_num_batched_tokens=16")
    small = hf_paged.LLM(model, num_blocks=13, enable_prefix_caching=False, **common)
    got_tokens, got = _engine_logprobs(small, prompts)
    assert got_tokens == tokens and small.engine.counters.preemptions > 0
    assert_same_outputs(ref, got, ref_seals, log.take(), "preemption")
    cached = hf_paged.LLM(model, num_blocks=40, enable_prefix_caching=True, **common)
    _engine_logprobs(cached, prompts, prompt_logprobs=False)
    log.take()
    first_pass = cached.stats().prefix_hit_tokens
    got_tokens, got = _engine_logprobs(cached, prompts, prompt_logprobs=False)
    assert got_tokens == tokens and cached.stats().prefix_hit_tokens - first_pass == 64 + 96 + 64 + 32
    assert_same_outputs([r[:10] for r in ref], got, ref_seals, log.take(), "prefix hits")


def test_a_forked_row_reads_what_a_row_of_its_own_reads(one_torch_thread, monkeypatch):
    """Two identical prompt rows (as generate expands beams or num_return_sequences) share one 5-token block 0
    holding position 0; they then decode different tokens, so the second row's first write copies that open
    block (slot and sink) on write, and block 0 is later sealed in both. Each row's logits equal those of a
    cache holding that row alone, fed token by token, and both blocks keep a sink equal to position 0."""
    model = make_model("llama", seed=9)
    gen = torch.Generator().manual_seed(10)
    prompt = torch.randint(3, VOCAB, (1, 5), generator=gen)
    new = torch.randint(3, VOCAB, (2, 40), generator=gen)
    log = SealLog(monkeypatch)
    cache = hf_paged.PagedCache(model.config, kv_cache_dtype="kivi", block_size=BS, dtype=model.dtype)
    with torch.no_grad(), patched(model), hf_paged.use_paged_attention(model):
        ids = prompt.repeat(2, 1)
        logits = [model(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache).logits[:, -1]]
        for t in range(new.shape[1]):
            ids = torch.cat([ids, new[:, t:t + 1]], 1)
            logits.append(model(input_ids=new[:, t:t + 1], attention_mask=torch.ones_like(ids),
                                past_key_values=cache).logits[:, -1])
    forked, seals = torch.stack(logits, 1).float(), log.take()
    first = [table.blocks[0] for table in cache.rows.tables]
    assert first[0] != first[1], "the second row wrote into a copy of block 0"
    for pool in cache.key_pools + cache.value_pools:
        sinks = [pool.sink.slot(b) for b in first]
        assert min(sinks) >= 0 and torch.equal(pool.sink.rows[:, sinks[0]], pool.sink.rows[:, sinks[1]])
    for row in range(2):
        alone = cache_logits(model, torch.cat([prompt[0], new[row]]), [1] * 45)[4:]
        assert_same_outputs([alone], [forked[row]], seals, log.take(), f"row {row}")


# ------------------------------------------------------------------------------------ negative controls
def test_negative_control_the_old_step_based_reads_depend_on_the_split(one_torch_thread, monkeypatch):
    """Blocks sealed by a step read from their codes by that step's own queries (the rule before): the split
    test fails."""
    def old_rule(pool, index):
        x = pool.dequantize_blocks(index)
        slot = pool.open.block_slot.index_select(0, index)
        x[:, slot >= 0] = pool.open.rows.index_select(1, slot[slot >= 0]).float()
        return x
    monkeypatch.setattr(KiviPool, "own_blocks", old_rule)
    with pytest.raises(AssertionError, match="logits differ|never sealed"):
        check_splits(make_model("llama", seed=3), TorchBackend(), SealLog(monkeypatch),
                     {"chunks of 5": SPLITS["chunks of 5"]})


def test_negative_control_without_the_sink_the_state_check_fails(monkeypatch):
    original = KiviWrite.of            # (bound: the class's own)
    monkeypatch.setattr(KiviWrite, "of", lambda slots, positions, block_size: original(slots, positions + 1, block_size))
    with pytest.raises(AssertionError, match="one sink"):
        check_sink_state(_pools())
