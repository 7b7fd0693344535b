"""The compiler's passes and the Plan object."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graph.compile import CompileOptions, compile_step
from graph.fusion import DEFAULT_RULES
from graph.isa import decode
from graph.lower import StepShape
from graph.plan import Plan
from graph.strategies import plan_cases
from graph.tiling import Tiler, TilingOptions
from model import preset


def test_rope_groups_collapse_to_distinct_tables():
    thetas = tuple(1e4 * (1 + i % 8) for i in range(38))
    cfg = preset("tiny-dense").replace(num_hidden_layers=38, rope_theta_per_layer=thetas, num_nextn_predict_layers=0)
    plan = compile_step(cfg, StepShape(T=1, B=1, max_len=32), CompileOptions(workers=8))
    cse = next(p for p in plan.passes if p["pass"] == "cse")
    assert cse["ops_before"] - cse["ops_after"] == 30 and cse["rope_tables"] == 8
    assert plan.opcode_counts()["ROPE_TABLE"] == 8
    assert "rope_tables=8" in plan.describe()


def test_fusion_reports_what_it_merged():
    plan = compile_step(preset("tiny-moe"), StepShape(T=1, B=1, max_len=16), CompileOptions(workers=4))
    fusion = next(p for p in plan.passes if p["pass"] == "fusion")
    assert fusion["ops_after"] < fusion["ops_before"]
    assert set(fusion["per_rule"]) >= {"swiglu", "moe_epilogue", "route", "residual_into_linear"}
    assert any("SILU_MUL" in c for c in fusion["changes"])
    names = {decode(w).op.name for w in plan.words}
    assert "EWISE" not in names  # every elementwise op was fused away
    flags = {decode(w).op.flag_names(decode(w).flags) for w in plan.words if decode(w).op.name == "ROUTE"}
    assert all({"SCORE", "TOPK", "SLOTS"} <= set(f) for f in flags)


def test_unfused_plan_has_the_unfused_ops():
    plan = compile_step(preset("tiny-mhc"), StepShape(T=1, B=1, max_len=16), CompileOptions(workers=4, fuse=False))
    counts = plan.opcode_counts()
    assert counts["EWISE"] > 0 and counts["HC_COEFF"] == 4 * 2 * 2  # 4 stages, 2 sublayers, 2 layers


def test_compile_is_deterministic_and_json_round_trips():
    args = (preset("tiny-mhc"), StepShape(T=3, B=2, max_len=24, mtp_passes=1), CompileOptions(workers=7))
    a, b = compile_step(*args), compile_step(*args)
    assert np.array_equal(a.words, b.words) and a.queue_ptr == b.queue_ptr
    text = a.to_json()
    again = Plan.from_json(text)
    assert again.to_json() == text and again.describe() == a.describe()


def test_round_robin_baseline_is_available():
    cp = compile_step(preset("tiny-moe"), StepShape(T=2, B=2, max_len=16), CompileOptions(workers=16))
    rr = compile_step(preset("tiny-moe"), StepShape(T=2, B=2, max_len=16),
                      CompileOptions(workers=16, scheduler="round_robin"))
    assert cp.estimate["critical_path_ms"] <= rr.estimate["critical_path_ms"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama-1b", "dsv2-lite"])
def test_large_models_compile(name):
    """Compile time itself is measured by tools/compile_bench.py; here: it compiles and verifies."""
    plan = compile_step(preset(name), StepShape(T=1, B=1, max_len=4096), CompileOptions(workers=132))
    assert plan.num_tasks > 1000 and any(p["pass"] == "verify" for p in plan.passes)
    text = plan.describe()
    assert "fusion" in text and "tasks:" in text


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="mtp_passes > 0 needs a model with MTP layers"):
        compile_step(preset("llama-1b"), StepShape(T=1, B=1, max_len=8, mtp_passes=1))
    with pytest.raises(ValueError, match="max_len >= T"):
        compile_step(preset("tiny-dense"), StepShape(T=8, B=1, max_len=4))


def test_stage_fusion_never_moves_a_write_past_a_reader():
    from graph.fusion import fuse
    from graph.ir import Graph, Op, Tensor, View
    from graph.isa import Buf
    g = Graph()
    for n in ("st", "craw", "coef", "x", "r"):
        g.add_tensor(Tensor(n, Buf.A, 2, 8))

    def op(i, code, flags, reads, writes, label):
        return Op(i, code, frozenset(flags), {}, {k: View(v) for k, v in reads.items()},
                  {k: View(v) for k, v in writes.items()}, label, layer=0)
    g.ops = [op(0, "HC_COEFF", ["SINK"], {"craw": "craw"}, {"coef": "coef"}, "sinkhorn"),
             op(1, "EWISE", ["COPY"], {"a": "coef"}, {"out": "r"}, "reader_between"),
             op(2, "HC_COEFF", ["COLLAPSE"], {"st": "st", "coef": "coef"}, {"out": "x"}, "collapse")]
    assert fuse(g, ("hc_coeff",))["fused"] == 0 and [o.label for o in g.ops][1] == "reader_between"


def _interpreter_equals_reference(cfg, plan, w, seed, lens):
    """One step of 2 sequences x 2 tokens on a random cache: the plan interpreter equals the reference."""
    import torch

    from megakernel.interpreter import Interpreter
    from model import Cache, Reference

    from .conftest import rel_err
    interp, ref = Interpreter(plan, w), Reference(cfg, w)
    gen = torch.Generator().manual_seed(seed)
    cache = Cache.allocate(cfg, 2, 16)
    cache.data.copy_(torch.randn(cache.data.shape, generator=gen))
    interp.cache().copy_(cache.data)
    tokens = torch.randint(0, cfg.vocab_size, (2, 2), generator=gen)
    got, want = interp.step(tokens, torch.tensor(lens)), ref.step(tokens, cache, torch.tensor(lens))
    assert rel_err(got.logits, want.logits) <= 1e-5 and torch.equal(got.tokens, want.logits.argmax(-1))


def test_norms_fold_into_the_linears_that_read_them():
    """Default rule norm_into_linear: every layer's norms go (their readers are LINEARs whose weights
    nothing else reads), the LINEARs carry NORM and eps and read scaled weights packed as W·diag(g);
    the final norm stays (its output is the step's hidden state).  Plans of every shape, MTP passes
    included, share the one arena layout, and the interpreter still equals the reference."""
    import torch

    from megakernel.memory import Memory
    from model import init_weights

    cfg = preset("tiny-dense")
    opts = CompileOptions(workers=4)
    plan = compile_step(cfg, StepShape(T=2, B=2, max_len=16, mtp_passes=2), opts)
    fusion = next(p for p in plan.passes if p["pass"] == "fusion")
    layers = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    assert fusion["per_rule"]["norm_into_linear"] == 2 * cfg.num_hidden_layers + 2 * 2  # two MTP passes of one layer
    labels = {plan.task_labels[i] for i in range(plan.num_tasks) if plan.task(i).op.name == "RMSNORM"}
    assert not any("input_norm" in label or "post_attn_norm" in label for label in labels), labels
    normed = [plan.task(i) for i in range(plan.num_tasks)
              if plan.task(i).op.name == "LINEAR" and plan.task(i).has("NORM")]
    assert normed and all(t["eps"] == pytest.approx(cfg.rms_norm_eps) for t in normed)
    names = {w.name for w in plan.weights}
    q = "model.layers.0.self_attn.q_proj.weight"
    assert q not in names and f"{q}*model.layers.0.input_layernorm.weight" in names
    assert sum("*" in n for n in names) == 5 * layers  # q, k, v, gate, up of every layer

    w = init_weights(cfg, seed=2)
    mem = Memory(plan, w)
    slot = next(s for s in plan.weights if s.name.startswith(q))
    packed = mem.bufs[slot.buf][slot.offset: slot.offset + slot.rows * slot.cols].view(slot.rows, slot.cols)
    assert torch.equal(packed, w[q] * w["model.layers.0.input_layernorm.weight"])
    Memory(compile_step(cfg, StepShape(T=1, B=2, max_len=16), opts), None, share=mem)  # the same layout

    _interpreter_equals_reference(cfg, plan, w, seed=0, lens=[3, 9])


def test_a_moe_norm_stays_for_the_routed_experts_and_folds_into_the_router():
    """Rule norm_beside_experts (opt-in): a MoE layer's post-attention norm is read by the router, the
    shared experts and the routed experts.  The router alone folds it (LINEAR[NORM, PAIR]: its scaled weights
    as a high and a low part), every expert still reads the norm's output (the default plan's inputs: session
    16's shared-expert fold moved a greedy token on the GPU), and the router no longer waits for the norm; the
    interpreter still equals the reference."""

    from model import init_weights

    cfg = preset("tiny-moe")
    plan = compile_step(cfg, StepShape(T=2, B=2, max_len=16, mtp_passes=1),
                        CompileOptions(workers=4, fusion_rules=DEFAULT_RULES + ("norm_beside_experts",)))
    fusion = next(p for p in plan.passes if p["pass"] == "fusion")
    moe_layers = [layer for layer in range(cfg.num_hidden_layers + 1) if layer >= cfg.first_k_dense_replace]
    assert fusion["per_rule"]["norm_beside_experts"] == len(moe_layers)
    tasks = [plan.task(i) for i in range(plan.num_tasks)]
    by_label = {plan.task_labels[i].rsplit("[", 1)[0]: t for i, t in enumerate(tasks)}
    names = {w.name for w in plan.weights}
    for layer in moe_layers:
        norm, router = by_label[f"L{layer}.post_attn_norm"], by_label[f"L{layer}.moe.router"]
        shared = by_label[f"L{layer}.moe.shared.gate_up"]
        assert router.has("NORM") and router.has("PAIR") and not shared.has("NORM")
        experts = by_label[f"L{layer}.moe.gate_up"]
        assert norm.op.name == "RMSNORM" and experts.op.name == "EXPERT_LINEAR"
        for reader in (experts, shared):  # the norm's rows
            assert (reader["x.buf"], reader["x.off"]) == (norm["out.buf"], norm["out.off"])
        norm_counter = next(i for i, label in enumerate(plan.counter_labels) if label == f"L{layer}.post_attn_norm")
        assert norm_counter not in [c for c, _ in router.waits]
        g = f"model.layers.{layer}.post_attention_layernorm.weight"
        assert {f"model.layers.{layer}.mlp.gate.weight*{g}~{part}" for part in ("hi", "lo")} <= names
        assert not any(name.startswith(f"model.layers.{layer}.mlp.shared_experts.") and "*" in name for name in names)

    _interpreter_equals_reference(cfg, plan, init_weights(cfg, seed=3), seed=1, lens=[2, 7])


def test_a_routers_folded_weights_keep_its_expert_choices():
    """norm_beside_experts folds the norm's weight g into the router: W·diag(g) rounded to bf16 once would send
    ~1% of tokens per layer to other experts (dsv2-lite's router shape, random weights), so the router reads it
    as a high and a low bf16 part (megakernel.memory.scaled_part) and adds their sums: the same top-6 sets as
    the unfolded (x·g)·W for every token, while the one-part fold differs for some."""
    from megakernel.memory import scaled_part
    g_ = torch.Generator().manual_seed(0)
    E, D, k, N = 64, 2048, 6, 4000
    w = (torch.randn(E, D, generator=g_) / D ** 0.5).bfloat16()
    g = (0.8 + 0.4 * torch.rand(D, generator=g_)).bfloat16()
    x = torch.randn(N, D, generator=g_)
    hi, lo = (scaled_part(w, g, part, torch.bfloat16).bfloat16().float() for part in ("hi", "lo"))

    def top(z):
        return z.topk(k).indices.sort(-1).values

    want = top((x * g.float()) @ w.float().T)
    assert torch.equal(top(x @ hi.T + x @ lo.T), want)
    assert (top(x @ hi.T) != want).any(-1).sum() > 10  # one rounded part: what the pair avoids


def test_a_plan_with_other_fusion_rules_cannot_share_the_arena():
    from megakernel.memory import Memory
    from model import init_weights

    from .conftest import UNFOLDED
    cfg = preset("tiny-dense")
    mem = Memory(compile_step(cfg, StepShape(T=1, B=1, max_len=16), CompileOptions(workers=2)), init_weights(cfg))
    unfolded = compile_step(cfg, StepShape(T=1, B=1, max_len=16), CompileOptions(workers=2, fusion_rules=UNFOLDED))
    with pytest.raises(ValueError, match="do not share a weight layout"):
        Memory(unfolded, None, share=mem)
    with pytest.raises(ValueError, match="unknown fusion rule"):
        compile_step(cfg, StepShape(T=1, B=1, max_len=16), CompileOptions(workers=2, fusion_rules=("no_such",)))


def _same_step(cfg, plans, seed: int, lens, mtp: int = 2, steps: int = 1) -> None:
    """Every plan's interpreter, from one random cache and the same tokens (the plans' T and B), writes the
    same cache and logits, its `mtp` MTP logits and greedy tokens included, bit for bit, over `steps` steps
    (step k's cache lengths are lens + k·T)."""
    import torch

    from megakernel.interpreter import Interpreter
    from model import init_weights
    w = init_weights(cfg, seed=4)
    gen = torch.Generator().manual_seed(seed)
    B, T = plans[0].shape["B"], plans[0].shape["T"]
    tokens = [torch.randint(0, cfg.vocab_size, (B, T), generator=gen) for _ in range(steps)]
    prefix = torch.randn(Interpreter(plans[0], w).cache().shape, generator=gen)
    runs = []
    for p in plans:
        interp = Interpreter(p, w)
        interp.cache().copy_(prefix)
        outs = [interp.step(tok, torch.tensor(lens) + k * T) for k, tok in enumerate(tokens)]
        runs.append((outs, interp.cache().clone()))
    (a, cache_a), (b, cache_b) = runs
    assert torch.equal(cache_a, cache_b) and not torch.equal(cache_a, prefix.to(cache_a.dtype))
    for x, y in zip(a, b):
        assert torch.equal(x.logits, y.logits) and torch.equal(x.tokens, y.tokens)
        assert len(x.mtp_logits) == mtp and all(torch.equal(m, m2) for m, m2 in zip(x.mtp_logits, y.mtp_logits))


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-moe"])
def test_rope_split_by_heads_writes_what_one_task_writes(name):
    """TilingOptions.rope_heads=1: each ROPE task rotates one head (a decode step's query rope is
    otherwise one task of a block of heads, or with rope_heads=0 of every head); the step writes the same cache
    and logits, bit for bit, as with one task per row."""
    from graph.compile import compile_options
    cfg = preset(name)
    shape = StepShape(T=2, B=2, max_len=16, mtp_passes=2)
    whole = compile_step(cfg, shape, compile_options("rope_heads=0", 4)[0])
    split = compile_step(cfg, shape, compile_options("rope_heads=1", 4)[0])
    ropes = [split.task(i) for i in range(split.num_tasks) if split.task(i).op.name == "ROPE"]
    assert all(t["heads"] - t["h0"] == 1 for t in ropes) and any(t.has("CACHE") for t in ropes)
    assert len(ropes) > sum(whole.task(i).op.name == "ROPE" for i in range(whole.num_tasks))
    _same_step(cfg, (whole, split), 2, [3, 10])


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-moe"])
def test_rotated_keys_go_straight_into_the_cache(name):
    """rope_into_cache: every CACHE_WRITE of a ROPE's output becomes ROPE[CACHE] (GQA's k, MLA's k_pe, and
    the MTP layers'), and the step (T=2, B=2, two MTP passes) writes the same cache and logits, bit for bit,
    as the plan with the rule removed (compile_options' rope_into_cache=0).  Both without rope_into_attention,
    which takes GQA's ROPE[CACHE] into attention where it can (test_ropes_and_cache_writes_go_into_attention)."""
    from graph.compile import compile_options
    cfg = preset(name)
    shape = StepShape(T=2, B=2, max_len=16, mtp_passes=2)
    plan = compile_step(cfg, shape, compile_options("rope_into_attention=0", 4)[0])
    unfused = compile_step(cfg, shape, compile_options("rope_into_cache=0,rope_into_attention=0", 4)[0])
    ropes = [plan.task(i) for i in range(plan.num_tasks)
             if plan.task(i).op.name == "ROPE" and plan.task(i).has("CACHE")]
    layers = cfg.num_hidden_layers + 2  # two MTP passes
    assert len({t.signal for t in ropes}) == layers  # one fused op per layer
    counts, before = plan.opcode_counts(), unfused.opcode_counts()
    assert before["CACHE_WRITE"] - counts.get("CACHE_WRITE", 0) == layers
    assert not any(unfused.task(i).has("CACHE") for i in range(unfused.num_tasks) if unfused.task(i).op.name == "ROPE")
    _same_step(cfg, (plan, unfused), 1, [2, 11])


def _ops_by_layer(plan) -> dict:
    """Layer prefix ("L3") -> the plan's ops (counter labels) of it; an MTP layer's passes count twice."""
    counts = {}
    for label in plan.counter_labels:
        layer = label.split(".")[0]
        counts[layer] = counts.get(layer, 0) + 1
    return counts


@pytest.mark.parametrize("name,dtype", [("tiny-moe", None), ("tiny-mhc", None), ("tiny-moe", "bfloat16")])
def test_the_latent_norm_writes_the_cache(name, dtype):
    """norm_into_cache (a default rule): every MLA layer's kv_a_norm, whose rows only its cache_latent CACHE_WRITE
    read, writes them into the cache itself (RMSNORM[CACHE], at the write's cache columns and positions): no
    cache_latent is left, and every layer (each MTP pass too) has one op fewer than with the rule removed
    (compile_options' norm_into_cache=0).  Over two steps (T=2, B=2, two MTP passes) the two plans write the same
    caches and logits, bit for bit, in fp32 and in bf16 (the norm's fp32 rows rounded to the cache dtype once)."""
    from graph.compile import compile_options
    from graph.isa import Buf
    cfg = preset(name) if dtype is None else preset(name).replace(dtype=dtype)
    shape = StepShape(T=2, B=2, max_len=16, mtp_passes=2)
    plan = compile_step(cfg, shape, CompileOptions(workers=4))
    unfused = compile_step(cfg, shape, compile_options("norm_into_cache=0", 4)[0])
    layers = cfg.num_hidden_layers + 2  # two MTP passes
    fusion = next(p for p in plan.passes if p["pass"] == "fusion")
    assert fusion["per_rule"]["norm_into_cache"] == layers

    def tasks(p, test):
        return [(p.task_labels[i].split("[")[0], p.task(i)) for i in range(p.num_tasks) if test(p.task(i))]

    fused = tasks(plan, lambda t: t.op.name == "RMSNORM" and t.has("CACHE"))
    writes = tasks(unfused, lambda t: t.op.name == "CACHE_WRITE")
    latent = [(label, t) for label, t in writes if label.endswith(".attn.cache_latent")]
    assert len({t.signal for _, t in fused}) == len({t.signal for _, t in latent}) == layers
    assert all(label.endswith(".attn.kv_a_norm") and t["out.buf"] == -1 and t["cache.buf"] == Buf.C
               for label, t in fused)
    assert not any(label.endswith("cache_latent") for label in plan.task_labels)
    assert not tasks(unfused, lambda t: t.op.name == "RMSNORM" and t.has("CACHE"))
    keys = ("cache.off", "cl.off", "T", "S", "width", "col0", "pos_offset", "r0", "r1")
    assert sorted(tuple(t[k] for k in keys) for _, t in fused) == sorted(tuple(t[k] for k in keys) for _, t in latent)
    assert all(t["D"] == t2["cols"] == cfg.kv_lora_rank for (_, t), (_, t2) in zip(fused, latent))
    other_writes = len(writes) - len(latent)  # k_pe's (ROPE[CACHE] with rope_into_cache): untouched
    assert sum(t.op.name == "CACHE_WRITE" for t in (plan.task(i) for i in range(plan.num_tasks))) == other_writes
    before, after = _ops_by_layer(unfused), _ops_by_layer(plan)
    n = cfg.num_hidden_layers
    assert {k: before[k] - after.get(k, 0) for k in before} == {**{f"L{i}": 1 for i in range(n)}, f"L{n}": 2,
                                                                **{k: 0 for k in before if not k.startswith("L")}}

    _same_step(cfg, (plan, unfused), 5, [2, 9], steps=2)


def test_dsv2_lite_latent_norm_writes_the_cache():
    """dsv2-lite (six layers keep the compile short): each layer's kv_a_norm is an RMSNORM[CACHE] and its
    cache_latent is gone, one op fewer per layer (13 on the dense layer 0, 18 on a MoE layer), as compile_step
    plans it at ctx 4096 (T=1, B=1).  A GQA model (tiny-dense) has no norm a cache write reads: the rule leaves it."""
    from graph.compile import compile_options
    shape = StepShape(T=1, B=1, max_len=4097)
    plan = compile_step(_six("dsv2-lite"), shape)
    unfused = compile_step(_six("dsv2-lite"), shape, compile_options("norm_into_cache=0", 132)[0])
    before, after = _ops_by_layer(unfused), _ops_by_layer(plan)
    assert (before["L0"], after["L0"], before["L5"], after["L5"]) == (14, 13, 19, 18)
    assert all(before[f"L{i}"] - after[f"L{i}"] == 1 for i in range(6))
    assert not any("cache_latent" in label for label in plan.counter_labels)
    norms = {plan.task_labels[i].split("[")[0] for i in range(plan.num_tasks)
             if plan.task(i).op.name == "RMSNORM" and plan.task(i).has("CACHE")}
    assert norms == {f"L{i}.attn.kv_a_norm" for i in range(6)}
    llama = compile_step(preset("tiny-dense"), StepShape(T=2, B=2, max_len=16, mtp_passes=1), CompileOptions(workers=4))
    assert "norm_into_cache" not in next(p for p in llama.passes if p["pass"] == "fusion")["per_rule"]


@pytest.mark.parametrize("name,T,B,passes", [("tiny-dense", 2, 2, 0), ("tiny-dense", 1, 1, 0), ("tiny-dense", 2, 1, 2),
                                              ("tiny-moe", 2, 2, 0)])
def test_ropes_and_cache_writes_go_into_attention(name, T, B, passes):
    """rope_into_attention (a default rule): a GQA layer's q ROPE, k ROPE[CACHE] and v CACHE_WRITE become its
    ATTENTION[ROPE], and the step writes the same cache and logits, bit for bit, as the plan without the rule.
    MLA layers (tiny-moe) and caches that several passes of a step write (MTP draft passes) keep their ops."""
    from graph.compile import compile_options
    cfg = preset(name)
    shape = StepShape(T=T, B=B, max_len=16, mtp_passes=passes, attn_split=4)
    plan = compile_step(cfg, shape, CompileOptions(workers=4))
    unfused = compile_step(cfg, shape, compile_options("rope_into_attention=0", 4)[0])
    fused = [p for p in plan.passes if p["pass"] == "fusion"][0]["per_rule"].get("rope_into_attention", 0)
    attn = [plan.task(i) for i in range(plan.num_tasks) if plan.task(i).op.name == "ATTENTION"]
    gqa_layers = 0 if cfg.kv_lora_rank else cfg.num_hidden_layers
    assert fused == gqa_layers and sum(t.has("ROPE") for t in attn) == gqa_layers * len(attn) // len(
        {t.signal for t in attn})
    def ops(p, opcode):  # ops (their tasks' labels without the tile), not tasks
        return len({p.task_labels[i].split("[")[0] for i in range(p.num_tasks) if p.task(i).op.name == opcode})

    assert ops(unfused, "CACHE_WRITE") - ops(plan, "CACHE_WRITE") == gqa_layers
    assert ops(unfused, "ROPE") - ops(plan, "ROPE") == 2 * gqa_layers
    _same_step(cfg, (plan, unfused), 1, [3, 10][:B], mtp=passes)


def _phase(rows: int, per: int, copies: int, spread: int, bytes_per_row: int, overhead: int) -> int:
    """Rounds of an op's tasks over `spread` workers times one task's bytes and fixed cost."""
    return -(-copies * -(-rows // per) // spread) * (per * bytes_per_row + overhead)


def test_balanced_tiles_fill_the_workers_once():
    """dsv2-lite's routed down projection, 6 slots of 2048 rows x 1408 bf16: 80-row tasks (16-row aligned, as in
    session 14) make 156 for 132 workers (two rounds); balanced, 96 rows make 132 (one round), at either alignment."""
    plain = Tiler(None, TilingOptions(spread=132, balance=0, row_align=16), 2)
    balanced = Tiler(None, TilingOptions(spread=132, balance=1), 2)
    assert plain.weight_rows_per_task(1408 * 2, 2048, copies=6) == 80
    assert balanced.weight_rows_per_task(1408 * 2, 2048, copies=6) == 96


def _layer_tasks(plan, layer: int) -> dict:
    counts = {}
    for label in plan.task_labels:
        if label.startswith(f"L{layer}."):
            op = label.split("[")[0]
            counts[op] = counts.get(op, 0) + 1
    return counts


def _six(name: str):
    return preset(name).replace(num_hidden_layers=6)


def test_sibling_projections_share_the_workers():
    """llama-1b's q, k and v projections read one input: tiled alone they make 128 + 32 + 32 tasks for 132
    workers (two rounds) at 16-row alignment; with TilingOptions.siblings they share the workers by weight bytes
    (8 : 2 : 2 MB), one round (86 + 22 + 22 at today's 8-row alignment).  dsv2-lite's q and kv_a projections
    already make 132 together at 16 rows and keep their tiles.  siblings=2 also shares them among the streamed
    ops one op reads side by side.  Layer 5's tiles do not depend on the layers after it: six layers keep the
    compiles short."""
    shape = StepShape(T=1, B=1, max_len=4097)
    qkv = ("L5.attn.q_proj", "L5.attn.k_proj", "L5.attn.v_proj")
    for siblings, want in ((0, (128, 32, 32)), (1, (64, 16, 16))):
        plan = compile_step(_six("llama-1b"), shape, CompileOptions(tiling=TilingOptions(siblings=siblings,
                                                                                       row_align=16)))
        assert tuple(_layer_tasks(plan, 5)[op] for op in qkv) == want, siblings
    plan = compile_step(_six("llama-1b"), shape)  # today's default: siblings, 8-row alignment
    assert tuple(_layer_tasks(plan, 5)[op] for op in qkv) == (86, 22, 22)
    mla = ("L5.attn.q_proj", "L5.attn.kv_a_proj")
    counts = [tuple(_layer_tasks(compile_step(_six("dsv2-lite"), shape, CompileOptions(
        tiling=TilingOptions(siblings=siblings, row_align=16))), 5)[op] for op in mla) for siblings in (0, 1)]
    assert counts[0] == counts[1] == (96, 36)
    # siblings=2: the routed and shared experts' down projections, both read by MOE_COMBINE (beside o_proj's
    # residual: o_proj is their ancestor, so not their sibling), share the workers by bytes (35 : 11.5 MB)
    moe = ("L5.moe.expert_down", "L5.moe.shared.down", "L5.attn.o_proj")
    counts = [tuple(_layer_tasks(compile_step(_six("dsv2-lite"), shape, CompileOptions(
        tiling=TilingOptions(siblings=siblings))), 5)[op] for op in moe) for siblings in (1, 2)]
    assert counts == [(132, 128, 128), (96, 32, 128)]
    # a router (on the chain: router -> route -> experts) never joins a group: at 66 workers the router and the
    # shared experts' gate_up would make 67 tasks, and a share by bytes would leave the router one task
    routers = [_layer_tasks(compile_step(_six("dsv2-lite"), shape, CompileOptions(
        workers=66, tiling=TilingOptions(siblings=siblings))), 5)["L5.moe.router"] for siblings in (0, 1)]
    assert routers == [8, 8]


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 5000), bytes_per_row=st.integers(1, 20000), copies=st.integers(1, 8),
       spread=st.integers(1, 200), align=st.sampled_from([1, 4, 16]), tile_bytes=st.sampled_from([4096, 262144]))
def test_balanced_tiles_never_lengthen_the_phase(rows, bytes_per_row, copies, spread, align, tile_bytes):
    opts = TilingOptions(spread=spread, row_align=align, tile_bytes=tile_bytes, balance=0)
    per = Tiler(None, opts, 2).weight_rows_per_task(bytes_per_row, rows, copies)
    opts.balance = 1
    best = Tiler(None, opts, 2).weight_rows_per_task(bytes_per_row, rows, copies)
    assert best == per or best % align == 0 and best <= rows
    assert (_phase(rows, best, copies, spread, bytes_per_row, opts.task_overhead_bytes)
            <= _phase(rows, per, copies, spread, bytes_per_row, opts.task_overhead_bytes))
    assert best == per or best * bytes_per_row <= max(per * bytes_per_row, opts.balance_bytes)
    assert best == per or best * bytes_per_row >= opts.min_tile_bytes


def _waited_ops(plan, i: int) -> set[str]:
    """The ops (labels) task i's waits stand for: a shared counter's label joins its ops' with '+'."""
    return {label for c, _ in plan.task(i).waits for label in plan.counter_labels[c].split("+")}


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-moe", "tiny-mhc"])
def test_shared_counters_wait_once_and_change_nothing_else(name):
    """Compile option shared_counters (the default): producers that every consumer waits on together signal one
    counter whose count is all their tasks (GQA attention's q|k|v projections, MLA attention's q_absorb, q_rope,
    k_rope and kv_a_norm, the MoE combine's routed and shared downs), so an attention task polls once, not 3-4
    times.  The schedule and every task's fields are those of the plan without it; each task still waits for
    every op it waited for; two steps (T=2, B=2, two MTP passes) write the same caches and logits, bit for bit."""
    from graph.compile import compile_options
    cfg = preset(name)
    shape = StepShape(T=2, B=2, max_len=16, mtp_passes=2 if cfg.num_nextn_predict_layers else 0)
    plain = compile_step(cfg, shape, compile_options("shared_counters=0", 4)[0])
    shared = compile_step(cfg, shape, CompileOptions(workers=4))
    assert shared.task_labels == plain.task_labels and shared.queue_ptr == plain.queue_ptr
    attention = [i for i in range(plain.num_tasks) if plain.task(i).op.name == "ATTENTION"]
    assert max(len(plain.task(i).waits) for i in attention) >= 3
    assert all(len(shared.task(i).waits) == 1 for i in attention)
    signallers = {}
    for i in range(shared.num_tasks):
        a, b = plain.task(i), shared.task(i)
        assert (a.op.name, a.flags, a.tile, a.fields) == (b.op.name, b.flags, b.tile, b.fields), plain.task_labels[i]
        assert _waited_ops(plain, i) <= _waited_ops(shared, i), plain.task_labels[i]
        assert plain.task_labels[i].split("[")[0] in shared.counter_labels[b.signal].split("+")
        signallers[b.signal] = signallers.get(b.signal, 0) + 1
    assert all(n == signallers[c] for i in range(shared.num_tasks) for c, n in shared.task(i).waits)
    assert shared.options["shared_counters"] and "shared_counters" not in plain.options
    _same_step(cfg, (plain, shared), 3, [2, 9], mtp=shape.mtp_passes, steps=2)


def _shared_counters_add_no_wait(cfg, shape, options) -> None:
    """The plan with shared_counters has the same queues as the one without, and each task waits only for ops
    it already followed there."""
    import dataclasses
    plain = compile_step(cfg, shape, dataclasses.replace(options, shared_counters=False))
    shared = compile_step(cfg, shape, dataclasses.replace(options, shared_counters=True))
    assert shared.queue_ptr == plain.queue_ptr and shared.task_labels == plain.task_labels
    deps, members = {}, {}  # op (the plain plan's counter) -> the ops it waits on; shared counter -> its ops
    for i in range(plain.num_tasks):
        deps.setdefault(plain.task(i).signal, set()).update(c for c, _ in plain.task(i).waits)
        members.setdefault(shared.task(i).signal, set()).add(plain.task(i).signal)
    followed = {}
    for op in sorted(deps):  # op ids are topological
        followed[op] = set().union(*({d} | followed[d] for d in deps[op]))
    for i in range(shared.num_tasks):
        waited = set().union(*(members[c] for c, _ in shared.task(i).waits))
        assert waited <= followed[plain.task(i).signal], shared.task_labels[i]
        assert all(c < shared.task(i).signal for c, _ in shared.task(i).waits)  # a group's counter: its last op's


@given(plan_cases())
def test_shared_counters_add_no_wait(case):
    """shared_counters on drawn models, shapes and options: the same queues, and each task waits only for ops
    it already followed.  Grouping producers that some consumer does not need would add a wait the scheduler
    never saw (a deadlock the verifier refuses: hypothesis found one when graph/counters.py's ancestor test was
    left out)."""
    _shared_counters_add_no_wait(case.cfg, case.shape, case.options)


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-moe"])
def test_shared_counters_leave_unfused_ropes_their_own_waits(name):
    """Hypothesis's example, fixed: unfused, the query rope waits on the rope table and q_proj together, and the
    key rope on the rope table too; without the ancestor test the table and q_proj became one counter, so the key
    rope waited for q_proj, which it does not follow."""
    _shared_counters_add_no_wait(preset(name).replace(num_hidden_layers=1), StepShape(T=1, B=1, max_len=4),
                                 CompileOptions(workers=1, cse=False, fuse=False))


def test_shared_counters_on_the_large_models():
    """Every task of llama-1b waits once (shared_counters, the default); dsv2-lite's attention tasks too (six
    layers at ctx 4096: the layers after the first have the same ops)."""
    shape = StepShape(T=1, B=1, max_len=4096)
    llama = compile_step(_six("llama-1b"), shape, CompileOptions())
    assert max(len(llama.task(i).waits) for i in range(llama.num_tasks)) == 1
    dsv2 = compile_step(_six("dsv2-lite"), shape, CompileOptions())
    attention = [dsv2.task(i) for i in range(dsv2.num_tasks) if dsv2.task(i).op.name == "ATTENTION"]
    assert len(attention) == 6 * 128 and all(len(t.waits) == 1 for t in attention)


def test_compile_options_reads_each_kind_of_key_and_names_an_unknown_one():
    """The bench's and replay's plan variants: tiling and cost-model fields, attn_split, workers, vocab_block and
    fusion rules each land where compile_step reads them; a misspelt key is refused by name."""
    from graph.compile import CompileError, compile_options
    opts, split = compile_options("rope_heads=0,task_overhead=2e-6,attn_split=64,workers=7,vocab_block=1024,"
                                  "rope_into_cache=0", 132)
    assert (opts.tiling.rope_heads, opts.cost.task_overhead, split, opts.workers, opts.vocab_block) == \
        (0, 2e-6, 64, 7, 1024)
    assert "rope_into_cache" not in opts.fusion_rules
    assert compile_options("", 132)[0].vocab_block == CompileOptions().vocab_block
    with pytest.raises(CompileError, match="'vocab_blok'"):
        compile_options("vocab_blok=1024", 132)


def test_expert_mlp_slices_are_the_models_not_the_steps():
    """Fusion rule expert_mlp (opt-in): dsv2-lite's routed gate|up and down become one EXPERT_LINEAR[SILU_MUL,
    DOWN_T] over 64-row slices of each expert's 1408 intermediate rows, 22 slices x 6 slots = 132 tasks at T = 1
    (one per worker), and MOE_COMBINE sums 22 slices of partials; the shared experts' 2816 rows become one
    LINEAR[SILU_MUL, DOWN_T] over 118 slices of 24 (the last of 8), whose partials MOE_COMBINE sums too.  The slices
    do not depend on the step's shape, so a token's partials are summed in one order whatever T and B (batch
    invariance); the down projections are packed transposed, as parts marked TRANSPOSED."""
    from graph.fusion_weights import EXPERT_SLICE_ROWS, SHARED_SLICE_ROWS
    from graph.ir import TRANSPOSED
    cfg = _six("dsv2-lite")
    slices, shared = {}, {}
    for T, B in ((1, 1), (3, 2)):
        plan = compile_step(cfg, StepShape(T=T, B=B, max_len=4096),
                            CompileOptions(fusion_rules=DEFAULT_RULES + ("expert_mlp",)))
        tasks = [(plan.task_labels[i], plan.task(i)) for i in range(plan.num_tasks)]
        fused = [t for label, t in tasks if label.startswith("L5.moe.mlp[")]
        assert fused and all(t.has("SILU_MUL") and t.has("DOWN_T") for t in fused)
        assert not any(label.startswith("L5.moe.expert_down") for label, _ in tasks)
        slices[T] = sorted({(t["slice"], t["r0"], t["r1"]) for t in fused})
        if T == 1:
            assert len(fused) == 132 == plan.workers
        sh = [t for label, t in tasks if label.startswith("L5.moe.shared.mlp[")]
        assert sh and all(t.op.name == "LINEAR" and t.has("SILU_MUL") and t.has("DOWN_T") for t in sh)
        assert not any(label.startswith("L5.moe.shared.down") for label, _ in tasks)
        shared[T] = sorted((t["slice"], t["r0"], t["r1"]) for t in sh)
        combine = next(t for label, t in tasks if label.startswith("L5.moe.combine["))
        assert (combine["ns"], combine["ys"]) == (1408 // EXPERT_SLICE_ROWS, T * B * cfg.num_experts_per_tok)
        assert (combine["nsh"], combine["shs"]) == (len(sh), T * B)
    assert slices[1] == slices[3] == [(s, 64 * s, 64 * s + 64) for s in range(22)]
    assert (SHARED_SLICE_ROWS == 24
            and shared[1] == shared[3] == [(s, 24 * s, min(24 * s + 24, 2816)) for s in range(118)])
    experts = next(w for w in plan.weights if w.name == "L5.experts" + TRANSPOSED)
    assert sum(len(p) == 3 and p[2] == TRANSPOSED for p in experts.parts) == cfg.n_routed_experts
    down = next(w for w in plan.weights if w.name == "model.layers.5.mlp.shared_experts.down_proj.weight" + TRANSPOSED)
    assert [tuple(p) for p in down.parts] == [("model.layers.5.mlp.shared_experts.down_proj.weight", 0, TRANSPOSED)]
