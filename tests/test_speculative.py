"""Speculative decoding: greedy output equals plain greedy token for token, for every draft source."""

import math
import os

import pytest
import torch
import triton
import triton.language as tl

from graph.compile import CompileOptions, compile_step
from megakernel.ops.spec import row_dist, sample_row, uniform_dev
from megakernel.speculative import Drafts, SpeculativeDecoder, cache_positions
from model import TINY_PRESETS, init_weights, preset

NEW = 10


class _SharedPlans:
    """A test's decoders of one model and one set of compile options compile each step shape once: a plan is
    a function of (config, shape, options) (test_plans_compiled_side_by_side_equal_the_ones_compiled_in_turn)
    and data no runner changes, so a decoder takes the plans of shapes another one already compiled and adds
    its own.  Each decoder still builds its own runners, cache, seeds and drafts."""

    def __init__(self):
        self.groups: list[tuple[tuple, dict]] = []

    def __call__(self, dec: SpeculativeDecoder) -> SpeculativeDecoder:
        key = (dec.cfg, dec.engine.options)
        plans = next((p for k, p in self.groups if k == key), None)
        if plans is None:
            plans = {}
            self.groups.append((key, plans))
        assert not dec.engine.plans
        dec.engine.plans = plans
        return dec


def _setup(name, B, seed=0):
    cfg = preset(name)
    w = init_weights(cfg, seed=seed)
    prompts = torch.randint(0, cfg.vocab_size, (B, 5), generator=torch.Generator().manual_seed(seed))
    return cfg, w, prompts


def _plain(cfg, w, prompts, n):
    out, _ = SpeculativeDecoder(cfg, w, 0, prompts.shape[0], prompts.shape[1] + n + 2).generate(prompts, n)
    return out


@pytest.mark.parametrize("name", TINY_PRESETS)
@pytest.mark.parametrize("B", [1, 4])
def test_greedy_speculative_equals_plain_for_every_k_and_draft(name, B):
    cfg, w, prompts = _setup(name, B)
    plain = _plain(cfg, w, prompts, NEW + 8)
    expected = [seq[:NEW] for seq in plain]
    shared = _SharedPlans()  # the three draft sources of one k step the same shapes
    for k in range(1, 8):
        for kind in ("mtp", "oracle", "noisy:0.5"):
            drafts = Drafts(kind, oracle=plain, vocab=cfg.vocab_size, seed=k)
            out, stats = shared(SpeculativeDecoder(cfg, w, k, B, 64)).generate(prompts, NEW, drafts)
            assert out == expected, (k, kind)
            if kind == "oracle":
                assert stats.acceptance_length == k + 1 == stats.tokens_per_step


def test_noisy_drafts_are_accepted_at_the_expected_rate():
    cfg, w, prompts = _setup("tiny-dense", 4, seed=2)
    n, p, k = 60, 0.3, 3
    plain = _plain(cfg, w, prompts, n + k + 1)
    _, stats = SpeculativeDecoder(cfg, w, k, 4, 128).generate(prompts, n,
                                                              Drafts(f"noisy:{p}", plain, cfg.vocab_size, 5))
    trials = len(stats.accepted_hist)
    first = stats.per_position()[0]  # draft 1 is accepted exactly when it is not corrupted
    assert abs(first - (1 - p)) <= 3 * math.sqrt(p * (1 - p) / trials) + 1e-9, (first, trials)
    # draft i needs all of 1..i right: (1 - p)^i
    for i, rate in enumerate(stats.per_position(), start=1):
        assert abs(rate - (1 - p) ** i) <= 4 * math.sqrt((1 - p) ** i * (1 - (1 - p) ** i) / trials) + 1e-9


@pytest.mark.parametrize("k", [0, 2, 5])
def test_eos_and_max_new_tokens_cut_where_plain_decoding_cuts(k):
    cfg, w, prompts = _setup("tiny-moe", 2, seed=3)
    plain = _plain(cfg, w, prompts, 16)
    eos = plain[0][6]  # a token sequence 0 emits mid-stream
    want = []
    for seq in plain:
        cut = seq.index(eos) + 1 if eos in seq[:9] else 9
        want.append(seq[:cut])
    out, _ = SpeculativeDecoder(cfg, w, k, 2, 64).generate(prompts, 9, Drafts("oracle", plain, cfg.vocab_size), eos=eos)
    assert out == want


def test_prefill_longer_than_a_chunk_and_shorter_than_k():
    cfg, w, _ = _setup("tiny-mhc", 1)
    for length in (2, 19):
        prompts = torch.randint(0, cfg.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
        plain = _plain(cfg, w, prompts, 8)
        out, _ = SpeculativeDecoder(cfg, w, 4, 1, 64).generate(prompts, 6, Drafts("oracle", plain, cfg.vocab_size))
        assert out == [plain[0][:6]]


# Through the persistent kernel under TRITON_INTERPRET (~0.8 s per token of a step there), every k, every
# draft source and B = 1 and 4 at least once; the whole product runs on the plan interpreter above and
# compiled on a GPU (tests/test_gpu.py, tools/spec_sweep.py)
TRITON_CASES = [("tiny-dense", 1, 1, "mtp", 2), ("tiny-dense", 2, 1, "oracle", 3), ("tiny-dense", 3, 1, "noisy:0.5", 3),
                ("tiny-dense", 4, 1, "oracle", 5), ("tiny-dense", 5, 1, "noisy:0.5", 3),
                ("tiny-dense", 6, 1, "mtp", 2), ("tiny-dense", 7, 1, "oracle", 8),
                ("tiny-dense", 1, 4, "oracle", 3), ("tiny-moe", 2, 2, "noisy:0.4", 3)]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU Triton interpreter only")
@pytest.mark.parametrize("name,k,B,kind,n", TRITON_CASES)
def test_triton_accept_and_gather_bodies(name, k, B, kind, n):
    """The whole speculative step (ACCEPT, GATHER, the MTP chain) through the persistent kernel: the same
    tokens as plain decoding and the same accepted drafts, step by step, as the plan interpreter (equal
    output alone hid a fused ROUTE that overwrote the drafts, so nothing was ever accepted)."""
    cfg, w, _ = _setup(name, B, seed=4)
    prompts = torch.randint(0, cfg.vocab_size, (B, 2), generator=torch.Generator().manual_seed(4))
    plain = _plain(cfg, w, prompts, n + k + 1)
    runs, shared = {}, _SharedPlans()  # both backends run the same plans
    for backend in ("megakernel", "interpret"):
        dec = shared(SpeculativeDecoder(cfg, w, k, B, 32, backend=backend, options=CompileOptions(workers=1)))
        runs[backend] = dec.generate(prompts, n, Drafts(kind, plain, cfg.vocab_size, seed=k))
    (out, stats), (_, want) = runs["megakernel"], runs["interpret"]
    assert out == [seq[:n] for seq in plain] and stats.steps >= 1
    assert stats.accepted_hist == want.accepted_hist
    if kind == "oracle":  # every draft right: one step of k + 1 tokens per sequence while n allows
        assert stats.accepted_hist[0] == min(k, n - 1)
    if kind.startswith("noisy"):
        assert sum(stats.accepted_hist) > 0


@pytest.mark.parametrize("S,k", [(5, 0), (9, 0), (1, 2), (9, 2), (3, 7)])
def test_a_run_fits_the_cache_positions_it_asks_for(S, k):
    """A run of the speculative decoder with exactly cache_positions(...) positions (the CLI's cache length, less
    its slack) compiles every step shape and decodes: short runs with a long prompt chunk used to fail in the
    lowering, which reserves 3·T positions for a speculative step of T tokens (--temperature 0.5 --steps 2 needed
    21 positions and had 20); one position fewer is refused by generate, before any compile."""
    cfg, w, _ = _setup("tiny-moe", 1)
    prompts = torch.randint(0, cfg.vocab_size, (1, S), generator=torch.Generator().manual_seed(S))
    need = cache_positions(S, 2, k)
    out, _ = SpeculativeDecoder(cfg, w, k, 1, need).generate(prompts, 2)  # tiny-moe's MTP layer drafts
    assert len(out[0]) == 2
    with pytest.raises(ValueError, match="exceeds the cache"):
        SpeculativeDecoder(cfg, w, k, 1, need - 1).generate(prompts, 2)


def test_bad_requests_are_refused():
    cfg, w, prompts = _setup("tiny-moe", 1)
    with pytest.raises(ValueError, match="within 0..7"):
        SpeculativeDecoder(cfg, w, 8, 1, 64)
    with pytest.raises(ValueError, match="exceeds the cache"):
        SpeculativeDecoder(cfg, w, 3, 1, 16).generate(prompts, 12)
    with pytest.raises(ValueError, match="unknown draft source"):
        Drafts("magic")
    llama = preset("llama-1b").replace(num_hidden_layers=1, vocab_size=64, hidden_size=32, num_attention_heads=2,
                                       num_key_value_heads=1, head_dim=16, intermediate_size=32, dtype="float32")
    with pytest.raises(ValueError, match="needs a model with MTP layers"):
        SpeculativeDecoder(llama, init_weights(llama), 2, 1, 32).generate(torch.zeros(1, 3, dtype=torch.long), 4)


def test_stepmath_expected_tokens():
    import sys
    sys.path.insert(0, "tools")
    from stepmath import conditional, expected_tokens, table
    assert expected_tokens([1.0] * 7, 5) == 6.0
    assert abs(expected_tokens([0.5, 0.5], 2) - 1.75) < 1e-12
    assert conditional([0.8, 0.4, 0.2]) == [0.8, 0.5, 0.5]
    rows = table([0.9] * 7, {0: 1.0, 2: 1.1})
    assert rows[0]["tokens_per_s"] == 1000.0 and abs(rows[0]["break_even_ms_k_plus_2"] - 2.71) < 1e-9


def test_finished_sequences_do_not_run_past_the_cache():
    """A sequence that stops early (EOS) keeps being computed; its cache length must stay put."""
    cfg, w, prompts = _setup("tiny-moe", 4)
    plain = _plain(cfg, w, prompts, 40)
    eos = plain[0][1]
    dec = SpeculativeDecoder(cfg, w, 3, 4, 5 + 24 + 8)
    out, _ = dec.generate(prompts, 24, Drafts("noisy:0.5", plain, cfg.vocab_size, seed=0), eos=eos)
    for seq, ref in zip(out, plain):
        cut = ref.index(eos) + 1 if eos in ref[:24] else 24
        assert seq == ref[:cut]


def _chi2_critical(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.09: p = 0.001)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _chi2(observed: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """(statistic, 0.999 critical value), bins with expected count < 5 pooled."""
    big = expected >= 5
    e = torch.cat((expected[big], expected[~big].sum().reshape(1)))
    o = torch.cat((observed[big], observed[~big].sum().reshape(1)))
    keep = e > 0
    stat = float(((o[keep] - e[keep]) ** 2 / e[keep]).sum())
    return stat, _chi2_critical(int(keep.sum()) - 1)


@pytest.mark.parametrize("k,top_p", [(0, 1.0), (3, 1.0), (3, 0.8)])
def test_speculative_sampling_draws_from_the_target_distribution(k, top_p):
    """The first token (sampled at the end of prefill) and the second (a speculative step whose drafts are
    the likeliest second token, so both accept and reject paths carry mass) follow softmax(logits / T)
    within top_p: chi-square on each marginal, and no token outside the top-p set."""
    from megakernel.ops.spec import target_probs
    from model import Cache, Reference
    cfg = preset("tiny-dense").replace(vocab_size=12, num_nextn_predict_layers=0)
    w = init_weights(cfg, seed=3)
    temperature, B, runs = 1.3, 256, 8
    prompt = torch.randint(0, cfg.vocab_size, (1, 4), generator=torch.Generator().manual_seed(1))
    ref = Reference(cfg, w)

    def probs(seq):
        cache = Cache.allocate(cfg, 1, 8)
        logits = ref.step(seq, cache, torch.zeros(1, dtype=torch.long)).logits[0, -1]
        return target_probs(logits, temperature, top_p)
    p1 = probs(prompt)
    joint = torch.stack([p1[t] * probs(torch.cat((prompt, torch.tensor([[t]])), dim=1)) for t in range(cfg.vocab_size)])
    draft = int(joint.sum(0).argmax())
    guesses = [[draft] * 12 for _ in range(B)]
    counts = torch.zeros_like(joint)
    shared = _SharedPlans()  # every run steps the same shapes
    for run in range(runs):
        dec = shared(SpeculativeDecoder(cfg, w, k, B, 16, temperature=temperature, top_p=top_p, seed=run))
        out, _ = dec.generate(prompt.repeat(B, 1), 2, Drafts("oracle", guesses, cfg.vocab_size))
        for seq in out:
            counts[seq[0], seq[1]] += 1
    n = counts.sum()
    assert counts[joint == 0].sum() == 0  # never a token outside the top-p set
    for observed, target in ((counts.sum(1), joint.sum(1)), (counts.sum(0), joint.sum(0))):
        stat, critical = _chi2(observed, target * n)
        assert stat <= critical, (stat, critical)


def test_sampling_is_reproducible_from_the_seed():
    cfg, w, prompts = _setup("tiny-moe", 2)
    runs = [SpeculativeDecoder(cfg, w, 2, 2, 32, temperature=0.8, seed=s).generate(prompts, 6)[0] for s in (7, 7, 8)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_adaptive_k_keeps_output_and_follows_acceptance():
    from megakernel.adaptive import AdaptiveK
    cfg, w, prompts = _setup("tiny-moe", 2, seed=6)
    plain = _plain(cfg, w, prompts, NEW + 8)
    expected = [seq[:NEW + 6] for seq in plain]
    steep = {k: 1.0 + 0.5 * k for k in range(5)}  # each draft costs half a step: only good drafts pay
    for kind, low, high in (("oracle", 3.5, 4.0), ("noisy:0.95", 0.0, 1.5)):
        policy = AdaptiveK(4, steep, probe_every=0)
        drafts = Drafts(kind, oracle=plain, vocab=cfg.vocab_size, seed=1)
        out, stats = SpeculativeDecoder(cfg, w, 4, 2, 64, adaptive=policy).generate(prompts, NEW + 6, drafts)
        assert out == expected, kind  # lossless whatever k each step chose
        late = policy.chosen[len(policy.chosen) // 2:]
        assert low <= sum(late) / len(late) <= high, (kind, policy.chosen)
        assert stats.k_hist and max(stats.k_hist) <= 4


def test_adaptive_k_policy_and_its_simulated_gain():
    import sys
    sys.path.insert(0, "tools")
    from stepmath import simulate_adaptive

    from megakernel.adaptive import AdaptiveK, expected_tokens
    assert expected_tokens([0.5, 0.5], 2) == 1.75
    policy = AdaptiveK(3, {0: 1.0, 1: 1.1, 2: 1.2, 3: 1.3}, decay=0.5, probe_every=0)
    for _ in range(8):
        policy.observe(3, [0])  # the first draft is always rejected
    assert policy.accept[0] < 0.01 and policy.choose() == 0
    with pytest.raises(ValueError, match="missing"):
        AdaptiveK(3, {0: 1.0, 1: 1.1})
    times = {k: 1.0 + 0.15 * k for k in range(8)}
    stable = simulate_adaptive([0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3], times, 3000)
    assert stable["gain_over_best_fixed"] > -0.03  # within 3% of the best k known in hindsight
    shifting = simulate_adaptive([0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3], times, 3000,
                                 shift=[0.4, 0.2, 0.1, 0.1, 0.1, 0.1, 0.1])
    assert shifting["gain_over_best_fixed"] > 0  # no single k suits both halves


def test_thirty_two_sequences_per_step():
    cfg, w, prompts = _setup("tiny-moe", 32, seed=8)
    plain = _plain(cfg, w, prompts, 12)
    out, stats = SpeculativeDecoder(cfg, w, 3, 32, 40).generate(
        prompts, 8, Drafts("noisy:0.3", oracle=plain, vocab=cfg.vocab_size, seed=8))
    assert out == [seq[:8] for seq in plain]
    assert 1.5 < stats.acceptance_length < 4  # drafts were accepted and rejected across the batch


def test_spec_sweep_tool_dry_run(tmp_path):
    """tools/spec_sweep.py (the GPU k sweep + equality check) runs end to end on the CPU interpreter,
    two sequences per step."""
    import json
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "tools/spec_sweep.py", "--models", "tiny-moe", "--device", "cpu",
                          "--ctx", "24", "--kmax", "2", "--tokens", "8", "--batch", "2", "--compile-processes", "2",
                          "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads((tmp_path / "sweep_tiny-moe.json").read_text())
    assert [r["k"] for r in rows] == [0, 1, 2]
    assert rows[0]["reference"] and rows[0]["batch"] == 2
    assert all(r["equal_mtp"] and r["equal_oracle"] and r["equal_noisy"] and r["oracle_k_plus_1"] for r in rows[1:])
    assert rows[2]["acceptance_length_noisy"] > 1.0  # some drafts were accepted: the accept path ran
    # --temperature: the sweep alone, with the SAMPLE accept body (the sampling body's cost on a GPU)
    out = subprocess.run([sys.executable, "tools/spec_sweep.py", "--models", "tiny-moe", "--device", "cpu",
                          "--ctx", "24", "--kmax", "1", "--temperature", "0.7", "--top-p", "0.9",
                          "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads((tmp_path / "sweep_tiny-moe.json").read_text())
    assert [r["k"] for r in rows] == [0, 1] and rows[0]["sampling"] and "equal_mtp" not in rows[1]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU Triton interpreter only")
def test_triton_sampling_accept_equals_the_interpreter():
    """Speculative sampling through the persistent kernel (the SAMPLE body: fp64 softmax, top-p cut
    by bisection, counter-based uniforms): the same tokens and accepted drafts as the plan
    interpreter's reference, drafts accepted and rejected."""
    cfg = preset("tiny-dense").replace(vocab_size=64)
    w = init_weights(cfg, seed=3)
    prompts = torch.randint(0, cfg.vocab_size, (2, 3), generator=torch.Generator().manual_seed(4))
    greedy = SpeculativeDecoder(cfg, w, 0, 2, 24).generate(prompts, 10)[0]
    runs, shared = {}, _SharedPlans()  # both backends run the same plans
    for backend in ("interpret", "megakernel"):
        dec = shared(SpeculativeDecoder(cfg, w, 2, 2, 24, backend=backend, options=CompileOptions(workers=1),
                                        temperature=0.5, top_p=0.9, seed=5))
        runs[backend] = dec.generate(prompts, 5, Drafts("oracle", greedy, cfg.vocab_size))
    (out, stats), (want, want_stats) = runs["megakernel"], runs["interpret"]
    assert out == want and stats.accepted_hist == want_stats.accepted_hist
    assert 0 < sum(stats.accepted_hist) < 2 * len(stats.accepted_hist)  # both paths ran


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU Triton interpreter only")
def test_triton_sampling_primitives_equal_the_reference():
    """row_dist + sample_row (device) against target_probs + sample (reference), one logits row at a
    time, including exact ties at the top-p cut (kept whole on both sides) and rows longer than a chunk."""
    from megakernel.ops.spec import sample, target_probs, uniform
    gen = torch.Generator().manual_seed(0)
    cases = 0
    for V, top_p, tied in ((62, 0.5, True), (62, 0.9, False), (300, 0.7, False), (300, 1.0, False), (40, 0.3, True)):
        for seed in range(6):
            lg = torch.randn(V, generator=gen)
            if tied:
                lg[::2] = 0.25  # half the vocabulary shares one logit
            out = torch.zeros(1, dtype=torch.int32)
            exclude = seed - 1  # -1: none
            _draw[(1,)](lg, out, V, 1.3, top_p, seed, exclude, BV=64)
            p = target_probs(lg, 1.3, top_p)
            if exclude >= 0:
                p[exclude] = 0.0
                p = p / p.sum()
            assert int(out[0]) == sample(p, uniform(seed, 3, 1)), (V, top_p, seed)
            assert p[int(out[0])] > 0
            cases += 1
    assert cases == 30


@triton.jit
def _draw(lg, out, V, temp, top_p, seed, exclude, BV: tl.constexpr):
    """One sampled token of a logits row through the device's sampling primitives."""
    temp, top_p = tl.zeros([], tl.float64) + temp, tl.zeros([], tl.float64) + top_p
    mx, z, cut, kept = row_dist(lg, V, temp, top_p, BV)
    tl.store(out, sample_row(lg, V, temp, mx, z, cut, kept, exclude, uniform_dev(seed, 3, 1), BV))


def test_plans_compiled_side_by_side_equal_the_ones_compiled_in_turn():
    """SpeculativeDecoder.precompile (spec_sweep's setup): worker processes compile the same plans,
    every one a verify or prefill shape the decoder then uses without compiling again."""
    cfg = preset("tiny-moe")
    w = init_weights(cfg, seed=1)
    dec = SpeculativeDecoder(cfg, w, 2, 2, 32)
    dec.precompile(range(3), 1, 2)
    shapes = set(dec.engine.plans)
    assert shapes == {dec.step_shape(k + 1, False) for k in range(3)} | {dec.step_shape(1, True)}
    for shape, plan in dec.engine.plans.items():
        alone = compile_step(cfg, shape, dec.engine.options)
        assert (plan.words == alone.words).all() and plan.queue_ptr == alone.queue_ptr, shape
    dec.generate(torch.tensor([[3], [5]]), 4, Drafts("oracle", [[1] * 8, [2] * 8], cfg.vocab_size))
    assert set(dec.engine.plans) == shapes  # nothing compiled on the way
