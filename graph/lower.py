"""Lower one decode step of a model config to an unfused op graph.

The graph is what an unfused engine launches: a rope table per layer, separate
norm / add / activation ops, router scores, top-k and slot tables as separate
ops, mHC mixing, activation and Sinkhorn as separate ops.  Passes then merge
and fuse.  Row r of every activation is token t of sequence b, r = b·T + t.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from model.config import ModelConfig
from model.rope import inv_freq_and_scale
from model.schema import TensorSpec, layer_prefix, tensor_specs

from .ir import Graph, Op, Tensor, View
from .isa import Buf, box_layout


@dataclass(frozen=True)
class StepShape:
    """A shape bucket: T tokens for each of B sequences against caches of max_len positions,
    followed by mtp_passes MTP draft passes."""

    T: int = 1
    B: int = 1
    max_len: int = 4096
    mtp_passes: int = 0
    attn_split: int = 0  # cache positions per attention task; 0 = chosen from max_len
    speculative: bool = False  # verify T tokens, accept on the device, draft T-1 with the MTP head
    accept: str = "greedy"  # greedy | sample
    prefill: bool = False  # speculative prefill chunk: every input token is given (all accepted)
    temperature: float = 1.0  # accept == "sample"
    top_p: float = 1.0
    helper_slots: int = -1  # >= 0: routed experts sit in this many main slots, the rest on a helper

    @property
    def helper(self) -> bool:
        return self.helper_slots >= 0

    @property
    def N(self) -> int:
        return self.T * self.B

    @property
    def min_max_len(self) -> int:
        """The fewest cache positions this step lowers with: its T tokens and MTP passes, and 2·T more for a
        speculative step."""
        return 2 * self.T * self.speculative + self.T + self.mtp_passes

    def split_len(self) -> int:
        if self.attn_split:
            return self.attn_split
        return max(64, 64 * math.ceil(self.max_len / 16 / 64))


class _Lowering:
    def __init__(self, cfg: ModelConfig, shape: StepShape, vocab_block: int = 4096):
        if shape.T < 1 or shape.B < 1 or shape.max_len < shape.min_max_len:
            raise ValueError(f"bad step shape {shape}: need T, B >= 1 and max_len >= T + mtp_passes, plus 2·T for a "
                             "speculative step")
        if shape.mtp_passes and not cfg.num_nextn_predict_layers:
            raise ValueError("mtp_passes > 0 needs a model with MTP layers (num_nextn_predict_layers > 0)")
        if shape.speculative and shape.mtp_passes:
            raise ValueError("a speculative step drafts T-1 tokens itself; mtp_passes must be 0")
        if shape.accept not in ("greedy", "sample"):
            raise ValueError(f"accept must be 'greedy' or 'sample', got {shape.accept!r}")
        if shape.accept == "sample" and not (shape.temperature > 0 and 0 < shape.top_p <= 1):
            raise ValueError("sampling needs temperature > 0 and 0 < top_p <= 1, "
                             f"got {shape.temperature}, {shape.top_p}")
        self.cfg, self.shape, self.g, self.vocab_block = cfg, shape, Graph(), vocab_block
        # the rows being lowered: T tokens per sequence at positions cl[b] + t (+ an op's pos_offset)
        self.T, self.N = shape.T, shape.N
        self.specs: dict[str, TensorSpec] = {s.name: s for s in tensor_specs(cfg)}
        self.names: dict[str, int] = {}
        self.tokens = self._io("in.tokens", self.N, "input")
        self.cache_lens = self._io("in.cache_lens", shape.B, "input")
        self.cl = self.cache_lens
        self.caches = [
            self.g.add_tensor(Tensor(f"cache.L{layer}", Buf.C, shape.B * shape.max_len, cfg.cache_width, role="cache"))
            for layer in range(cfg.num_layers_total)
        ]
        self.rope_consts: dict[tuple, tuple[str, float]] = {}

    # ---- tensors -----------------------------------------------------------
    def _io(self, name: str, rows: int, role: str, buf: Buf = Buf.I, cols: int = 1) -> str:
        return self.g.add_tensor(Tensor(name, buf, rows, cols, role=role))

    def unique(self, label: str) -> str:
        n = self.names.get(label, 0)
        self.names[label] = n + 1
        return f"{label}#{n}" if n else label

    def act(self, label: str, rows: int, cols: int, buf: Buf = Buf.A) -> str:
        return self.g.add_tensor(Tensor(self.unique(label), buf, rows, cols))

    def weight(self, hf_name: str) -> str:
        """The tensor holding one HF weight (optional ones fall back to the tensor they share)."""
        hf_name = self._resolve(hf_name)
        if hf_name not in self.g.tensors:
            spec = self.specs[hf_name]
            rows, cols = (1, spec.shape[0]) if len(spec.shape) == 1 else spec.shape
            # tensors that are fp32 by definition live in the fp32 arena; the rest in the model dtype's
            buf = Buf.WF if spec.init in ("bias", "hc_fn", "hc_base", "hc_scale") else Buf.W
            self.g.add_tensor(Tensor(hf_name, buf, rows, cols, role="weight", parts=((hf_name, 0),)))
        return hf_name

    def _resolve(self, hf_name: str) -> str:
        if hf_name == "lm_head.weight" and self.cfg.tie_word_embeddings:
            return "model.embed_tokens.weight"
        if not self.specs[hf_name].optional:
            return hf_name
        return ("model.embed_tokens.weight" if hf_name.endswith("embed_tokens.weight")
                else self._resolve("lm_head.weight"))

    def experts(self, layer: int) -> str:
        """All routed experts of a layer in one tensor: row e = [gate_e | up_e | down_e]."""
        name = f"L{layer}.experts"
        if name not in self.g.tensors:
            I, H = self.cfg.moe_intermediate_size, self.cfg.hidden_size
            p = layer_prefix(layer) + "mlp.experts."
            parts = []
            for e in range(self.cfg.n_routed_experts):
                for j, proj in enumerate(("gate_proj", "up_proj", "down_proj")):
                    parts.append((f"{p}{e}.{proj}.weight", e * 3 * I * H + j * I * H))
            self.g.add_tensor(Tensor(name, Buf.W, self.cfg.n_routed_experts, 3 * I * H, role="weight",
                                     parts=tuple(parts)))
        return name

    def main_experts(self) -> str:
        """Helper plans: one arena of helper_slots expert slots (row = gate | up | down) shared by
        every MoE layer; which expert sits in which slot is a run-time input (the expert maps)."""
        name = "experts.main"
        if name not in self.g.tensors:
            I, H = self.cfg.moe_intermediate_size, self.cfg.hidden_size
            self.g.add_tensor(Tensor(name, Buf.W, max(1, self.shape.helper_slots), 3 * I * H, role="weight"))
        return name

    def rope_const(self, layer: int) -> tuple[str, float]:
        spec = self.cfg.rope_for_layer(layer)
        if spec.key() not in self.rope_consts:
            inv_freq, scale = inv_freq_and_scale(spec)
            name = f"const.rope{len(self.rope_consts)}.inv_freq"
            self.g.add_tensor(Tensor(name, Buf.WF, 1, spec.dim // 2, role="const", data=tuple(inv_freq.tolist())))
            self.rope_consts[spec.key()] = (name, scale)
        return self.rope_consts[spec.key()]

    # ---- ops ---------------------------------------------------------------
    def emit(self, opcode: str, label: str, flags=(), reads=None, writes=None, layer=None, **attrs) -> Op:
        def views(d):
            return {k: (v if isinstance(v, View) else View(v)) for k, v in (d or {}).items()}
        op = Op(len(self.g.ops), opcode, frozenset(flags), attrs, views(reads), views(writes), label, layer)
        self.g.ops.append(op)
        return op

    def linear(self, label, x, w_name, rows, K, layer, x_col0=0):
        out = self.act(label, self.N, rows)
        self.emit("LINEAR", label, reads={"x": View(x, x_col0), "w": self.weight(w_name)}, writes={"out": out},
                  layer=layer, N=self.N, K=K, rows=rows)
        return out

    def rmsnorm(self, label, x, w_name, D, layer, x_col0=0, out=None, out_col0=0):
        if out is None:
            out = self.act(label, self.N, D)
        reads = {"x": View(x, x_col0)}
        flags = ()
        if w_name is None:
            flags = ("NOWEIGHT",)
        else:
            reads["w"] = self.weight(w_name)
        self.emit("RMSNORM", label, flags, reads=reads, writes={"out": View(out, out_col0, D)}, layer=layer,
                  D=D, rows=self.N, eps=self.cfg.rms_norm_eps)
        return out

    def ewise(self, kind, label, a, b, cols, rows=None, layer=None):
        rows = rows or self.N
        out = self.act(label, rows, cols)
        reads = {"a": a} if b is None else {"a": a, "b": b}
        self.emit("EWISE", label, (kind,), reads=reads, writes={"out": out}, layer=layer, cols=cols, rows=rows)
        return out

    def mlp(self, label, x, p, inter, layer):
        H = self.cfg.hidden_size
        g = self.linear(f"{label}.gate", x, p + "gate_proj.weight", inter, H, layer)
        u = self.linear(f"{label}.up", x, p + "up_proj.weight", inter, H, layer)
        s = self.ewise("SILU", f"{label}.silu", g, None, inter, layer=layer)
        m = self.ewise("MUL", f"{label}.mul", s, u, inter, layer=layer)
        return self.linear(f"{label}.down", m, p + "down_proj.weight", H, inter, layer)

    # ---- layers ------------------------------------------------------------
    def rope_table(self, layer, pos_offset):
        const, scale = self.rope_const(layer)
        half = self.cfg.rope_for_layer(layer).dim // 2
        out = self.act(f"L{layer}.rope_table", self.N, 2 * half)
        self.emit("ROPE_TABLE", f"L{layer}.rope_table", reads={"cl": self.cl, "f": const},
                  writes={"out": out}, layer=layer, T=self.T, half=half, scale=scale,
                  pos_offset=pos_offset, rows=self.N)
        return out

    def rope(self, label, x, table, heads, x_hs, x_col0, half, layer):
        out = self.act(label, self.N, heads * 2 * half)
        flags = ("INTERLEAVE",) if self.cfg.rope.interleave else ()
        self.emit("ROPE", label, flags, reads={"x": x, "tab": table}, writes={"out": out}, layer=layer,
                  heads=heads, x_hs=x_hs, x_col0=x_col0, out_hs=2 * half, half=half, rows=self.N)
        return out

    def cache_write(self, label, src, layer, col0, cols, pos_offset):
        s = self.shape
        self.emit("CACHE_WRITE", label, reads={"src": src, "cl": self.cl},
                  writes={"cache": self.caches[layer]}, layer=layer, T=self.T, S=s.max_len,
                  width=self.cfg.cache_width, col0=col0, cols=cols, pos_offset=pos_offset, rows=self.N)

    def attention_core(self, label, layer, q, q_hs, pe, pe_hs, dim, pos_offset, mla, v_col0=0, kv_hs=0, group=1):
        cfg, s, T = self.cfg, self.shape, self.T
        nh = cfg.num_attention_heads
        split_len = min(s.split_len(), s.max_len)
        nsplits = math.ceil(s.max_len / split_len)
        part_o = self.act(f"{label}.partial_o", s.B * nsplits * T * nh, dim)
        part_lse = self.act(f"{label}.partial_lse", s.B * nsplits * T * nh, 1)
        reads = {"q": q, "cache": self.caches[layer], "cl": self.cl}
        if pe is not None:
            reads["pe"] = pe
        self.emit("ATTENTION", label, ("MLA",) if mla else (), reads=reads, writes={"op": part_o, "lse": part_lse},
                  layer=layer, q_hs=q_hs, q_col0=0, pe_hs=pe_hs, pe_col0=0, T=T, S=s.max_len,
                  width=cfg.cache_width, dim=dim, rope_dim=cfg.qk_rope_head_dim if mla else 0, v_col0=v_col0,
                  kv_hs=kv_hs, group=group, scale=cfg.softmax_scale, nheads=nh, nsplits=nsplits,
                  split_len=split_len, pos_offset=pos_offset, B=s.B)
        out = self.act(f"{label}.out", self.N, nh * dim)
        self.emit("ATTN_COMBINE", f"{label}.combine", reads={"op": part_o, "lse": part_lse}, writes={"out": out},
                  layer=layer, T=T, nheads=nh, nsplits=nsplits, dim=dim, B=s.B)
        return out

    def mla(self, layer, h, table, pos_offset):
        cfg = self.cfg
        nh, nope, rope, vd, r = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                                 cfg.v_head_dim, cfg.kv_lora_rank)
        H, qk, L = cfg.hidden_size, cfg.qk_head_dim, f"L{layer}.attn"
        a = layer_prefix(layer) + "self_attn."
        if cfg.q_lora_rank is None:
            q = self.linear(f"{L}.q_proj", h, a + "q_proj.weight", nh * qk, H, layer)
        else:
            qa = self.linear(f"{L}.q_a_proj", h, a + "q_a_proj.weight", cfg.q_lora_rank, H, layer)
            qa = self.rmsnorm(f"{L}.q_a_norm", qa, a + "q_a_layernorm.weight", cfg.q_lora_rank, layer)
            q = self.linear(f"{L}.q_b_proj", qa, a + "q_b_proj.weight", nh * qk, cfg.q_lora_rank, layer)
        kv = self.linear(f"{L}.kv_a_proj", h, a + "kv_a_proj_with_mqa.weight", r + rope, H, layer)
        latent = self.rmsnorm(f"{L}.kv_a_norm", kv, a + "kv_a_layernorm.weight", r, layer)
        k_pe = self.rope(f"{L}.k_rope", View(kv, r), table, 1, 0, 0, rope // 2, layer)
        self.cache_write(f"{L}.cache_latent", latent, layer, 0, r, pos_offset)
        self.cache_write(f"{L}.cache_k_pe", k_pe, layer, r, rope, pos_offset)
        q_pe = self.rope(f"{L}.q_rope", q, table, nh, qk, nope, rope // 2, layer)
        kv_b = self.weight(a + "kv_b_proj.weight")
        q_lat = self.act(f"{L}.q_absorb", self.N, nh * r)
        self.emit("HEAD_MATMUL", f"{L}.q_absorb", reads={"x": q, "w": kv_b}, writes={"out": q_lat}, layer=layer,
                  x_hs=qk, x_col0=0, w_hs=(nope + vd) * r, w_ld=r, out_hs=r, N=self.N, in_dim=nope, out_dim=r,
                  heads=nh)
        o_lat = self.attention_core(L, layer, q_lat, r, q_pe, rope, r, pos_offset, mla=True)
        o = self.act(f"{L}.v_up", self.N, nh * vd)
        self.emit("HEAD_MATMUL", f"{L}.v_up", ("TRANS",), reads={"x": o_lat, "w": View(kv_b, nope * r)},
                  writes={"out": o}, layer=layer, x_hs=r, x_col0=0, w_hs=(nope + vd) * r, w_ld=r, out_hs=vd,
                  N=self.N, in_dim=r, out_dim=vd, heads=nh)
        return self.linear(f"{L}.o_proj", o, a + "o_proj.weight", H, nh * vd, layer)

    def gqa(self, layer, h, table, pos_offset):
        cfg = self.cfg
        nh, nkv, hd, H, L = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                             cfg.hidden_size, f"L{layer}.attn")
        a = layer_prefix(layer) + "self_attn."
        q = self.linear(f"{L}.q_proj", h, a + "q_proj.weight", nh * hd, H, layer)
        k = self.linear(f"{L}.k_proj", h, a + "k_proj.weight", nkv * hd, H, layer)
        v = self.linear(f"{L}.v_proj", h, a + "v_proj.weight", nkv * hd, H, layer)
        q = self.rope(f"{L}.q_rope", q, table, nh, hd, 0, hd // 2, layer)
        k = self.rope(f"{L}.k_rope", k, table, nkv, hd, 0, hd // 2, layer)
        self.cache_write(f"{L}.cache_k", k, layer, 0, nkv * hd, pos_offset)
        self.cache_write(f"{L}.cache_v", v, layer, nkv * hd, nkv * hd, pos_offset)
        o = self.attention_core(L, layer, q, hd, None, 0, hd, pos_offset, mla=False, v_col0=nkv * hd, kv_hs=hd,
                                group=nh // nkv)
        return self.linear(f"{L}.o_proj", o, a + "o_proj.weight", H, nh * hd, layer)

    def moe(self, layer, h):
        cfg, N = self.cfg, self.N
        H, E, k, I, L = (cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok,
                         cfg.moe_intermediate_size, f"L{layer}.moe")
        p = layer_prefix(layer) + "mlp."
        slots = min(E, N * k)
        logits = self.linear(f"{L}.router", h, p + "gate.weight", E, H, layer)
        scores = self.act(f"{L}.scores", N, E)
        ids = self.act(f"{L}.ids", N, k, Buf.I)
        wts = self.act(f"{L}.weights", N, k)
        table = self.act(f"{L}.slots", 1, 2 * slots + slots * N * k, Buf.I)
        method = dict(SIGMOID=cfg.scoring_func == "sigmoid", NOAUX=cfg.topk_method == "noaux_tc",
                      GROUPED=cfg.topk_method != "greedy", NORM=cfg.norm_topk_prob and k > 1)
        kinds = tuple(f for f, on in method.items() if on)
        dims = dict(N=N, E=E, topk=k, n_group=cfg.n_group, topk_group=cfg.topk_group, scale=cfg.routed_scaling_factor,
                    S=slots)
        self.emit("ROUTE", f"{L}.score", ("SCORE",) + kinds, reads={"lg": logits}, writes={"sc": scores},
                  layer=layer, **dims)
        topk_reads = {"sc": scores}
        if method["NOAUX"]:
            topk_reads["bias"] = self.weight(p + "gate.e_score_correction_bias")
        self.emit("ROUTE", f"{L}.topk", ("TOPK",) + kinds, reads=topk_reads, writes={"ids": ids, "wts": wts},
                  layer=layer, **dims)
        self.emit("ROUTE", f"{L}.slots", ("SLOTS",) + kinds, reads={"ids": ids}, writes={"st": table},
                  layer=layer, **dims)
        pairs = N * k  # expert rows are (token, k) pairs: row = token·k + kidx
        extra = {}
        if self.shape.helper:
            experts = self.main_experts()
            emap = f"in.L{layer}.expert_map"  # MTP passes lower the same layer again: one map per layer
            if emap not in self.g.tensors:
                self._io(emap, 1, "input", cols=E)
            main_table = self.act(f"{L}.slots_main", 1, 2 * slots + slots * N * k, Buf.I)
            mail = self.act(f"{L}.helper_mail", 1, 2, Buf.I)
            # each call site its own mailbox (an MTP layer lowered for several passes has several)
            box = self.g.add_tensor(Tensor(self.unique(f"{L}.helper_box"), Buf.H, 1,
                                           box_layout(slots, pairs, N, H)["size"], role="mailbox"))
            self.emit("HELPER_CALL", f"{L}.helper_call", reads={"st": table, "map": emap, "x": h},
                      writes={"st2": main_table, "mail": mail, "box": box}, layer=layer, N=N, K=H, E=E, topk=k,
                      S=slots)
            table, extra = main_table, {"map": emap}
        else:
            experts = self.experts(layer)

        def expert(label, x, col0, rows, K, flags):
            out = self.act(f"{L}.{label}", pairs, rows)
            self.emit("EXPERT_LINEAR", f"{L}.{label}", flags,
                      reads={"x": x, "w": View(experts, col0), "st": table, **extra},
                      writes={"out": out}, layer=layer, N=N, K=K, rows=rows, S=slots, topk=k, w_es=3 * I * H, E=E)
            return out

        g = expert("expert_gate", h, 0, I, H, ("GATHER",))
        u = expert("expert_up", h, I * H, I, H, ("GATHER",))
        s = self.ewise("SILU", f"{L}.expert_silu", g, None, I, rows=pairs, layer=layer)
        m = self.ewise("MUL", f"{L}.expert_mul", s, u, I, rows=pairs, layer=layer)
        y = expert("expert_down", m, 2 * I * H, H, I, ())
        if self.shape.helper:
            merged = self.act(f"{L}.expert_rows", pairs, H)
            self.emit("HELPER_WAIT", f"{L}.helper_wait", reads={"y": y, "mail": mail, "box": box},
                      writes={"out": merged},
                      layer=layer, N=N, H=H, topk=k)
            y = merged
        out = self.act(f"{L}.combine", N, H)
        self.emit("MOE_COMBINE", f"{L}.combine", reads={"y": y, "wts": wts}, writes={"out": out}, layer=layer,
                  H=H, topk=k, rows=N)
        if cfg.n_shared_experts:
            shared = self.mlp(f"{L}.shared", h, p + "shared_experts.", I * cfg.n_shared_experts, layer)
            out = self.ewise("ADD", f"{L}.add_shared", out, shared, H, layer=layer)
        return out

    def hc_pre(self, label, layer, streams, prefix):
        """mHC coefficients (mix, activation, Sinkhorn) and the collapsed sublayer input."""
        cfg, N = self.cfg, self.N
        n, H = cfg.hc_mult, cfg.hidden_size
        w = {"fn": self.weight(prefix + "fn"), "base": self.weight(prefix + "base"),
             "scale": self.weight(prefix + "scale")}
        mix = self.act(f"{label}.mix", N, (2 + n) * n)
        craw = self.act(f"{label}.coef_raw", N, (2 + n) * n)
        coef = self.act(f"{label}.coef", N, (2 + n) * n)
        x = self.act(f"{label}.collapse", N, H)
        dims = dict(n=n, H=H, iters=cfg.hc_sinkhorn_iters, eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps, rows=N)
        self.emit("HC_COEFF", f"{label}.mix", ("MIX",), reads={"st": streams, "fn": w["fn"]}, writes={"mix": mix},
                  layer=layer, **dims)
        self.emit("HC_COEFF", f"{label}.act", ("ACT",), reads={"mix": mix, "base": w["base"], "scale": w["scale"]},
                  writes={"craw": craw}, layer=layer, **dims)
        self.emit("HC_COEFF", f"{label}.sinkhorn", ("SINK",), reads={"craw": craw}, writes={"coef": coef},
                  layer=layer, **dims)
        self.emit("HC_COEFF", f"{label}.collapse", ("COLLAPSE",), reads={"st": streams, "coef": coef},
                  writes={"out": x}, layer=layer, **dims)
        return coef, x

    def hc_expand(self, label, layer, streams, sub, coef):
        n, H = self.cfg.hc_mult, self.cfg.hidden_size
        out = self.act(f"{label}.streams", self.N, n * H)
        self.emit("HC_EXPAND", f"{label}.expand", reads={"st": streams, "sub": sub, "coef": coef},
                  writes={"out": out}, layer=layer, n=n, H=H, rows=self.N)
        return out

    def hc_head(self, label, streams, prefix):
        cfg = self.cfg
        out = self.act(label, self.N, cfg.hidden_size)
        self.emit("HC_HEAD", label, reads={"st": streams, "fn": self.weight(prefix + "hc_fn"),
                                           "base": self.weight(prefix + "hc_base"),
                                           "scale": self.weight(prefix + "hc_scale")},
                  writes={"out": out}, n=cfg.hc_mult, H=cfg.hidden_size, eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps,
                  rows=self.N)
        return out

    def decoder_layer(self, layer, x, pos_offset=0):
        cfg = self.cfg
        H, p, L = cfg.hidden_size, layer_prefix(layer), f"L{layer}"
        table = self.rope_table(layer, pos_offset)
        attention = self.mla if cfg.is_mla else self.gqa
        if cfg.hc_mult:
            coef, xin = self.hc_pre(f"{L}.attn_hc", layer, x, p + "attn_hc.")
            h = self.rmsnorm(f"{L}.input_norm", xin, p + "input_layernorm.weight", H, layer)
            x = self.hc_expand(f"{L}.attn_hc", layer, x, attention(layer, h, table, pos_offset), coef)
            coef, xin = self.hc_pre(f"{L}.ffn_hc", layer, x, p + "ffn_hc.")
            h = self.rmsnorm(f"{L}.post_attn_norm", xin, p + "post_attention_layernorm.weight", H, layer)
            return self.hc_expand(f"{L}.ffn_hc", layer, x, self.ffn(layer, h), coef)
        h = self.rmsnorm(f"{L}.input_norm", x, p + "input_layernorm.weight", H, layer)
        x = self.ewise("ADD", f"{L}.attn_residual", x, attention(layer, h, table, pos_offset), H, layer=layer)
        h = self.rmsnorm(f"{L}.post_attn_norm", x, p + "post_attention_layernorm.weight", H, layer)
        return self.ewise("ADD", f"{L}.ffn_residual", x, self.ffn(layer, h), H, layer=layer)

    def ffn(self, layer, h):
        if self.cfg.is_moe_layer(layer):
            return self.moe(layer, h)
        return self.mlp(f"L{layer}.mlp", h, layer_prefix(layer) + "mlp.", self.cfg.intermediate_size, layer)

    def head(self, label, hidden, head_weight, out_logits, out_tokens):
        cfg, N, V = self.cfg, self.N, self.cfg.vocab_size
        self.emit("LINEAR", f"{label}.lm_head", reads={"x": hidden, "w": self.weight(head_weight)},
                  writes={"out": out_logits}, N=N, K=cfg.hidden_size, rows=V)
        block = min(self.vocab_block, V)
        nparts = math.ceil(V / block)
        dims = dict(N=N, V=V, block=block, nparts=nparts)
        if nparts == 1:
            self.emit("ARGMAX", f"{label}.argmax", ("PARTIAL", "FINAL"), reads={"lg": out_logits},
                      writes={"out": out_tokens}, **dims)
            return
        pv, pi = self.act(f"{label}.argmax_val", N, nparts), self.act(f"{label}.argmax_idx", N, nparts, Buf.I)
        self.emit("ARGMAX", f"{label}.argmax_partial", ("PARTIAL",), reads={"lg": out_logits},
                  writes={"pv": pv, "pi": pi}, **dims)
        self.emit("ARGMAX", f"{label}.argmax", ("FINAL",), reads={"pv": pv, "pi": pi}, writes={"out": out_tokens},
                  **dims)

    def lower(self) -> Graph:
        cfg, N, H = self.cfg, self.N, self.cfg.hidden_size
        copies = max(cfg.hc_mult, 1)
        x = self.act("embed", N, H * copies)
        self.emit("EMBED", "embed", reads={"tok": self.tokens, "table": self.weight("model.embed_tokens.weight")},
                  writes={"out": x}, H=H, copies=copies, rows=N)
        for layer in range(cfg.num_hidden_layers):
            x = self.decoder_layer(layer, x)
        if cfg.hc_mult:
            x = self.hc_head("hc_head", x, "model.hc_head.")
        hidden = self._io("out.hidden", N, "output", Buf.A, H)
        self.rmsnorm("final_norm", x, "model.norm.weight", H, None, out=hidden)
        logits = self._io("out.logits", N, "output", Buf.A, cfg.vocab_size)
        tokens = self._io("out.tokens", N, "output")
        self.head("main", hidden, "lm_head.weight", logits, tokens)
        if self.shape.speculative:
            self.speculate(hidden, tokens)
            return self.g
        for i in range(self.shape.mtp_passes):
            out_hidden = self._io(f"out.mtp{i}.hidden", N, "output", Buf.A, H)
            out_logits = self._io(f"out.mtp{i}.logits", N, "output", Buf.A, cfg.vocab_size)
            out_tokens = self._io(f"out.mtp{i}.tokens", N, "output")
            self.mtp_pass(i, hidden, tokens, i, out_hidden, out_logits, out_tokens)
            hidden, tokens = out_hidden, out_tokens
        return self.g

    def speculate(self, hidden: str, targets: str) -> None:
        """Accept on the device, then draft T-1 tokens with the MTP head from the accepted position.

        Pass 0 runs the MTP layer over all T rows (row i: hidden i with the token at position i+1,
        i.e. the accepted drafts, then the bonus token), which also fills the MTP cache for every
        accepted position; the draft comes from row a.  Passes j >= 1 run one row per sequence at
        position cache_len + a + j (base = cache_len + a, written by ACCEPT)."""
        cfg, s, H, V = self.cfg, self.shape, self.cfg.hidden_size, self.cfg.vocab_size
        B, T, N = s.B, s.T, s.N
        accepted = self._io("out.accepted", B, "output")
        emitted = self._io("out.emitted", B, "output", Buf.I, T)
        next_tokens = self._io("out.next_tokens", B, "output", Buf.I, T)
        next_lens = self._io("out.next_lens", B, "output")
        follow = self._io("in.follow", B, "input")
        base = self.act("spec.base", B, 1, Buf.I)
        mtp_tokens = self.act("spec.mtp_tokens", N, 1, Buf.I)
        flags = ("ALL",) if s.prefill else ()
        flags += ("SAMPLE",) if s.accept == "sample" else () if s.prefill else ("GREEDY",)
        reads = {"tok": self.tokens, "tgt": targets, "cl": self.cache_lens, "follow": follow}
        if s.accept == "sample":
            reads.update(lg="out.logits", rng=self._io("in.rng", B, "input"))
        self.emit("ACCEPT", "accept", flags, reads=reads,
                  writes={"acc": accepted, "emit": emitted, "next": View(next_tokens, 0, 1), "base": base,
                          "lens": next_lens, "mtp": mtp_tokens}, T=T, B=B, V=cfg.vocab_size,
                  temperature=s.temperature, top_p=s.top_p)
        drafts = T - 1
        if not drafts or not cfg.num_nextn_predict_layers:
            return
        rows_hidden = self.act("spec.mtp0.hidden", N, H)
        rows_logits = self.act("spec.mtp0.logits", N, V)
        rows_tokens = self.act("spec.mtp0.tokens", N, 1, Buf.I)
        self.mtp_pass(0, hidden, mtp_tokens, 0, rows_hidden, rows_logits, rows_tokens)
        self.emit("GATHER", "spec.draft1", ("INT",), reads={"src": rows_tokens, "idx": accepted},
                  writes={"out": View(next_tokens, 1, 1)}, T=T, cols=1, B=B)
        h = self.act("spec.hidden1", B, H)
        self.emit("GATHER", "spec.hidden1", reads={"src": rows_hidden, "idx": accepted}, writes={"out": h},
                  T=T, cols=H, B=B)
        saved = self.T, self.N, self.cl
        self.T, self.N, self.cl = 1, B, base  # one row per sequence at cache_len + a + j
        for j in range(1, drafts):
            h_next = self.act(f"spec.hidden{j + 1}", B, H)
            logits = self.act(f"spec.mtp{j}.logits", B, V)
            self.mtp_pass(j, h, View(next_tokens, j, 1), j, h_next, logits, View(next_tokens, j + 1, 1))
            h = h_next
        self.T, self.N, self.cl = saved

    def mtp_pass(self, i: int, hidden: str, tokens, pos_offset: int, out_hidden: str, out_logits: str,
                 out_tokens) -> None:
        """MTP layer i mod n on (hidden, tokens) over the current rows, positions shifted by pos_offset."""
        cfg, N, H = self.cfg, self.N, self.cfg.hidden_size
        layer = cfg.num_hidden_layers + i % cfg.num_nextn_predict_layers
        p, L = layer_prefix(layer), f"mtp{i}"
        e = self.act(f"{L}.embed", N, H)
        self.emit("EMBED", f"{L}.embed", reads={"tok": tokens, "table": self.weight(p + "embed_tokens.weight")},
                  writes={"out": e}, layer=layer, H=H, copies=1, rows=N)
        cat = self.act(f"{L}.concat", N, 2 * H)
        self.rmsnorm(f"{L}.enorm", e, p + "enorm.weight", H, layer, out=cat, out_col0=0)
        self.rmsnorm(f"{L}.hnorm", hidden, p + "hnorm.weight", H, layer, out=cat, out_col0=H)
        x = self.linear(f"{L}.eh_proj", cat, p + "eh_proj.weight", H, 2 * H, layer)
        if cfg.hc_mult:
            streams = self.act(f"{L}.streams_in", N, cfg.hc_mult * H)
            for j in range(cfg.hc_mult):
                self.emit("EWISE", f"{L}.to_stream{j}", ("COPY",), reads={"a": x},
                          writes={"out": View(streams, j * H, H)}, layer=layer, cols=H, rows=N)
            x = self.hc_head(f"{L}.hc_head", self.decoder_layer(layer, streams, pos_offset=pos_offset), p + "hc_head.")
        else:
            x = self.decoder_layer(layer, x, pos_offset=pos_offset)
        normed = self.rmsnorm(f"{L}.shared_head_norm", x, p + "shared_head.norm.weight", H, layer)
        self.head(L, normed, p + "shared_head.head.weight", out_logits, out_tokens)
        self.emit("EWISE", f"{L}.keep_hidden", ("COPY",), reads={"a": x}, writes={"out": out_hidden},
                  layer=layer, cols=H, rows=N)


def lower(cfg: ModelConfig, shape: StepShape, vocab_block: int = 4096) -> Graph:
    return _Lowering(cfg, shape, vocab_block).lower()
