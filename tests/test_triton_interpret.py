"""Layer 3: the Triton task bodies, run by the persistent kernel under TRITON_INTERPRET=1 on a CPU,
equal the plan interpreter.  Programs run one after another there, so plans use one worker or the
`blocked` schedule (each worker only waits on earlier workers)."""

import os

import pytest
import torch
import triton
import triton.language as tl

from graph.compile import CompileOptions, compile_step
from graph.fusion import DEFAULT_RULES
from graph.isa import Buf, decode
from graph.lower import StepShape
from graph.tiling import TilingOptions
from megakernel.interpreter import Interpreter
from megakernel.ops import moe
from model import TINY_PRESETS, init_weights, preset

from .conftest import TINY_BLOCKS, UNFOLDED, rel_err

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU Triton interpreter only")


def _pair(name, workers=1, scheduler="critical_path", fuse=True, T=2, B=2, passes=1, tiling=None, blocks=None,
          rules=DEFAULT_RULES):
    from megakernel.runtime import LaunchConfig, Megakernel
    cfg = preset(name)
    w = init_weights(cfg, seed=3)
    shape = StepShape(T=T, B=B, max_len=16, mtp_passes=passes if cfg.num_nextn_predict_layers else 0, attn_split=4)
    plan = compile_step(cfg, shape, CompileOptions(workers=workers, scheduler=scheduler, fuse=fuse,
                                                   tiling=tiling or TilingOptions(), fusion_rules=rules))
    interp = Interpreter(plan, w)
    mk = Megakernel(plan, w, device="cpu", config=LaunchConfig(max_spins=2000, blocks=blocks))
    cache = torch.randn(interp.cache().shape, generator=torch.Generator().manual_seed(0))
    interp.cache().copy_(cache)
    mk.cache().copy_(cache)
    return cfg, plan, interp, mk


def _compare(cfg, interp, mk, lens):
    tokens = torch.randint(0, cfg.vocab_size, (interp.B, interp.T), generator=torch.Generator().manual_seed(1))
    want, got = interp.step(tokens, lens), mk.step(tokens, lens)
    assert rel_err(got.logits, want.logits) <= 1e-5
    assert torch.equal(got.tokens, want.tokens)
    for a, b in zip(got.mtp_logits, want.mtp_logits):
        assert rel_err(a, b) <= 1e-5
    assert rel_err(mk.cache(), interp.cache()) <= 1e-5
    # every int the step leaves behind (inputs, routing tables, argmax, accept results) is the same: a
    # body writing outside its operands (a fused ROUTE once stored its ids over the input tokens) shows here
    assert torch.equal(mk.mem.bufs[Buf.I], interp.mem.bufs[Buf.I])
    torch.testing.assert_close(mk.mem.bufs[Buf.A], interp.mem.bufs[Buf.A], rtol=1e-4, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("name", TINY_PRESETS)
def test_kernel_equals_interpreter_one_worker(name):
    cfg, plan, interp, mk = _pair(name)
    # MLA: the latent's norm writes the cache itself (norm_into_cache, a default rule), so the body's CACHE path runs
    assert any(decode(w).op.name == "RMSNORM" and decode(w).has("CACHE") for w in plan.words) == cfg.is_mla
    _compare(cfg, interp, mk, torch.tensor([0, 9]))


BF16_CASES = [(n, DEFAULT_RULES) for n in TINY_PRESETS] + [("tiny-moe", DEFAULT_RULES + ("expert_mlp", "dense_mlp"))]


@pytest.mark.parametrize("name,rules", BF16_CASES, ids=[f"{n}-{len(r)}_rules" for n, r in BF16_CASES])
def test_kernel_equals_interpreter_in_bf16(name, rules, monkeypatch):
    """bf16 weights and cache, the GPU's dtype: the bodies' bf16 paths (weights loaded as words of two columns and
    split by shifts, the k-major down rows, the cache) against the interpreter in bf16, within the GPU tests'
    tolerance.  Attention's tl.dot runs on fp32 operands here (DOT_PREC fp32: Triton 3.6's interpreter multiplies
    bf16 bit patterns, triton-lang/triton#11584), so its bf16x2 split is the GPU's alone."""
    import graph.fusion_weights
    from megakernel.runtime import LaunchConfig, Megakernel
    monkeypatch.setattr(graph.fusion_weights, "EXPERT_SLICE_ROWS", 16)
    cfg = preset(name)
    w = init_weights(cfg, seed=3, dtype=torch.bfloat16)
    shape = StepShape(T=2, B=2, max_len=16, mtp_passes=1 if cfg.num_nextn_predict_layers else 0, attn_split=4)
    plan = compile_step(cfg, shape, CompileOptions(workers=1, fusion_rules=rules))
    interp = Interpreter(plan, w, "cpu", torch.bfloat16)
    mk = Megakernel(plan, w, device="cpu", dtype=torch.bfloat16, config=LaunchConfig(max_spins=2000))
    assert mk.blocks["DOT_PREC"] == "fp32" and mk.mem.bufs[Buf.W].dtype == torch.bfloat16
    cache = torch.randn(interp.cache().shape, generator=torch.Generator().manual_seed(0))
    interp.cache().copy_(cache)
    mk.cache().copy_(cache)
    tokens = torch.randint(0, cfg.vocab_size, (2, 2), generator=torch.Generator().manual_seed(1))
    lens = torch.tensor([3, 9])
    want, got = interp.step(tokens, lens), mk.step(tokens, lens)
    assert rel_err(got.logits, want.logits) <= 1e-2
    for a, b in zip(got.mtp_logits, want.mtp_logits):
        assert rel_err(a, b) <= 1e-2


def test_kernel_latent_norm_into_a_bf16_cache_is_the_cache_write():
    """norm_into_cache in the model dtype: tiny-moe in bf16, its RMSNORM[CACHE] tasks round the norm's fp32 rows to
    the cache dtype once, as the unfused plan's CACHE_WRITE does: the kernel's caches and logits with the rule and
    without it (norm_into_cache=0) are equal, bit for bit."""
    from megakernel.runtime import LaunchConfig, Megakernel
    cfg = preset("tiny-moe").replace(dtype="bfloat16")
    w = init_weights(cfg, seed=3)
    shape = StepShape(T=2, B=2, max_len=16, mtp_passes=1, attn_split=4)
    tokens = torch.randint(0, cfg.vocab_size, (2, 2), generator=torch.Generator().manual_seed(1))
    runs = []
    for rules in (DEFAULT_RULES, tuple(r for r in DEFAULT_RULES if r != "norm_into_cache")):
        plan = compile_step(cfg, shape, CompileOptions(workers=1, fusion_rules=rules))
        assert any(decode(w).op.name == "RMSNORM" and decode(w).has("CACHE") for w in plan.words) == (
            "norm_into_cache" in rules)
        mk = Megakernel(plan, w, device="cpu", config=LaunchConfig(max_spins=2000))
        assert mk.cache().dtype == torch.bfloat16
        mk.cache().copy_(torch.randn(mk.cache().shape, generator=torch.Generator().manual_seed(0)))
        got = mk.step(tokens, torch.tensor([3, 9]))
        runs.append((got.logits.clone(), [m.clone() for m in got.mtp_logits], mk.cache().clone()))
    (a, mtp_a, cache_a), (b, mtp_b, cache_b) = runs
    assert torch.equal(cache_a, cache_b) and torch.equal(a, b) and all(map(torch.equal, mtp_a, mtp_b))


@pytest.mark.parametrize("name", ["tiny-moe", "tiny-dense"])
def test_kernel_small_blocks(name):
    """The bodies' other paths: the attention combine over several blocks of splits (online maximum),
    RMSNorm rows longer than a block (two passes), the weight stream over several K chunks and row
    blocks (token groups wider than the step: TB=2; two chunks in flight: DEPTH=2), the combine's
    next block requested early, rope over several blocks of heads, per-head matmuls over several
    input and output blocks, attention compiled for either kind (ATT_KIND=0, the flag read per task;
    the other tests run the plan's one kind), top-k by rounds of argmax (BE > 64; the other tests
    rank the experts), MLA's latent norm into the cache (RMSNORM[CACHE]) over two passes."""
    cfg, plan, interp, mk = _pair(name, blocks=dict(BSC=2, BCW=8, BN=16, CPF=1, BR=8, KC=32, TB=2, DEPTH=2, BH=512,
                                                  BI=8, BO=8, BIT=8, BOT=4, ATT_KIND=0, BE=128))
    assert cfg.hidden_size > 16 and plan.shape["max_len"] // plan.shape["attn_split"] > 2
    # MLA's latent norm into the cache (RMSNORM[CACHE]) in two passes too: its rows are longer than BN
    assert not cfg.is_mla or cfg.kv_lora_rank > 16 and any(decode(w).op.name == "RMSNORM" and decode(w).has("CACHE")
                                                           for w in plan.words)
    _compare(cfg, interp, mk, torch.tensor([3, 11]))


@pytest.mark.parametrize("name,blocks", [("tiny-dense", None), ("tiny-dense", dict(BN=16, TB=2)),
                                         ("tiny-moe", dict(TB=1, ROWVEC=1, AHEAD=1, NARROW=1, EF=2, BR=8, KC=128))])
def test_kernel_norms_folded_into_linears(name, blocks):
    """Fusion rule norm_into_linear (a default rule): LINEAR[NORM] tasks scale their sums by each
    token's rsqrt(mean(x²) + eps), with the norm's weight packed into their columns; with small blocks
    the norm's row takes several BN chunks and the 4 tokens several TB groups (a scale per group);
    with TB=1 and ROWVEC=1 each token's rows (LINEAR and the experts') are stored as a vector, with the
    launch variants AHEAD (out rows looked up a step ahead), NARROW (the experts' slices, K = 32 and 64
    against KC = 128, in 4·BR x KC/4 chunks) and EF=2 (evict-first weights and cache rows: a cache hint,
    which the interpreter takes and ignores; test_kernel_compiles checks that it reaches the PTX)."""
    cfg, plan, interp, mk = _pair(name, blocks=blocks)
    assert any(decode(word).has("NORM") for word in plan.words if decode(word).op.name == "LINEAR")
    _compare(cfg, interp, mk, torch.tensor([2, 7]))


@pytest.mark.parametrize("T,B,blocks", [(2, 2, None), (1, 1, dict(TB=1, ROWVEC=1))])
def test_kernel_router_folds_its_norm_exactly(T, B, blocks):
    """Fusion rule norm_beside_experts (opt-in): the router is LINEAR[NORM, PAIR], its folded weights a high
    and a low part whose sums the kernel adds (HILO compiled in), in the token-group epilogue and in one
    token's row-vector one; the routing tables and logits equal the interpreter's.  The split is at bf16 in
    this fp32 arena too, so the low part is not zero: a kernel that dropped it would differ."""
    cfg, plan, interp, mk = _pair("tiny-moe", T=T, B=B, blocks=blocks, rules=DEFAULT_RULES + ("norm_beside_experts",))
    pairs = [decode(w) for w in plan.words if decode(w).op.name == "LINEAR" and decode(w).has("PAIR")]
    assert mk.blocks["HILO"] == 1 and pairs
    lo = next(s for s in plan.weights if s.name.endswith("~lo"))
    assert mk.mem.bufs[lo.buf][lo.offset: lo.offset + lo.rows * lo.cols].abs().max() > 0
    _compare(cfg, interp, mk, torch.tensor([3, 9][:B]))


def test_kernel_one_token_route_from_registers():
    """Launch variant ROUTE1 at T=1, B=1 (a decode step: one token per ROUTE): the slot table comes from
    the experts' ranks in registers; every routing table the step leaves equals the interpreter's."""
    cfg, plan, interp, mk = _pair("tiny-moe", T=1, B=1, blocks=dict(ROUTE1=1))
    assert any(decode(word).has("SLOTS") and decode(word)["N"] == 1 for word in plan.words
               if decode(word).op.name == "ROUTE")
    _compare(cfg, interp, mk, torch.tensor([5]))


@pytest.mark.parametrize("T,B,epf,rules,waits", [(2, 2, 1, DEFAULT_RULES, 1), (2, 2, 2, DEFAULT_RULES, 1),
                                                 (1, 1, 2, DEFAULT_RULES, 1),
                                                 (1, 1, 2, DEFAULT_RULES + ("expert_mlp",), 1),
                                                 (2, 2, 2, DEFAULT_RULES, 2)])
def test_kernel_expert_weights_guessed_before_the_wait(T, B, epf, rules, waits):
    """Launch variant EPF: an expert task requests its first weight chunk before its wait, for the expert its slot
    holds then, and streams it only if the slot still holds that expert after the wait.  The interpreter runs the
    route before the experts, so EPF=1 guesses right (or, for an empty slot, nothing); EPF=2 (a test hook) guesses
    from the next slot, so the chunk is requested again after the wait, and the last slot reads the table's next
    word (a count, not an expert id).  WAITS=2: the task's wait slots read before the guess."""
    cfg, plan, interp, mk = _pair("tiny-moe", T=T, B=B, blocks=dict(EPF=epf, TB=1, ROWVEC=1, WAITS=waits) if T == 1 else
                                  dict(EPF=epf, WAITS=waits), rules=rules)
    assert mk.blocks["EPF"] == epf
    _compare(cfg, interp, mk, torch.tensor([3, 9][:B]))


def test_kernel_norms_as_tasks_of_their_own():
    """Without norm_into_linear every layer's norms are RMSNORM tasks (the plain body, and the A side
    of the fold)."""
    cfg, plan, interp, mk = _pair("tiny-dense", rules=UNFOLDED)
    assert not any(decode(word).has("NORM") for word in plan.words if decode(word).op.name == "LINEAR")
    _compare(cfg, interp, mk, torch.tensor([2, 7]))


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-moe"])
def test_kernel_rope_split_by_heads(name):
    """TilingOptions.rope_heads: ROPE tasks of one head each (GQA's q and k into the cache, without
    rope_into_attention, which folds them into attention; MLA's interleaved q_pe and k_pe)."""
    rules = tuple(r for r in DEFAULT_RULES if r != "rope_into_attention")
    cfg, plan, interp, mk = _pair(name, tiling=TilingOptions(rope_heads=1), rules=rules)
    assert any(decode(word)["h0"] > 0 for word in plan.words if decode(word).op.name == "ROPE")
    _compare(cfg, interp, mk, torch.tensor([2, 7]))


@pytest.mark.parametrize("T,B,lens", [(2, 2, [3, 9]), (1, 1, [7]), (3, 1, [2])])
def test_kernel_rope_into_attention(T, B, lens):
    """Fusion rule rope_into_attention (opt-in): ATTENTION[ROPE] tasks rotate their query rows, and the split
    whose rows hold a new position writes its rotated key and its value into the cache before reading them
    (splits of 4 positions: cache lengths 3 and 2 put the step's tokens across two splits).  No ROPE or
    CACHE_WRITE task is left in the plan; logits, cache and activations equal the interpreter's."""
    cfg, plan, interp, mk = _pair("tiny-dense", T=T, B=B, rules=DEFAULT_RULES + ("rope_into_attention",))
    ops = {decode(w).op.name for w in plan.words}
    assert "ROPE" not in ops and "CACHE_WRITE" not in ops
    assert all(decode(w).has("ROPE") for w in plan.words if decode(w).op.name == "ATTENTION")
    _compare(cfg, interp, mk, torch.tensor(lens))


def test_tiny_blocks_cover_every_tiny_plan_as_one_kernel():
    """conftest.TINY_BLOCKS (the GPU tests' shared block sizes) raises the sizes fitted to every tiny
    plan the tests build to one set, which the launch checks accept: one JIT compile per dtype."""
    import itertools
    from megakernel.launch import LaunchConfig, launch_blocks, shared_blocks
    kernels = set()
    with shared_blocks(TINY_BLOCKS):  # raised to them, then checked, as a launch of each plan would be
        for name, T, B, split in itertools.product(TINY_PRESETS, (1, 2, 3, 8), (1, 2, 3), (4, 8)):
            cfg = preset(name)
            shape = StepShape(T=T, B=B, max_len=64, mtp_passes=1 if cfg.num_nextn_predict_layers else 0,
                              attn_split=split)
            plan = compile_step(cfg, shape, CompileOptions(workers=16))
            blocks = launch_blocks([decode(w) for w in plan.words], torch.bfloat16, LaunchConfig(), plan)
            kernels.add(tuple(sorted(blocks.items())))
    assert len(kernels) == 1


@pytest.mark.parametrize("name", TINY_PRESETS)
def test_kernel_with_the_shared_tiny_blocks_equals_the_interpreter(name):
    from megakernel.launch import shared_blocks
    with shared_blocks(TINY_BLOCKS):
        cfg, plan, interp, mk = _pair(name, T=1, B=2)
    assert mk.blocks["TB"] == 16 and mk.blocks["ATT_KIND"] == 0
    _compare(cfg, interp, mk, torch.tensor([4, 13]))


def test_kernel_partial_token_groups():
    """Three tokens in groups of two: the weight stream, the per-head matmuls (MLA) and the expert row
    lists each end on a group of one, with two weight chunks in flight; attention takes all of a
    task's query rows in one block of 32."""
    cfg, plan, interp, mk = _pair("tiny-moe", T=3, B=1, blocks=dict(TB=2, DEPTH=2, BM=32))
    assert any(decode(w).op.name == "HEAD_MATMUL" for w in plan.words)
    _compare(cfg, interp, mk, torch.tensor([7]))


@pytest.mark.parametrize("name", ["tiny-moe", "tiny-mhc"])
def test_kernel_unfused_blocked_workers(name):
    """Every unfused opcode too, spread over workers that only wait on earlier ones, in small tiles."""
    cfg, plan, interp, mk = _pair(name, workers=3, scheduler="blocked", fuse=False, T=3, B=1,
                                  tiling=TilingOptions(tile_bytes=2048, act_rows=2, row_align=4))
    assert plan.workers == 3 and "EWISE" in plan.opcode_counts()
    _compare(cfg, interp, mk, torch.tensor([5]))


def test_two_steps_reuse_counters_without_reset():
    cfg, plan, interp, mk = _pair("tiny-dense", passes=0)
    for lens in (torch.tensor([0, 3]), torch.tensor([2, 5])):
        _compare(cfg, interp, mk, lens)
    assert mk.epoch == 2 and int(mk.worker_epoch[0]) == 2


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-moe"])
def test_workers_read_the_inputs_from_the_stage_buffers(name):
    """Launch variant HIN=1: no copy of the step's inputs into the plan's slots (the graph's two copy nodes); worker 0
    copies the stage buffers before its first task and releases the inputs counter, which the other workers acquire
    before theirs (the interpreter runs program 0 first).  Over three workers and two steps of other
    tokens and cache lengths, the logits, caches and every int the step leaves (the input slots among them)
    equal the interpreter's: a worker that read a stale slot, or a step that kept the last step's inputs, shows."""
    cfg, plan, interp, mk = _pair(name, workers=3, scheduler="blocked", passes=0, blocks=dict(HIN=1))
    assert mk.host_inputs and plan.workers == 3
    mk.mem.io_view("in.cache_lens").fill_(-7)
    mk._stage(torch.ones(2, 2, dtype=torch.long), torch.tensor([4, 4]))
    mk._inputs_to_device()  # with HIN a no-op: the slots keep what they held
    assert torch.equal(mk.mem.io_view("in.cache_lens"), torch.full((2, 1), -7, dtype=torch.int32))
    for lens in (torch.tensor([0, 3]), torch.tensor([6, 2])):
        _compare(cfg, interp, mk, lens)
    assert mk.epoch == 2


def test_a_worker_that_never_sees_the_step_inputs_is_a_watchdog_error():
    """HIN: a worker whose inputs counter never reaches its step (its epoch pushed a step ahead, so it waits for
    inputs worker 0 has not released) stops at its bound before its first task, the inputs counter named; after
    the host's repair the next step equals the interpreter's."""
    from megakernel.runtime import WatchdogError
    cfg, plan, interp, mk = _pair("tiny-dense", workers=3, scheduler="blocked", passes=0)
    assert mk.host_inputs
    saved = mk.cache().clone()
    mk.worker_epoch[2] += 1
    with pytest.raises(WatchdogError, match=r"worker 2 timed out at task -1 \(before its first task\) waiting for "
                                            r"counter \d+ \(the step's inputs, copied from the host by worker 0"):
        mk.step(torch.zeros(2, 2, dtype=torch.long), torch.tensor([0, 0]))
    mk.worker_epoch[2] -= 1
    mk.cache().copy_(saved)  # what workers 0 and 1 wrote of the failed step
    _compare(cfg, interp, mk, torch.tensor([1, 1]))


@pytest.mark.parametrize("waits", [0, 1, 2])
def test_watchdog_reports_a_stalled_counter_and_recovers(waits):
    """A task made to wait on a counter nobody signals (in its first free wait slot) is a watchdog error naming it,
    and the next step runs; WAITS=1 (the next wait slot read before a poll) polls that slot too, and so does WAITS=2
    (a weight task's first two slots read before its weights)."""
    from megakernel.runtime import WatchdogError
    from graph.isa import decode
    cfg, plan, interp, mk = _pair("tiny-dense", passes=0, blocks=dict(WAITS=waits))
    # WAITS=2 reads the slots before a weight task's weights: a LINEAR's second slot (the wait after its first)
    t = 5 if waits < 2 else next(i for i, w in enumerate(plan.words) if decode(w).op.name == "LINEAR")
    undo = mk.inject_stall(t)
    with pytest.raises(WatchdogError,
                       match=rf"worker 0 timed out at task {t} .*\(the stall test counter\) to reach 1, saw 0"):
        mk.step(torch.zeros(2, 2, dtype=torch.long), torch.tensor([0, 0]))
    undo()
    _compare(cfg, interp, mk, torch.tensor([1, 1]))


def test_odd_dimensions_fall_back_to_scalar_alignment():
    """Vector loads need sizes and offsets that are multiples of ALIGN; a plan with odd ones gets 1."""
    from graph.isa import decode
    from megakernel.launch import alignment
    from megakernel.runtime import LaunchConfig, Megakernel

    def plan_alignment(p):
        return alignment([decode(w) for w in p.words])
    cfg = preset("tiny-dense").replace(intermediate_size=99, num_nextn_predict_layers=0)
    w = init_weights(cfg, seed=2)
    plan = compile_step(cfg, StepShape(T=1, B=2, max_len=12), CompileOptions(workers=1))
    assert plan_alignment(plan) == 1
    assert plan_alignment(_pair("tiny-dense", passes=0)[1]) == 8
    interp = Interpreter(plan, w)
    mk = Megakernel(plan, w, device="cpu", config=LaunchConfig(max_spins=2000))
    _compare(cfg, interp, mk, torch.tensor([0, 4]))


@triton.jit
def _slot_table_kernel(ids, st, P, E, S, BE: tl.constexpr, BP: tl.constexpr):
    moe.slot_table(ids, st, P, E, S, BE, BP)


def test_slot_table_body_equals_the_reference_layout():
    """The vectorised SLOTS stage against the reference's layout, for pair counts across chunks."""
    gen = torch.Generator().manual_seed(5)
    for E, P in ((8, 6), (64, 6), (64, 300), (256, 48)):
        ids = torch.randint(0, E, (P,), generator=gen, dtype=torch.int32)
        S = min(E, P)
        st = torch.full((2 * S + S * P,), -7, dtype=torch.int32)
        _slot_table_kernel[(1,)](ids, st, P, E, S, BE=max(16, triton.next_power_of_2(E)), BP=256)
        want = torch.full_like(st, -7)
        experts = torch.unique(ids)
        want[:S], want[S:2 * S] = -1, 0
        for s, e in enumerate(experts.tolist()):
            pairs = torch.nonzero(ids == e).flatten().int()
            want[s], want[S + s] = e, pairs.numel()
            want[2 * S + s * P: 2 * S + s * P + pairs.numel()] = pairs
        assert torch.equal(st, want), (E, P)


def test_block_overrides_that_would_change_the_result_are_refused():
    from megakernel.launch import MegakernelError, block_sizes, check_block_overrides
    from graph.isa import decode
    cfg = preset("tiny-moe")
    plan = compile_step(cfg, StepShape(T=2, B=2, max_len=16), CompileOptions(workers=1))
    fitted = block_sizes([decode(w) for w in plan.words], torch.float32)
    check_block_overrides({**fitted, "BR": 4, "KC": 64, "CPF": 1}, fitted)  # launch variants: fine
    check_block_overrides({**fitted, "ATT_KIND": 0}, fitted)  # the flag read per task: the same result
    refused = [({"BK": 1}, "BK=1"), ({"BR": 64, "KC": 1024}, "BR=64, KC=1024"), ({"ALIGN": 16}, "ALIGN=16"),
               ({"ATT_KIND": 2}, "ATT_KIND=2: this plan's attention tasks are all MLA"),
               ({"BI": 256, "BO": 256}, "BI=256, BO=256"), ({"XKEEP": 1}, "unknown block override XKEEP"),
               ({"TB": 3}, "TB=3: tokens per weight chunk"), ({"DEPTH": 3}, "DEPTH=3: 1 or 2"),
               ({"PF": 3}, "PF=3: 0 .no L2 prefetch."), ({"ROWVEC": 3}, "ROWVEC=3: 0, 1"),
               ({"ROWVEC": 2}, "ROWVEC=2: the Triton interpreter runs no inline PTX"),
               ({"PF": 1}, "PF=1: the Triton interpreter runs no inline PTX"),  # this suite runs interpreted
               ({"PFD": 5}, "PFD=5: 0 .no rolling prefetch.. 1-4 row blocks ahead into the L2 or -1, -2"),
               ({"PFD": 2}, "PFD=2: the Triton interpreter runs no inline PTX"),
               ({"PFD": -1}, "PFD=-1: the Triton interpreter runs no inline PTX"),
               ({"PFD": -1, "DEPTH": 2}, "PFD=-1 with DEPTH=2: the L1's rolling prefetch"),
               ({"EF": 3}, "EF=3: 0, 1 .evict-first weight stream. or 2"),
               ({"WPF": 1}, "WPF=1: the Triton interpreter runs no inline PTX"),
               ({"APF": 1}, "APF=1: the Triton interpreter runs no inline PTX"), ({"APF": 3}, "APF=3: 0, 1"),
               ({"PFK": 64}, "PFK=64: the Triton interpreter runs no inline PTX"), ({"PFK": -1}, "PFK=-1: 0 .off."),
               ({"AHEAD": 2}, "AHEAD=2: 0, or 1"), ({"ROUTE1": 2}, "ROUTE1=2: 0, or 1"),
               ({"NARROW": 2}, "NARROW=2: 0, or 1"), ({"NARROW": 1, "KC": 16}, "NARROW=1 needs KC/4"),
               ({"POLL": 3}, "POLL=3: 0 .a scalar acquire atomic."),
               ({"POLL": 2}, "POLL=2: the Triton interpreter runs no inline PTX"),
               ({"HIN": 2}, "HIN=2: 0 .inputs copied"), ({"EPF": 3}, "EPF=3: 0, 1 .an expert task's first"),
               ({"QIX": 4}, "QIX=4: 0, or bits 1"), ({"SIG": 3}, "SIG=3: 0, 1 or 2"),
               ({"WAITS": 3}, "WAITS=3: 0, 1 "), ({"PIN": 3}, "PIN=3: 0, 1 .one-token slices"),
               ({"PIN": 2, "EPF": 1}, "PIN=2 with EPF=1: a guessed first chunk"),
               ({"PIN": 1}, "PIN=1: the Triton interpreter runs no inline PTX"),
               ({"PIN": 2, "KC": 128}, "PIN=2: flat streams read bf16 pairs in chunks of KC >= 256 columns, and "
                                       "this kernel has KC=128"),
               ({"PIN": 2, "KC": 256}, "PIN=2: the Triton interpreter runs no inline PTX"),
               ({"POLL": 1}, "POLL=1: the Triton interpreter runs no inline PTX")]
    for override, why in refused:
        with pytest.raises(MegakernelError, match=why):
            check_block_overrides({**fitted, **override}, fitted)
    with pytest.raises(MegakernelError, match="SAMPLE=0"):
        check_block_overrides({**fitted, "SAMPLE": 0}, {**fitted, "SAMPLE": 1})
    with pytest.raises(MegakernelError, match="HELPER_SIDE=0: this plan has a persistent helper"):
        check_block_overrides({**fitted, "HELPER_SIDE": 0}, {**fitted, "HELPER_SIDE": 1})


@pytest.mark.parametrize("field,value,says", [("num_warps", 3, "num_warps=3: a power of two"),
                                              ("num_stages", 0, "num_stages=0: at least 1"),
                                              ("timeout_s", 0.0, "timeout_s=0.0: a wait's bound must be > 0"),
                                              ("helper_timeout_s", -1.0, "helper_timeout_s=-1.0"),
                                              ("max_spins", 0, "max_spins=0: at least 1")])
def test_launch_configs_that_cannot_run_are_refused_by_field(field, value, says):
    from megakernel.launch import LaunchConfig, MegakernelError
    with pytest.raises(MegakernelError, match=says):
        LaunchConfig(**{field: value})


def test_block_sizes_fit_the_step():
    """Tokens per weight chunk (TB) and attention query rows per block (BM) follow the step's shape:
    T=1 keeps the smallest kernel, GQA takes a task's T x heads rows in one block, MLA keeps 16."""
    from megakernel.launch import block_sizes

    def fitted(name, T, B):
        # two layers at the preset's real width: llama-1b's layers are all alike, and dsv2-lite's are its dense
        # first layer then 26 alike MoE layers, so the plan has every task shape the whole model's has and the
        # same fitted sizes (the maximum over its tasks), at a tenth of the compile (~12 s for the four)
        cfg = preset(name).replace(num_hidden_layers=2)
        assert cfg.first_k_dense_replace <= 1
        plan = compile_step(cfg, StepShape(T=T, B=B, max_len=256), CompileOptions(workers=132))
        blocks = block_sizes([decode(w) for w in plan.words], torch.bfloat16)
        return blocks["TB"], blocks["BM"]

    assert fitted("llama-1b", 1, 1) == (1, 16)
    assert fitted("llama-1b", 6, 1) == (8, 32)  # 6 tokens x 4 query heads per KV head
    assert fitted("llama-1b", 8, 4) == (16, 32)
    assert fitted("dsv2-lite", 6, 1) == (8, 16)  # MLA: 512-wide rows


def test_route_with_many_experts_and_a_large_top_k_is_refused():
    """Past 64 experts ROUTE takes rounds of argmax into a 16-wide register row; a plan asking more
    is refused before launch, by task (64 experts rank them all: any k)."""
    from graph.isa import decode
    from megakernel.launch import MegakernelError, check_operand_buffers
    for experts, k, refused in ((128, 17, True), (64, 17, False), (128, 16, False)):
        cfg = preset("tiny-mhc").replace(n_routed_experts=experts, num_experts_per_tok=k)
        plan = compile_step(cfg, StepShape(T=1, B=1, max_len=8), CompileOptions(workers=1))
        tasks = [decode(w) for w in plan.words]
        if refused:
            with pytest.raises(MegakernelError, match="17 of 128 experts per token"):
                check_operand_buffers(plan, tasks)
        else:
            check_operand_buffers(plan, tasks)


def test_gqa_attention_tasks_keep_to_one_kv_group():
    """The GQA body reads one KV head a task (h0's group's keys and values) and, as ATTENTION[ROPE], writes that
    head's new rows: whatever TilingOptions.attn_heads asks, a task's heads lie in one group (with ROPE, the whole
    group: two tasks writing one head's rows raced), and a plan whose task spans two groups is refused by task.
    attn_heads=4 over tiny-dense's groups of 2 used to make one task of both groups, wrong on the GPU body."""
    import dataclasses

    from megakernel.launch import MegakernelError, check_operand_buffers
    cfg = preset("tiny-dense")
    for heads in (1, 2, 3, 4):
        for rules in (DEFAULT_RULES, tuple(r for r in DEFAULT_RULES if r != "rope_into_attention")):
            plan = compile_step(cfg, StepShape(T=1, B=1, max_len=8), CompileOptions(
                workers=2, tiling=TilingOptions(attn_heads=heads), fusion_rules=rules))
            tasks = [decode(w) for w in plan.words]
            att = [t for t in tasks if t.op.name == "ATTENTION"]
            assert att and all(t["h0"] // t["group"] == (t["h1"] - 1) // t["group"] for t in att), (heads, rules)
            if "rope_into_attention" in rules:
                assert all(t["h1"] - t["h0"] == t["group"] for t in att)
                rope_plan, rope_tasks = plan, tasks
            check_operand_buffers(plan, tasks)
    plan, tasks = rope_plan, rope_tasks
    i = next(k for k, t in enumerate(tasks) if t.op.name == "ATTENTION")
    t = tasks[i]
    tasks[i] = dataclasses.replace(t, fields={**t.fields, "h1": t["h0"] + 2 * t["group"]})
    with pytest.raises(MegakernelError, match=f"task {i} .*span KV groups of 2"):
        check_operand_buffers(plan, tasks)
    assert t.has("ROPE")
    tasks[i] = dataclasses.replace(t, fields={**t.fields, "h1": t["h0"] + 1})
    with pytest.raises(MegakernelError, match=f"task {i} .*not one whole KV group of 2"):
        check_operand_buffers(plan, tasks)


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-moe"])
def test_attention_key_blocks_in_flight_change_nothing(name):
    """ATTENTION's launch variant STAGES (key blocks requested ahead: 1, 2 the default, 3) changes when loads are
    issued, not the sums: over splits of several key blocks (BJ=1 against splits of 4 positions), every depth
    equals the interpreter and the three give the same bits."""
    logits = []
    for stages in (1, 2, 3):
        cfg, plan, interp, mk = _pair(name, passes=0, blocks=dict(BJ=1, STAGES=stages))
        assert plan.shape["attn_split"] == 4 and mk.blocks["STAGES"] == stages
        _compare(cfg, interp, mk, torch.tensor([5, 13]))
        logits.append(mk.result().logits)
    assert torch.equal(logits[0], logits[1]) and torch.equal(logits[1], logits[2])


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-moe"])
def test_attention_query_rows_indexed_without_division_change_nothing(name):
    """ATTENTION's QIX=3 (a query row's token and head by a float reciprocal, the cache length requested after
    the query rows; MLA plans' default, a launch variant for GQA) reads the same rows as QIX=0: three tokens of
    two sequences (rows t·heads + h) in tiles of BM=2 rows, so a split runs several query tiles, GQA with its rope
    and cache writes, and MLA, equal the interpreter and each other bit for bit."""
    logits = []
    for qix in (0, 3):
        cfg, plan, interp, mk = _pair(name, T=3, passes=0, blocks=dict(QIX=qix, BM=2))
        assert mk.blocks["QIX"] == qix
        _compare(cfg, interp, mk, torch.tensor([5, 9]))
        logits.append(mk.result().logits)
    assert torch.equal(logits[0], logits[1])


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-moe"])
def test_task_fields_read_early_change_nothing(name):
    """SIG (when a task reads the index of the counter it signals: 1, the default, with its opcode; 0 after its
    closing barrier; 2 before that barrier) and WAITS (1, the default: a task's next wait slot read before its
    current wait's poll, masked off past its last wait; 0 after it) move loads, not values: on three workers whose
    queues wait on earlier ones, with tasks of one and of several waits (tiny-dense's fused plan has none of several:
    unfused here), every setting equals the interpreter and all give the same bits."""
    logits = []
    for blocks in (dict(SIG=0, WAITS=0), dict(SIG=1, WAITS=0), dict(SIG=2, WAITS=1), dict(SIG=1, WAITS=1)):
        cfg, plan, interp, mk = _pair(name, workers=3, scheduler="blocked", fuse=name != "tiny-dense", blocks=blocks)
        assert plan.workers == 3 and all(mk.blocks[k] == v for k, v in blocks.items())
        waits = [len(decode(w).waits) for w in plan.words]
        assert 1 in waits and max(waits) >= 2
        _compare(cfg, interp, mk, torch.tensor([3, 7]))
        logits.append(mk.result().logits)
    assert all(torch.equal(logits[0], other) for other in logits[1:])


def test_greedy_argmax_takes_the_first_of_tied_maxima():
    """ARGMAX over several vocab blocks (vocab_block=128), each read in two pieces (BD=4: 64 logits a piece): with
    the top logit tied within a lane across pieces (ids 10 and 74), across lanes (20) and across blocks (200),
    as identical lm_head rows make it, the megakernel's greedy token is the first tied id, as the interpreter's."""
    from megakernel.runtime import LaunchConfig, Megakernel
    cfg = preset("tiny-moe")
    w = init_weights(cfg, seed=3)
    plan = compile_step(cfg, StepShape(T=1, B=1, max_len=16, attn_split=4), CompileOptions(workers=1, vocab_block=128))
    assert sum(decode(x).op.name == "ARGMAX" for x in plan.words) == 5  # 4 blocks and the final reduction
    tied, row = [74, 10, 20, 200], torch.randn(cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    tokens, lens = torch.tensor([[7]]), torch.tensor([5])
    for sign in (1.0, -1.0):  # the tied rows' logit is the largest for one sign of the row
        w["lm_head.weight"][tied] = sign * 20 * row
        interp = Interpreter(plan, w)
        if interp.step(tokens, lens).tokens.item() == 10:
            break
    assert interp.result().tokens.item() == 10
    mk = Megakernel(plan, w, device="cpu", config=LaunchConfig(max_spins=2000, blocks=dict(BD=4)))
    got = mk.step(tokens, lens)
    assert mk.blocks["BD"] == 4 and torch.equal(got.logits[0, 0, tied], got.logits[0, 0, tied[:1]].expand(4))
    assert got.tokens.item() == 10


@pytest.mark.parametrize("T,B,blocks", [(2, 2, None), (1, 1, dict(TB=1, ROWVEC=1))])
def test_kernel_expert_mlp_sums_partials(T, B, blocks, monkeypatch):
    """Fusion rule expert_mlp (opt-in): EXPERT_LINEAR[SILU_MUL, DOWN_T] tasks stream their slice's gate|up rows, then
    the same rows of the down projection packed transposed into a partial row per pair; MOE_COMBINE adds the slices
    (two here: 16-row slices of tiny-moe's 32).  The shared expert alike, as LINEAR[SILU_MUL, DOWN_T] in slices of
    24 and 8 rows.  Several pairs a slot (T = B = 2) and one token."""
    import graph.fusion_weights
    monkeypatch.setattr(graph.fusion_weights, "EXPERT_SLICE_ROWS", 16)
    cfg, plan, interp, mk = _pair("tiny-moe", T=T, B=B, blocks=blocks, rules=DEFAULT_RULES + ("expert_mlp",))
    fused = [decode(w) for w in plan.words if decode(w).op.name == "EXPERT_LINEAR"]
    assert fused and all(t.has("DOWN_T") for t in fused) and {t["slice"] for t in fused} == {0, 1}
    shared = [decode(w) for w in plan.words if decode(w).op.name == "LINEAR" and decode(w).has("DOWN_T")]
    assert shared and {(t["slice"], t["r0"], t["r1"]) for t in shared} == {(0, 0, 24), (1, 24, 32)}
    assert mk.blocks["KD"] == cfg.hidden_size
    _compare(cfg, interp, mk, torch.tensor([3, 9][:B]))


def test_kernel_combine_takes_more_slices_than_one_load(monkeypatch):
    """MOE_COMBINE over partials requests the first NSB expert slices and NSH shared slices with the residual, then
    loops for the rest: loads one slice wide here (dsv2-lite's 22 and 118 slices fit one load), so the loops run."""
    import graph.fusion_weights
    from megakernel.ops import moe
    monkeypatch.setattr(graph.fusion_weights, "EXPERT_SLICE_ROWS", 8)
    monkeypatch.setattr(moe, "NSB", tl.constexpr(1))
    monkeypatch.setattr(moe, "NSH", tl.constexpr(1))
    cfg, plan, interp, mk = _pair("tiny-moe", T=2, B=2, rules=DEFAULT_RULES + ("expert_mlp",))
    combine = [decode(w) for w in plan.words if decode(w).op.name == "MOE_COMBINE"]
    assert combine and all(t["ns"] == 4 and t["nsh"] == 2 for t in combine)
    _compare(cfg, interp, mk, torch.tensor([3, 9]))


@pytest.mark.parametrize("T,B,blocks", [(2, 2, None), (1, 1, dict(TB=1, ROWVEC=1))])
def test_kernel_dense_mlp_sums_partials(T, B, blocks):
    """Fusion rule dense_mlp (opt-in): tiny-dense's MLPs as LINEAR[SILU_MUL, DOWN_T] in 16 slices of 8 rows, whose
    partial rows a MOE_COMBINE with no routed experts (topk 0) sums before adding the residual."""
    cfg, plan, interp, mk = _pair("tiny-dense", T=T, B=B, blocks=blocks, rules=DEFAULT_RULES + ("dense_mlp",))
    tasks = [decode(w) for w in plan.words]
    assert {t["slice"] for t in tasks if t.op.name == "LINEAR" and t.has("DOWN_T")} == set(range(16))
    assert any(t.op.name == "MOE_COMBINE" and t["topk"] == 0 and t["nsh"] == 16 for t in tasks)
    _compare(cfg, interp, mk, torch.tensor([3, 9][:B]))
