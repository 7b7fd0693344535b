"""Layer 4 (GPU): the megakernel against the plan interpreter and the reference, batch invariance,
launches per step, the watchdog and the co-residency check.  Run on a GPU with `pytest -m gpu`."""

import pytest
import torch

from graph.compile import CompileOptions, compile_step
from graph.fusion import DEFAULT_RULES, RULES
from graph.lower import StepShape
from model import TINY_PRESETS, Cache, Reference, init_weights, preset

from .conftest import UNFOLDED, rel_err, stall_is_a_watchdog_error_then_recovers

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("one_kernel_for_tiny_models")]
BF16_TOL = 1e-2
# GQA's ropes and value cache write as tasks of their own (rope_into_attention, a default since session 21, off)
SEPARATE_ROPES = tuple(r for r in DEFAULT_RULES if r != "rope_into_attention")
BESIDE_EXPERTS = DEFAULT_RULES + ("norm_beside_experts",)
EXPERT_MLP = DEFAULT_RULES + ("expert_mlp",)
DENSE_MLP = DEFAULT_RULES + ("dense_mlp",)


def _setup(name, T=2, B=2, max_len=64, workers=16, passes=0, layers=None, seed=0, rules=DEFAULT_RULES, shared=True):
    from megakernel.runtime import Megakernel
    cfg = preset(name)
    if layers is not None:
        cfg = cfg.replace(num_hidden_layers=layers)
    w = init_weights(cfg, seed=seed, device="cuda", dtype=torch.bfloat16)
    plan = compile_step(cfg, StepShape(T=T, B=B, max_len=max_len, mtp_passes=passes),
                        CompileOptions(workers=workers, fusion_rules=rules, shared_counters=shared))
    mk = Megakernel(plan, w, "cuda", torch.bfloat16)
    return cfg, w, plan, mk


def _random_cache(mk, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk.cache().copy_(torch.randn(mk.cache().shape, device="cuda", generator=g))


@pytest.mark.parametrize("name", TINY_PRESETS)
def test_tiny_megakernel_equals_interpreter(name):
    from megakernel.interpreter import Interpreter
    cfg, w, plan, mk = _setup(name, passes=1 if preset(name).num_nextn_predict_layers else 0)
    _random_cache(mk)
    interp = Interpreter(plan, None, "cuda", share=mk.mem)
    saved = mk.cache().clone()
    tokens = torch.randint(0, cfg.vocab_size, (2, 2), device="cuda")
    lens = torch.tensor([0, 17], device="cuda")
    want = interp.step(tokens, lens)
    mk.cache().copy_(saved)
    mk.capture()
    got = mk.step(tokens, lens)
    assert rel_err(got.logits, want.logits) <= BF16_TOL
    for a, b in zip(got.mtp_logits, want.mtp_logits):
        assert rel_err(a, b) <= BF16_TOL


@pytest.mark.parametrize("name,rules", [(n, r) for n in ("llama-1b", "dsv2-lite") for r in (DEFAULT_RULES, UNFOLDED)]
                         + [("dsv2-lite", RULES), ("llama-1b", SEPARATE_ROPES), ("llama-1b", DENSE_MLP)],
                         ids=["llama-1b-default", "llama-1b-norms_unfolded", "dsv2-lite-default",
                              "dsv2-lite-norms_unfolded", "dsv2-lite-all_rules", "llama-1b-separate_ropes",
                              "llama-1b-dense_mlp"])
def test_large_megakernel_equals_interpreter(name, rules):
    from megakernel.interpreter import Interpreter
    cfg, w, plan, mk = _setup(name, T=1, B=1, max_len=256,
                              workers=torch.cuda.get_device_properties(0).multi_processor_count,
                              layers=4 if name == "dsv2-lite" else None, rules=rules)
    _random_cache(mk)
    interp = Interpreter(plan, None, "cuda", share=mk.mem)
    saved = mk.cache().clone()
    tokens = torch.randint(0, cfg.vocab_size, (1, 1), device="cuda")
    lens = torch.tensor([200], device="cuda")
    want = interp.step(tokens, lens)
    mk.cache().copy_(saved)
    got = mk.step(tokens, lens)
    assert rel_err(got.logits, want.logits) <= BF16_TOL


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-moe", "llama-1b"])
def test_shared_counters_give_the_same_bits(name):
    """Compile option shared_counters (the default: attention's producers signal one counter): the same kernel,
    one poll where there were 3-4, the same logits bit for bit as the plan without it, over two replays."""
    layers = 4 if name == "llama-1b" else None
    cfg, w, plan, mk = _setup(name, layers=layers, shared=False)
    _, _, shared_plan, shared = _setup(name, layers=layers)
    assert plan.num_tasks == shared_plan.num_tasks and plan.words.tolist() != shared_plan.words.tolist()
    _random_cache(mk)
    shared.cache().copy_(mk.cache())
    for step in range(2):
        gen = torch.Generator("cuda").manual_seed(step)
        tokens = torch.randint(0, cfg.vocab_size, (2, 2), device="cuda", generator=gen)
        lens = torch.tensor([3 + 2 * step, 20 + 2 * step], device="cuda")
        want, got = mk.step(tokens, lens).logits.clone(), shared.step(tokens, lens).logits
        assert torch.equal(got, want), step


def _variant_logits(name, B, max_len, lens, variants):
    """(the default kernel's logits, [(blocks, logits)] of each launch variant) for one step of `name` cut to
    4 layers on the GPU's workers, each from the same random cache.  The kernels compile side by side first."""
    from megakernel.launch import precompile_side_by_side
    from megakernel.runtime import LaunchConfig, Megakernel
    cfg, w, plan, mk = _setup(name, T=1, B=B, max_len=max_len, layers=4,
                              workers=torch.cuda.get_device_properties(0).multi_processor_count)
    precompile_side_by_side(plan, torch.bfloat16, [LaunchConfig()] + [LaunchConfig(blocks=b) for b in variants])
    _random_cache(mk)
    saved = mk.cache().clone()
    tokens = torch.randint(0, cfg.vocab_size, (B, 1), device="cuda")
    lens = torch.tensor(lens, device="cuda")
    want = mk.step(tokens, lens).logits.clone()
    out = []
    for blocks in variants:
        mk.cache().copy_(saved)
        out.append((blocks, Megakernel(plan, None, "cuda", share=mk.mem,
                                       config=LaunchConfig(blocks=blocks)).step(tokens, lens).logits))
    return want, out


def test_launch_variants_on_dsv2_lite():
    """Launch variants on dsv2-lite's shapes against the default kernel (AHEAD, ROUTE1 and the L2 hints EF=1,
    WPF, APF on): the paths they replaced (AHEAD=0: an expert tile's out row looked up at each row block's end;
    ROUTE1=0: the slot table from the ids read back; EF=0, WPF=0, APF=0, PFK=0: no cache hints or prefetches), the
    stream's deeper prefetches (PFD: L2 prefetch of the row blocks ahead; DEPTH=2: a second chunk in
    registers), EF=2 (per-head matmul weights and attention's cache rows evict-first too) and EPF (an expert
    task's first chunk requested before its wait for the expert its slot held then; EPF=2 guesses from the next
    slot, so every chunk is requested again), QIX=3 (MLA's query rows indexed without integer division, the cache
    length requested after them) and PIN=0 or WAITS=1 with PIN=0 (the defaults before session 50: no pinned stream,
    no wait slots read before the weights) and PFD=-1 (each stream's next chunk but one asked of the L1 line by
    line) give the same logits bit for bit; NARROW (K = 1408 and 2816 slices
    in 4·BR x KC/4 chunks) sums each row's K in other chunks, so within fp32 rounding of them."""
    exact = [dict(AHEAD=0, ROUTE1=0), dict(PFD=2), dict(DEPTH=2, PFD=1), dict(EF=0, WPF=0, APF=0, PFK=0), dict(EF=2),
             dict(PFK=256), dict(EPF=1), dict(EPF=2), dict(QIX=3), dict(PIN=0), dict(WAITS=1, PIN=0), dict(PFD=-1)]
    want, got = _variant_logits("dsv2-lite", 1, 256, [200], exact + [dict(NARROW=1)])
    for blocks, logits in got:
        assert torch.equal(logits, want) if blocks in exact else rel_err(logits, want) <= 1e-5, blocks


@pytest.mark.parametrize("name", ["llama-1b", "dsv2-lite"])
def test_pinned_stream_gives_the_same_bits(name):
    """PIN=1 (one-token LINEAR and expert slices with K <= KC through linear.stream_pinned: the activation chunk
    loaded once, the next weight chunk requested above the multiply; dsv2-lite's default) sums what PIN=0's stream
    (llama-1b's default) sums in the same order: the same logits bit for bit at B=1, where every slice is one token
    (4 layers).  PIN=2 (and dsv2-lite's routed down slices, K = 1408, through linear_flat.stream_flat) folds each
    row in that order too, but its loop compiles to other fused multiply-adds on the GPU: within rounding (H100,
    PERF session 49)."""
    want, got = _variant_logits(name, 1, 1024, [700], [dict(PIN=0), dict(PIN=1), dict(PIN=2)])
    for blocks, logits in got:
        assert torch.equal(logits, want) if blocks["PIN"] != 2 else rel_err(logits, want) <= 1e-5, blocks


@pytest.mark.parametrize("name", ["llama-1b", "dsv2-lite"])
def test_wait_slots_before_weights_give_the_same_bits(name):
    """WAITS=2 (dsv2-lite's default, llama-1b's is 1: a LINEAR or HEAD_MATMUL task's first two wait slots read
    before its first weights, so its poll's compare does not wait for them; with EPF=1 an expert task's guessed first
    chunk too) moves no value: the same logits bit for bit, at B=2 with a cache longer than a split (4 layers)."""
    want, got = _variant_logits(name, 2, 1024, [700, 1000], [dict(WAITS=1), dict(WAITS=2), dict(WAITS=2, EPF=1)])
    for blocks, logits in got:
        assert torch.equal(logits, want), blocks


def test_gqa_cache_prefetch_on_llama_1b():
    """The default kernel (APF=2: a GQA split's head lines asked of the L2 before its wait), APF=0 (no cache
    prefetch), PFK (a LINEAR task's next weights asked of the L2 before its wait), STAGES=3 (two key blocks in
    flight), QIX=3 (the query rows indexed without integer division), SIG=0 with WAITS=0 (the signalled counter's
    index read after the body, a wait slot after the previous poll: the defaults before session 42) and SIG=2 (that
    index read before the closing barrier), PIN=1 and PFD=-1 and -2 (the weight stream's chunk one or two steps
    after the next asked of the L1) give the same logits bit for bit on llama-1b's shapes (4 layers, B=2, a
    cache longer than a split): a prefetch moves no value, and an address past the cache would show up as a fault
    here (or under compute-sanitizer)."""
    want, got = _variant_logits("llama-1b", 2, 1024, [700, 1000],
                                [dict(APF=0), dict(PFK=256), dict(STAGES=3), dict(QIX=3), dict(SIG=0, WAITS=0),
                                 dict(SIG=2), dict(PIN=1), dict(PFD=-1), dict(PFD=-2)])
    for blocks, logits in got:
        assert torch.equal(logits, want), blocks


@pytest.mark.parametrize("poll", [1, 2])
def test_acquire_load_polls_give_the_same_bits(poll):
    """Launch variants POLL=1 (every dependency wait polls with each thread's ld.acquire.gpu, not one thread's
    acquire atomic) and POLL=2 (one thread's acquire load that also asks the L1 for the task's word, shared through
    a word of static shared memory) change when a task sees its counters, not what it computes: llama-1b's logits
    (4 layers, B=2) bit for bit, and the watchdog still turns a stalled counter into an error and recovers."""
    from megakernel.runtime import LaunchConfig, Megakernel
    want, got = _variant_logits("llama-1b", 2, 1024, [700, 1000], [dict(POLL=poll)])
    for blocks, logits in got:
        assert torch.equal(logits, want), blocks
    cfg, w, plan, _ = _setup("tiny-moe")
    mk = Megakernel(plan, w, "cuda", torch.bfloat16, config=LaunchConfig(blocks=dict(POLL=poll)))
    mk.capture()
    stall_is_a_watchdog_error_then_recovers(mk, plan.num_tasks // 2, torch.zeros(2, 2, dtype=torch.long, device="cuda"),
                                            torch.tensor([0, 0], device="cuda"))


def _top2_gap(logits):
    """(top-1 minus top-2 logit, the top logit's magnitude, at least 1) per row."""
    top = logits.float().topk(2, dim=-1).values
    return top[..., 0] - top[..., 1], top[..., 0].abs().clamp_min(1.0)


def _near_tie(logits, tol=BF16_TOL):
    gap, scale = _top2_gap(logits)
    return gap <= tol * scale


# the large shapes as test_large builds them (the same kernels): B=1, dsv2-lite cut to 4 layers
# tiny-moe with every rule: the gate for making the opt-in norm_beside_experts a default.  No version has held it:
# session 15's (the router's W·diag(g) rounded to bf16), session 16's (the router exact, the shared experts folded)
# and session 17's (only the router folds, exactly, as LINEAR[PAIR]; every expert reads the norm's rows) each moved
# one token, the same one in the last two (step 9, reference margin 0.054), so the shared experts' fold was not
# the cause.  Kept as a strict xfail, so that a fold which holds the bar shows up as a pass to act on.  For a MoE
# model the check holds for a draw, not for every draw: top-k routing turns a ~1e-3 change into another expert
# set, and the default rules miss tokens on most CPU draws too (docs/NOTES.md, session 16)
NOT_YET = pytest.mark.xfail(strict=True, reason="norm_beside_experts moves a tiny-moe token (step 9) on the GPU")
TEACHER_CASES = ([(n, DEFAULT_RULES, 2, None) for n in TINY_PRESETS] + [("tiny-dense", UNFOLDED, 2, None),
                                                                       pytest.param("tiny-moe", BESIDE_EXPERTS, 2, None,
                                                                                    marks=NOT_YET)]
                 + [(n, r, 1, 4 if n == "dsv2-lite" else None) for n in ("llama-1b", "dsv2-lite")
                    for r in (DEFAULT_RULES, UNFOLDED)]
                 + [("tiny-dense", SEPARATE_ROPES, 2, None), ("llama-1b", SEPARATE_ROPES, 1, None)]
                 # the opt-in MLP fusions, before either could become a default
                 + [("llama-1b", DENSE_MLP, 1, None), ("dsv2-lite", EXPERT_MLP, 1, 4)])
RULE_IDS = {DEFAULT_RULES: "default", UNFOLDED: "unfolded", RULES: "all_rules", SEPARATE_ROPES: "separate_ropes",
            BESIDE_EXPERTS: "norm_beside_experts", EXPERT_MLP: "expert_mlp", DENSE_MLP: "dense_mlp"}


@pytest.mark.parametrize("name,rules,B,layers", TEACHER_CASES,
                         ids=[f"{n}-{RULE_IDS[r]}" for n, r, _, _ in (getattr(c, "values", c) for c in TEACHER_CASES)])
def test_teacher_forced_greedy_64_steps(name, rules, B, layers):
    large = layers is not None or name == "llama-1b"
    max_len = 256 if large else 80
    workers = torch.cuda.get_device_properties(0).multi_processor_count if large else 16
    cfg, w, plan, mk = _setup(name, T=1, B=B, max_len=max_len, workers=workers, layers=layers, rules=rules)
    mk.capture()
    # the plain model on the same (bf16) weights, computed in fp32, keeping its cache in bf16 as the
    # engine does (an fp32 cache differs by the cache's rounding, which put one token of one random
    # draw just past the near-tie margin); the draw is seeded so a failure can be rerun
    ref = Reference(cfg, {k: v.float() for k, v in w.items()})
    cache = Cache.allocate(cfg, B, max_len, torch.bfloat16, "cuda")
    tokens = torch.randint(0, cfg.vocab_size, (B, 1), device="cuda",
                           generator=torch.Generator(device="cuda").manual_seed(0))
    lens = torch.zeros(B, dtype=torch.long, device="cuda")
    mismatches = []  # (step, sequence, the reference's top-2 margin relative to its top logit)
    for step in range(64):
        got = mk.step(tokens, lens)
        want = ref.step(tokens, cache, lens).logits
        differ = (got.tokens != want.argmax(-1)) & ~_near_tie(want)
        gap, scale = _top2_gap(want)
        margin = gap / scale
        mismatches += [(step, int(b), round(float(margin[b, 0]), 4)) for b in differ[:, 0].nonzero()[:, 0]]
        tokens = want.argmax(-1)  # teacher forcing: both consume the reference's token
        lens = lens + 1
    assert not mismatches, f"greedy tokens differ from the plain model's at (step, sequence, margin) {mismatches}"


@pytest.mark.parametrize("name,rules", [(n, DEFAULT_RULES) for n in TINY_PRESETS] + [("tiny-moe", UNFOLDED),
                                                                                      ("tiny-dense", SEPARATE_ROPES),
                                                                                      ("tiny-moe", EXPERT_MLP),
                                                                                      ("tiny-dense", DENSE_MLP)])
def test_batch_invariance_and_run_to_run(name, rules, monkeypatch):
    """Sequence 0's logits are bit-identical alone, beside another sequence, and inside a longer step.  With
    expert_mlp, tiny-moe's experts in two 16-row slices and its shared expert in slices of 24 and 8, so MOE_COMBINE
    adds partials; with dense_mlp, tiny-dense's MLPs in 16 slices of 8 rows."""
    from megakernel.runtime import Megakernel
    import graph.fusion_weights
    monkeypatch.setattr(graph.fusion_weights, "EXPERT_SLICE_ROWS", 16)
    cfg = preset(name)
    w = init_weights(cfg, seed=1, device="cuda", dtype=torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(3)
    prefix = torch.randn(cfg.num_layers_total, 1, 32, cfg.cache_width, device="cuda", generator=g)
    tok = torch.randint(0, cfg.vocab_size, (1, 3), device="cuda", generator=g)

    def run(T, B):
        plan = compile_step(cfg, StepShape(T=T, B=B, max_len=32, attn_split=8),
                            CompileOptions(workers=8, fusion_rules=rules))
        mk = Megakernel(plan, w, "cuda", torch.bfloat16)
        mk.cache()[:, :1].copy_(prefix)
        if B > 1:
            mk.cache()[:, 1:].copy_(torch.randn_like(mk.cache()[:, 1:]))
        toks = tok[:, :T].repeat(B, 1)
        if B > 1:
            toks[1:] = torch.randint(0, cfg.vocab_size, toks[1:].shape, device="cuda")
        return mk.step(toks, torch.tensor([5] * B, device="cuda")).logits[0, 0]

    alone = run(1, 1)
    assert torch.equal(alone, run(1, 1))  # run to run
    assert torch.equal(alone, run(1, 3))  # beside neighbours
    assert torch.equal(alone, run(3, 1))  # first token of a 3-token step


@pytest.mark.parametrize("name", ["tiny-moe", "llama-1b"])
def test_one_graph_replay_is_one_launch(name):
    """The default (HIN=1): the captured step is the kernel alone, which copies its inputs from the host."""
    from megakernel.profiler import count_launches
    cfg, w, plan, mk = _setup(name, T=1, B=1, max_len=64, layers=2 if name == "llama-1b" else None)
    assert mk.host_inputs
    mk.capture()
    counts = count_launches(mk.replay, steps=5)
    assert counts["kernels_per_step"] == 1 and counts["launches_per_step"] == 1, counts


def test_inputs_read_from_the_host_make_one_launch_a_step():
    """HIN=1 (the default: worker 0 copies the step's tokens and cache lengths from the pinned stage buffers and
    releases them to the others): a captured step is the kernel alone (1 launch, not 1 + 2 copies), its logits equal
    those of HIN=0 (the graph's copy nodes) bit for bit over replays with other inputs, and a stalled counter is
    still a watchdog error that the next step survives."""
    from megakernel.profiler import count_launches
    from megakernel.runtime import LaunchConfig, Megakernel
    cfg, w, plan, _ = _setup("tiny-moe", T=1, B=2, max_len=64)
    mk = Megakernel(plan, w, "cuda", torch.bfloat16, config=LaunchConfig(blocks=dict(HIN=0)))
    hin = Megakernel(plan, None, "cuda", share=mk.mem)
    assert hin.host_inputs and not mk.host_inputs
    hin.capture()
    g = torch.Generator(device="cuda").manual_seed(5)
    for lens in ([0, 7], [30, 2], [12, 40]):
        tokens = torch.randint(0, cfg.vocab_size, (2, 1), device="cuda", generator=g)
        lens = torch.tensor(lens, device="cuda")
        _random_cache(mk)
        saved = mk.cache().clone()
        want = mk.step(tokens, lens).logits.clone()
        mk.cache().copy_(saved)
        assert torch.equal(hin.step(tokens, lens).logits, want), lens
    counts = count_launches(hin.replay, steps=5)
    assert counts["kernels_per_step"] == 1 and counts["launches_per_step"] == 1, counts
    stall_is_a_watchdog_error_then_recovers(hin, plan.num_tasks // 2,
                                            torch.zeros(2, 1, dtype=torch.long, device="cuda"),
                                            torch.tensor([0, 0], device="cuda"))


def test_watchdog_error_within_a_second_then_recovers():
    cfg, w, plan, mk = _setup("tiny-moe")
    mk.capture()
    stall_is_a_watchdog_error_then_recovers(mk, plan.num_tasks // 2, torch.zeros(2, 2, dtype=torch.long, device="cuda"),
                                            torch.tensor([0, 0], device="cuda"))


def test_refuses_more_workers_than_fit():
    from megakernel.runtime import Megakernel, MegakernelError
    cfg = preset("tiny-dense")
    w = init_weights(cfg, device="cuda", dtype=torch.bfloat16)
    too_many = torch.cuda.get_device_properties(0).multi_processor_count * 64
    plan = compile_step(cfg, StepShape(T=1, B=1, max_len=8), CompileOptions(workers=too_many))
    with pytest.raises(MegakernelError, match="refusing a launch that could hang"):
        Megakernel(plan, w, "cuda", torch.bfloat16).compile()


def test_cli_megakernel_reports_launches_and_profile(tmp_path):
    import json
    from megakernel.run import main
    trace = tmp_path / "trace.json"
    assert main(["--model", "tiny-moe", "--backend", "megakernel", "--steps", "4", "--check", "--profile", str(trace),
                 "--json", str(tmp_path / "r.json")]) == 0
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["kernels_per_step"] == 1 and r["launches_per_step"] == 1
    assert r["check"]["ok"] and trace.exists() and r["profile"]["ops"]
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("ph") == "X" for e in events)


@pytest.mark.parametrize("name", TINY_PRESETS)
def test_speculative_greedy_is_bit_exact_with_plain_on_gpu(name):
    """Through the megakernel: speculative greedy output equals plain greedy, for several k."""
    from megakernel.speculative import Drafts, SpeculativeDecoder
    cfg = preset(name)
    w = init_weights(cfg, seed=0, device="cuda", dtype=torch.bfloat16)
    prompts = torch.randint(0, cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))

    def decoder(k):
        return SpeculativeDecoder(cfg, w, k, 2, 48, "cuda", torch.bfloat16, "megakernel",
                                  options=CompileOptions(workers=16))
    plain, _ = decoder(0).generate(prompts, 20)
    for k in (1, 3, 7):
        for kind in ("mtp", "noisy:0.3"):
            out, stats = decoder(k).generate(prompts, 12, Drafts(kind, plain, cfg.vocab_size, seed=k))
            assert out == [seq[:12] for seq in plain], (k, kind)
            if kind.startswith("noisy"):  # 70% of drafts are right: some must be accepted
                assert stats.acceptance_length > 1.2, (k, stats.accepted_hist)


def test_speculative_sampling_on_the_megakernel_equals_the_interpreter():
    """The SAMPLE body on the GPU: fp32 weights keep both backends' logits ~1e-6 apart, far below
    what could move a sampled token, so tokens and accepted drafts must be the same."""
    from megakernel.speculative import Drafts, SpeculativeDecoder
    cfg = preset("tiny-dense").replace(vocab_size=64)
    w = init_weights(cfg, seed=3, device="cuda", dtype=torch.float32)
    prompts = torch.randint(0, cfg.vocab_size, (2, 3), generator=torch.Generator().manual_seed(4))
    greedy = SpeculativeDecoder(cfg, w, 0, 2, 32, "cuda", torch.float32).generate(prompts, 16)[0]
    runs = {}
    for backend in ("interpret", "megakernel"):
        dec = SpeculativeDecoder(cfg, w, 2, 2, 32, "cuda", torch.float32, backend, options=CompileOptions(workers=16),
                                 temperature=0.5, top_p=0.9, seed=5)
        runs[backend] = dec.generate(prompts, 10, Drafts("oracle", greedy, cfg.vocab_size))
    (out, stats), (want, want_stats) = runs["megakernel"], runs["interpret"]
    assert out == want and stats.accepted_hist == want_stats.accepted_hist
    assert 0 < sum(stats.accepted_hist) < 2 * len(stats.accepted_hist)


def test_host_tensors_keep_their_values():
    """init_weights(host=...) draws on the device and moves to host: the same values as a device-only init."""
    from helper_card.setup import is_routed_expert
    cfg = preset("tiny-moe")
    on_device = init_weights(cfg, seed=0, device="cuda")
    mixed = init_weights(cfg, seed=0, device="cuda", host=is_routed_expert(cfg))
    routed = is_routed_expert(cfg)
    assert all(mixed[k].device.type == ("cpu" if routed(k) else "cuda") for k in mixed)
    assert all(torch.equal(mixed[k].cpu(), on_device[k].cpu()) for k in on_device)
