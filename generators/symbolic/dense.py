"""Model modules written once over named dimensions and traced for any degrees and sizes.

A layer is a mixer and an MLP, each behind a norm and a residual add (or, `parallel_block`, side by side behind
one norm or two and one residual add):
- mixers: attention (GPT MHA, LLaMA GQA with RoPE), DeepSeek multi-head latent attention (MLA), Mamba selective
  scan (SSM);
- MLPs: dense (GeLU, SwiGLU or GeGLU), mixture of experts (`generators.symbolic.experts`: router, top-k dispatch,
  experts, combine; shared experts).

Dimensions: b micro-batch (over all data-parallel ranks), s sequence (queries), t keys/values (the KV cache in
decode), h hidden, n heads, g kv heads, d head dim, f MLP width, v vocabulary, p position-table rows; MoE: e
experts, a the experts that receive tokens (inference: `dse.routing.active_experts`; training: e), c token slots
per such expert on the busiest rank (b s top_k / a, times workload.routing.imbalance), r expert width, rs shared
experts' width; MLA: ql, kl query and kv ranks, qk = dn + dr query/key head dim (no-RoPE and RoPE parts), dv value
head dim, kr = kl + dr a latent cache row, u the latent cache's one head copied on each TP rank (size tp, split
over tp); SSM: i inner width, N state, w convolution width, dt the step-size rank, x the x_proj output (dt + 2N).

Parallel axes of the tensors: tp (Megatron: column-parallel QKV, MLP-in and expert-in, row-parallel outputs,
vocabulary-parallel embedding and head; SSM inner channels split), cp (sequence split, K/V all-gathered or passed
around a ring), ep (experts split; tokens reach their experts by all-to-all), dp (batch split, weights duplicated
or, under ZeRO-3, sharded over the data axes and cp together and all-gathered before use). With ep > 1 the
data-parallel ranks are ep x dp, so tokens split over both. A layer may use the tp ranks as more data-parallel
ranks instead (parallel.layer_strategies 'dp'): its batch splits over tp and its weights are whole; the matcher
moves the residual stream between layers of different strategies.

Kernels (workload.kernels): fused prices each norm, RoPE and activation as one kernel (Megatron/TransformerEngine,
torch.compile); eager decomposes RMSNorm, RoPE and SwiGLU into the aten ops the reference PyTorch Llama code runs,
in their dtypes, with the gradients and saved tensors of eager autograd (`tensors.Partial`). LayerNorm and GeLU are
single aten kernels either way; MLA's RoPE is applied to the whole query head, not only its RoPE part.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

from dse.modelstats import LayerKind, dt_rank, gated, ssm_inner
from dse.spec import DesignPoint
from generators.symbolic.attention import attend
from generators.symbolic.dist import DUP, PARTIAL, Dist, Partition
from generators.symbolic.experts import active_expert_count, moe
from generators.symbolic.graph import FP32, Tracer
from generators.symbolic.tensors import OUTPUT, PRODUCT, SCALED, Partial, STensor, make_layout

RotationTables = dict[str, STensor]
"""fms's per-position 2x2 rotation tables of one layer, by the head dimension they rotate (q and k share one)."""

NORM_FLOPS = {"rmsnorm": 4.0, "layernorm": 7.0}
ACT_FLOPS = {"gelu": 8.0, "swiglu": 5.0, "geglu": 9.0}
GATES = {"swiglu": ("silu", 4.0), "geglu": ("gelu", ACT_FLOPS["gelu"])}
"""A gated MLP's nonlinearity on its gate: its eager kernel and FLOPs per element (the product with up is the rest
of ACT_FLOPS)."""
ROPE_FLOPS = 3.0
TOKEN_BYTES = 8


@dataclass
class DenseModule:
    """The tracer, the parameters it has created, and the layouts of the residual stream."""

    point: DesignPoint
    tracer: Tracer = field(init=False)
    params: list[STensor] = field(default_factory=list)
    leaf_ids: set[int] = field(default_factory=set)
    caches: list[STensor] = field(default_factory=list)
    """KV caches and SSM states a layer reads (inference)."""
    strategy: str = "tp"
    """How the layer being traced uses the tp ranks: tensor parallel, or ('dp') as more data-parallel ranks."""

    def __post_init__(self) -> None:
        m, p, w = self.point.model, self.point.parallel, self.point.workload
        b = w.micro_batch * p.dp
        s = 1 if w.mode == "decode" else w.seq_len
        sizes: dict[str, float] = {
            "b": b,
            "s": s,
            "t": w.seq_len,
            "h": m.hidden,
            "n": m.heads,
            "g": max(m.n_kv_heads, p.tp),
            "d": m.d_head,
            "f": m.ffn,
            "v": m.vocab,
            "p": m.max_seq or 1,
            "pair": 2,
        }
        if m.moe:
            copies = b * s * m.moe.top_k
            active = active_expert_count(self.point, copies)
            sizes |= {
                "e": m.moe.experts,
                "a": active,
                "c": copies * w.routing.imbalance / active,
                "r": m.moe.expert_ffn,
                "rs": max(1, m.moe.shared_experts) * m.moe.expert_ffn,
            }
        if m.mla:
            a = m.mla
            sizes |= {
                "ql": a.q_lora_rank or 1,
                "kl": a.kv_lora_rank,
                "qk": a.qk_nope_head_dim + a.qk_rope_head_dim,
                "dn": a.qk_nope_head_dim,
                "dr": a.qk_rope_head_dim,
                "dv": a.v_head_dim,
                "kr": a.kv_lora_rank + a.qk_rope_head_dim,
                "u": p.tp,
            }
        if m.ssm:
            sizes |= {
                "i": ssm_inner(m),
                "N": m.ssm.state,
                "w": m.ssm.conv,
                "dt": dt_rank(m),
                "x": dt_rank(m) + 2 * m.ssm.state,
            }
        degrees = {"tp": p.tp, "cp": p.cp, "ep": p.ep, "dp": p.dp // p.ep}
        self.tracer = Tracer(sizes, degrees)  # type: ignore[arg-type]

    @property
    def experts_dim(self) -> str:
        """The expert dimension of the experts' GEMMs: those receiving tokens (inference) or all (training)."""
        return "e" if self.mode == "train" else "a"

    @property
    def itemsize(self) -> int:
        return self.point.model.dtype_bytes

    @property
    def mode(self) -> str:
        return self.point.workload.mode

    @property
    def eager(self) -> bool:
        return self.point.workload.kernels == "eager"

    def batch_layout(self) -> dict[str, Dist]:
        return {"dp": Partition("b"), "ep": Partition("b"), "cp": Partition("s")}

    def residual_layout(self, strategy: str | None = None) -> dict[str, Dist]:
        """The residual stream: batch split over the data axes, sequence over cp, and over tp under Megatron SP;
        a layer using the tp ranks for data parallelism splits the batch over them too."""
        if (strategy or self.strategy) == "dp":
            return self.batch_layout() | {"tp": Partition("b")}
        return self.batch_layout() | {"tp": Partition("s") if self.point.parallel.sp else DUP}

    def layout(self, **dists: Dist) -> tuple:
        """A layout over the axes this point splits (degree > 1)."""
        return make_layout(**{a: d for a, d in dists.items() if a in self.tracer.degrees})

    def activation(self, name: str, dims: tuple[str, ...], strategy: str | None = None) -> STensor:
        return STensor(name, dims, self.layout(**self.residual_layout(strategy)), self.itemsize)

    def param(self, name: str, dims: tuple[str, ...], tp: Dist = DUP, ep: Dist = DUP) -> STensor:
        """A weight: split over tp (and experts over ep); under ZeRO-3 also sharded over the data axes and cp,
        whose ranks hold the same weights (`optimizer.SHARD_AXES`)."""
        p = self.point.parallel
        zero3 = p.zero == 3 and self.mode == "train"
        shard = Partition(dims[0]) if zero3 else DUP
        tp = tp if self.strategy == "tp" else DUP
        layout = self.layout(tp=tp, cp=shard, dp=shard, ep=ep if ep != DUP else shard)
        t = STensor(name, dims, layout, self.itemsize, param=True)
        self.params.append(t)
        self.leaf_ids.add(id(t))
        return t

    def use(self, w: STensor) -> STensor:
        """A parameter in its compute layout: ZeRO-3 gathers it over the data axes and cp first, in one
        all-gather over their joint group (`Tracer.redistribute`)."""
        target = {"tp": w.dist("tp")}
        if isinstance(w.dist("ep"), Partition) and w.dist("ep").dim == "e":  # type: ignore[union-attr]
            target["ep"] = w.dist("ep")
        return self.tracer.redistribute(w, target)

    def linear(
        self, name: str, x: STensor, w: STensor, out_dims: tuple[str, ...], bias: STensor | None = None
    ) -> STensor:
        y = self.tracer.einsum(name, x, self.use(w), out_dims)
        if bias is not None:
            # fused kernels add a column-parallel bias in the GEMM's epilogue (or, for Megatron's fc1, in its fused
            # bias-GeLU); eager PyTorch in a kernel of its own
            y = self.tracer.pointwise(f"{name}.bias", (y, self.use(bias)), 1.0, linear=True, fused=not self.eager)
        return y

    def norm(self, name: str, x: STensor) -> STensor:
        m = self.point.model
        dim = x.dims[-1]
        weights = [self.param(f"{name}.weight", (dim,))]
        if m.norm == "layernorm" and m.norm_bias:
            weights.append(self.param(f"{name}.bias", (dim,)))
        if m.norm == "rmsnorm" and self.eager:
            return self._eager_rmsnorm(name, x, self.use(weights[0]))
        # nn.LayerNorm is one kernel forward and one backward, eager or not
        return self.tracer.norm(name, x, [self.use(w) for w in weights], NORM_FLOPS[m.norm])

    def _eager_rmsnorm(self, name: str, x: STensor, weight: STensor) -> STensor:
        """Llama's RMSNorm as PyTorch eager runs it (Meta's and torchtitan's `_norm(x.float()).type_as(x) *
        weight`, `_norm(x) = x * rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)`): one kernel per op, fp32 between
        the casts. Autograd keeps the fp32 copy of x (pow and the product read it), the reciprocal root and the
        bf16 normalised x (the weight's gradient reads it); pow's gradient is grad * (2 * x.pow(1)), rsqrt's
        -0.5 * grad * result.pow(3)."""
        tr = self.tracer
        xf = tr.pointwise(f"{name}.float", (x,), 0.0, "norm", itemsize=FP32, partials=(SCALED,))
        squares = tr.pointwise(f"{name}.pow", (xf,), 1.0, "norm", partials=(Partial((0,), prep=2),))
        mean = tr.mean(f"{name}.mean", squares, "norm")
        mean = tr.pointwise(f"{name}.add_eps", (mean,), 1.0, "norm", linear=True)
        root = tr.pointwise(f"{name}.rsqrt", (mean,), 1.0, "norm", partials=(Partial((OUTPUT,), prep=2),))
        normed = tr.pointwise(f"{name}.mul", (xf, root), 1.0, "norm", partials=PRODUCT)
        normed = tr.pointwise(f"{name}.type_as", (normed,), 0.0, "norm", itemsize=x.itemsize, partials=(SCALED,))
        return tr.pointwise(f"{name}.weight_mul", (normed, weight), 1.0, "norm", partials=PRODUCT)

    def rope(self, name: str, t: STensor, tables: RotationTables) -> STensor:
        """Rotary embedding: one kernel, or eagerly as the model code runs it (`model.rope_impl`). Fused
        (TransformerEngine's and Apex's fused_apply_rotary_pos_emb, what torch.compile makes of the complex product):
        its backward rotates the incoming gradient back, one kernel that reads the constant table and not x, so it
        keeps nothing (TE's FusedRoPEFunc saves the table alone). Complex (Meta's llama, torchtitan's
        apply_rotary_emb): x.float() viewed as complex, times the complex rotation table, viewed as real,
        type_as(x); each step's gradient is one kernel reading only the incoming gradient (the table is a
        constant), so autograd keeps nothing."""
        tr = self.tracer
        if not self.eager:
            return tr.pointwise(name, (t,), ROPE_FLOPS, partials=(SCALED,))
        tf = tr.pointwise(f"{name}.float", (t,), 0.0, itemsize=FP32, partials=(SCALED,))
        if self.point.model.rope_impl == "real":
            rotated = self._real_rotation(name, tf, tables)
        else:
            rotated = tr.pointwise(f"{name}.complex_mul", (tf,), ROPE_FLOPS, partials=(SCALED,))
        return tr.pointwise(f"{name}.type_as", (rotated,), 0.0, itemsize=t.itemsize, partials=(SCALED,))

    def _real_rotation(self, name: str, tf: STensor, tables: RotationTables) -> STensor:
        """IBM fms's RoPE (fms/modules/positions.py RotaryEmbedding.adjusted_qk): the cached [positions, d/2, 2,
        2] fp32 table of cos/sin rotations indexed by the position ids (one gather per layer, shared by q and
        k), `freqs.mul(x_.unsqueeze(-2)).sum(5)` with x_ the fp32 x viewed as [.., d/2, 1, 2]: the product
        broadcasts x over the rotation's two output rows, so it writes twice x's elements, and the sum over
        the two inputs of each row reads them back. Autograd: the sum's gradient is an expand (a view); the
        product's is the incoming gradient times the table at the product's shape, summed back to x's
        (sum_to_size), so the table is kept for backward; the table itself is a constant."""
        tr = self.tracer
        head_dim = tf.dims[-1]
        table = tables.get(head_dim)
        if table is None:
            rows = ("b", "s", head_dim, "pair")
            layout = make_layout(**{a: d for a, d in tf.layout if isinstance(d, Partition) and d.dim in rows})
            positions = STensor("rope.positions", ("b", "s"), layout, TOKEN_BYTES)
            cached = STensor("rope.cached_freqs", ("p", head_dim, "pair"), (), FP32)
            table = tables[head_dim] = tr.embedding("rope.freqs", positions, cached, rows)
        product = tr.pointwise(
            f"{name}.rotation_mul", (tf, table), 1.0, dims=(*tf.dims, "pair"), partials=(Partial((1,)), None)
        )
        return tr.sum_last(f"{name}.rotation_sum", product)

    def repeat_kv(self, name: str, t: STensor) -> STensor:
        """Eager GQA (torchtitan's repeat_kv, fms's expand-and-flatten before SDPA): keys or values copied to every
        query head, and in backward summed back over the copies; fused attention reads the kv heads as they are."""
        m = self.point.model
        if not self.eager or m.n_kv_heads == m.heads:
            return t
        dims = tuple("n" if d == "g" else d for d in t.dims)
        return self.tracer.relabel(name, t, dims, {"g": "n"})

    def add(self, name: str, x: STensor, y: STensor) -> STensor:
        return self.tracer.pointwise(name, (x, y), 1.0, linear=True)

    def residual(self, name: str, x: STensor, y: STensor, biases: tuple[tuple[STensor, str], ...] = ()) -> STensor:
        """x + dropout(y + biases), each (weight, name) that of a row-parallel linear that made y (a parallel
        block's y is the sum of two, whose biases are added after it): y is reduced to the residual
        layout first, so the bias, the dropout mask and the add are sequence-sharded under SP (Korthikanti et
        al.'s sbh/t). Fused kernels run the three as one kernel, Megatron's bias_dropout_add (jit-fused,
        --bias-dropout-fusion on by default) and what torch.compile makes of it: it reads y and x and writes the
        sum and the mask. Eager PyTorch runs each as a kernel of its own."""
        tr, fused = self.tracer, not self.eager
        dropout = self.point.model.dropout and self.mode == "train"
        if dropout or biases:
            y = tr.redistribute(y, {a: x.dist(a) for a in tr.degrees})
        for bias, bias_name in biases:
            y = tr.pointwise(bias_name, (y, self.use(bias)), 1.0, linear=True, fused=fused)
        if dropout:
            y = tr.dropout(f"{name}.dropout", y, fused_reads=(x,) if fused else ())
        return tr.pointwise(name, (x, y), 1.0, linear=True, fused=fused and dropout)

    # -- layers ------------------------------------------------------------------------------------------------
    def layer(self, x: STensor, kind: LayerKind = ("attn", "dense"), strategy: str = "tp") -> STensor:
        """One layer; x comes in the previous layer's residual layout, and the matcher brings it to this layer's
        strategy (a local slice into a data-parallel layer, an all-gather out of one)."""
        self.strategy = strategy
        try:
            return self._layer(self.tracer.redistribute(x, self.residual_layout()), kind)
        finally:
            self.strategy = "tp"

    def _layer(self, x: STensor, kind: LayerKind) -> STensor:
        m = self.point.model
        mixer, mlp = kind
        if m.parallel_block != "none":
            return self._parallel_layer(x, mixer)
        a = self._mixer(self.norm("ln1", x), mixer)
        x = self.residual("residual1", x, a, self._output_bias("bo", "wo.bias", mixer == "attn"))
        if mlp == "none":
            return x
        h2 = self.norm("ln2", x)
        down = self.dense_mlp(h2) if mlp == "dense" else moe(self, h2)
        return self.residual("residual2", x, down, self._output_bias("b2", "w2.bias", mlp == "dense"))

    def _parallel_layer(self, x: STensor, mixer: str) -> STensor:
        """x + attention(ln1(x)) + mlp(ln2(x)), ln2 being ln1 under `parallel_block: shared_norm` (GPT-J, Falcon,
        PaLM, GPT-NeoX's use_parallel_residual). The two row-parallel outputs are partial sums over tp, added
        before their one reduction (an all-reduce, under SP a reduce-scatter), as GPT-NeoX's Megatron-style TP
        (gpt_j_residual: attention and MLP built with parallel_output, then one reduce_from_model_parallel_region)
        and PaLM run it; both biases, and the dropout, follow the sum. The norm output both branches read is
        gathered once under SP, and its gradient is the sum of the branches', reduced once (twice with two
        norms)."""
        h1 = self.norm("ln1", x)
        a = self._mixer(h1, mixer)
        down = self.dense_mlp(h1 if self.point.model.parallel_block == "shared_norm" else self.norm("ln2", x))
        biases = self._output_bias("bo", "wo.bias", mixer == "attn") + self._output_bias("b2", "w2.bias", True)
        return self.residual("residual", x, self.add("branch_sum", a, down), biases)

    def _mixer(self, h1: STensor, mixer: str) -> STensor:
        if mixer == "attn":
            return self.attention(h1)
        if mixer == "mla":
            return self.latent_attention(h1)
        return self.selective_scan(h1)

    def _output_bias(self, name: str, bias_name: str, has: bool) -> tuple[tuple[STensor, str], ...]:
        """The bias of a branch's row-parallel output linear (model.bias), added once its output is reduced."""
        return ((self.param(name, ("h",)), bias_name),) if has and self.point.model.bias else ()

    def _kv(self, name: str, new: STensor) -> STensor:
        """Training and prefill attend to the new keys/values (prefill writes them to the cache); decode reads the
        cache of t tokens and writes the new one."""
        tr = self.tracer
        if self.mode == "train":
            return new
        cache_dims = (new.dims[0], "t", *new.dims[2:])
        cache = STensor(f"{name}_cache", cache_dims, new.layout, new.itemsize)
        self.caches.append(cache)
        tr.pointwise(f"{name}_cache.write", (new,), 0.0, category="other")
        return new if self.mode == "prefill" else cache

    def attention(self, h1: STensor) -> STensor:
        m = self.point.model
        col, heads_split = Partition("n"), Partition("g")
        bias = m.bias or m.qkv_bias
        q = self.linear(
            "wq",
            h1,
            self.param("wq", ("h", "n", "d"), col),
            ("b", "s", "n", "d"),
            self.param("bq", ("n", "d"), col) if bias else None,
        )
        k = self.linear(
            "wk",
            h1,
            self.param("wk", ("h", "g", "d"), heads_split),
            ("b", "s", "g", "d"),
            self.param("bk", ("g", "d"), heads_split) if bias else None,
        )
        v = self.linear(
            "wv",
            h1,
            self.param("wv", ("h", "g", "d"), heads_split),
            ("b", "s", "g", "d"),
            self.param("bv", ("g", "d"), heads_split) if bias else None,
        )
        if m.qk_norm:
            q, k = self.norm("q_norm", q), self.norm("k_norm", k)
        if m.position == "rope":
            tables: RotationTables = {}
            q = self.rope("rope_q", q, tables)
            k = self.rope("rope_k", k, tables)
        k, v = self._kv("k", k), self._kv("v", v)
        o = self._core_attention(q, self.repeat_kv("repeat_k", k), self.repeat_kv("repeat_v", v))
        return self.linear("wo", o, self.param("wo", ("n", "d", "h"), col), ("b", "s", "h"))

    def _core_attention(self, q: STensor, k: STensor, v: STensor) -> STensor:
        m = self.point.model
        dropout = m.dropout and self.mode == "train"
        ring = "cp" if self.point.parallel.cp_algorithm == "ring" else None
        return attend(self.tracer, "attention", q, k, v, fused=m.flash_attention, dropout=dropout, ring=ring)

    def latent_attention(self, h1: STensor) -> STensor:
        """DeepSeek MLA: queries through an optional low-rank bottleneck, keys and values up-projected per head
        from a shared kv latent, a decoupled RoPE key shared by all heads. Inference caches the latent and the
        RoPE key (kl + dr per token), not the per-head keys and values; decode attends over that cache in the
        absorbed form."""
        m, tr = self.point.model, self.tracer
        assert m.mla is not None
        col = Partition("n")
        if m.mla.q_lora_rank:
            cq = self.linear("wq_a", h1, self.param("wq_a", ("h", "ql")), ("b", "s", "ql"))
            cq = self.norm("q_norm", cq)
            q = self.linear("wq_b", cq, self.param("wq_b", ("ql", "n", "qk"), col), ("b", "s", "n", "qk"))
        else:
            q = self.linear("wq", h1, self.param("wq", ("h", "n", "qk"), col), ("b", "s", "n", "qk"))
        ckv = self.linear("wkv_a", h1, self.param("wkv_a", ("h", "kl")), ("b", "s", "kl"))
        k_rope = self.linear("wk_rope", h1, self.param("wk_rope", ("h", "dr")), ("b", "s", "dr"))
        ckv = self.norm("kv_norm", ckv)
        tables: RotationTables = {}
        q = self.rope("rope_q", q, tables)
        k_rope = self.rope("rope_k", k_rope, tables)
        w_uk = self.param("wk_b", ("kl", "n", "dn"), col)
        w_uv = self.param("wv_b", ("kl", "n", "dv"), col)
        w_o = self.param("wo", ("n", "dv", "h"), col)
        cache = self._latent_cache(ckv, k_rope)
        if self.mode == "decode":
            return self._absorbed_attention(q, cache, w_uk, w_uv, w_o)
        k = self.linear("wk_b", ckv, w_uk, ("b", "s", "n", "dn"))
        v = self.linear("wv_b", ckv, w_uv, ("b", "s", "n", "dv"))
        k = tr.pointwise("k_concat", (k, k_rope), 0.0, linear=True)
        o = self._core_attention(q, k, v)
        return self.linear("wo", o, w_o, ("b", "s", "h"))

    def _latent_cache(self, ckv: STensor, k_rope: STensor) -> STensor | None:
        """Inference writes the token's latent and RoPE key into one cache row of kl + dr (DeepSeek-V2 sec. 2.1.3:
        (d_c + d_h^R) elements per token per layer); every TP rank holds the whole cache (the latent is shared
        by all heads)."""
        if self.mode == "train":
            return None
        layout = dict(ckv.layout) | {"tp": Partition("u")}
        cache = STensor("kv_latent_cache", ("b", "t", "u", "kr"), self.layout(**layout), self.itemsize)
        self.caches.append(cache)
        self.tracer.pointwise("kv_latent_cache.write", (ckv, k_rope), 0.0, category="other")
        return cache

    def _absorbed_attention(self, q: STensor, cache: STensor, w_uk: STensor, w_uv: STensor, w_o: STensor) -> STensor:
        """Decode with W_UK absorbed into the query and W_UV into the output (DeepSeek-V2 appendix B): each head's
        query is taken to latent space, scores are the latent query against the cached latent plus the RoPE
        query against the cached RoPE key, the values are the cached latents themselves (read once with the
        keys), and the per-head latent output goes through W_UV before the output projection."""
        tr = self.tracer
        q_nope, q_rope = self._split(q, {"dn": "qk", "dr": "qk"})
        q_latent = tr.einsum("q_absorb", q_nope, self.use(w_uk), ("b", "s", "n", "kl"))
        q_abs = tr.relabel("q_concat", q_latent, ("b", "s", "n", "kr"), {}, side=(q_rope,))
        m = self.point.model
        o_latent = attend(tr, "attention", q_abs, cache, cache, causal=True, fused=m.flash_attention, value_dim="kl")
        o = tr.einsum("o_absorb", o_latent, self.use(w_uv), ("b", "s", "n", "dv"))
        return self.linear("wo", o, w_o, ("b", "s", "h"))

    def _split(self, t: STensor, parts: dict[str, str]) -> list[STensor]:
        """Views of t's channel groups (dims replacing `parts[dim]`): a slice, no copy, ready when t is."""
        views = []
        for dim, whole in parts.items():
            dims = tuple(dim if d == whole else d for d in t.dims)
            view = STensor(f"{t.name}.{dim}", dims, t.layout, t.itemsize)
            self.tracer.emitter.same_origin(view, t)
            views.append(view)
        return views

    def selective_scan(self, h1: STensor) -> STensor:
        """Mamba (S6) block: in-projection to x and z, depthwise causal conv, input-dependent dt, B, C, the
        selective scan (9 FLOPs per channel and state element), gating, out-projection. TP splits the inner
        channels; x_proj is row-parallel, so its small dt/B/C output is all-reduced."""
        tr = self.tracer
        col = Partition("i")
        xi = self.linear("in_proj_x", h1, self.param("in_proj_x", ("h", "i"), col), ("b", "s", "i"))
        z = self.linear("in_proj_z", h1, self.param("in_proj_z", ("h", "i"), col), ("b", "s", "i"))
        conv_w = self.use(self.param("conv.weight", ("i", "w"), col))
        conv_b = self.use(self.param("conv.bias", ("i",), col))
        conv_flops = 2.0 * self.point.model.ssm.conv  # type: ignore[union-attr]
        xc = tr.pointwise("conv", (xi, conv_w, conv_b), conv_flops)
        xc = tr.pointwise("silu", (xc,), 4.0)
        dbc = self.linear("x_proj", xc, self.param("x_proj", ("i", "x"), col), ("b", "s", "x"))
        dbc = tr.redistribute(dbc, {a: xc.dist(a) for a in tr.degrees if xc.dist(a) != col})
        dt_in = tr.relabel("dt_slice", dbc, ("b", "s", "dt"), {})
        dt = self.linear("dt_proj", dt_in, self.param("dt_proj", ("dt", "i"), col), ("b", "s", "i"))
        dt = tr.pointwise("dt_bias_softplus", (dt, self.use(self.param("dt_proj.bias", ("i",), col))), 4.0)
        a_log = self.use(self.param("A_log", ("i", "N"), col))
        d_skip = self.use(self.param("D", ("i",), col))
        inputs = [xc, dt, dbc, a_log, d_skip]
        if self.mode == "decode":
            state = STensor("ssm_state", ("b", "i", "N"), xc.layout, 4)
            self.caches.append(state)
            inputs.append(state)
        n = self.point.model.ssm.state  # type: ignore[union-attr]
        y = tr.pointwise("selective_scan", inputs, 9.0 * n, category="other")
        y = tr.pointwise("gate", (y, z), 5.0)
        return self.linear("out_proj", y, self.param("out_proj", ("i", "h"), col), ("b", "s", "h"))

    def dense_mlp(self, h2: STensor, width: str = "f", prefix: str = "") -> STensor:
        m = self.point.model
        mlp_in = Partition(width)
        dims = ("b", "s", width)
        bias = m.bias and not prefix

        def column(name: str) -> STensor:
            weight = self.param(f"{prefix}{name}", ("h", width), mlp_in)
            bias_name = f"b{name[1:]}"
            return self.linear(
                f"{prefix}{name}", h2, weight, dims, self.param(bias_name, (width,), mlp_in) if bias else None
            )

        act = self.activated(prefix, column)
        return self.linear(f"{prefix}w2", act, self.param(f"{prefix}w2", (width, "h"), mlp_in), ("b", "s", "h"))

    def activated(self, prefix: str, project: Callable[[str], STensor]) -> STensor:
        """The MLP's nonlinearity on its input projections `project("w1")` (and `project("w3")`, the up projection
        of a gated MLP, traced after the gate's): one place for the dense MLP, the shared and the routed experts."""
        kind = self.point.model.activation
        if gated(self.point.model):
            return self.gated(f"{prefix}{kind}", project("w1"), project("w3"))
        return self.tracer.pointwise(f"{prefix}gelu", (project("w1"),), ACT_FLOPS["gelu"])

    def gated(self, name: str, gate: STensor, up: STensor) -> STensor:
        """act(gate) * up, act SiLU (SwiGLU) or GeLU (GeGLU): one kernel, or eagerly (F.silu(w1(x)) * w3(x)) two,
        whose autograd keeps the gate (the activation's one-kernel backward reads it), its activation and up."""
        tr, kind = self.tracer, self.point.model.activation
        if not self.eager:
            return tr.pointwise(name, (gate, up), ACT_FLOPS[kind])
        kernel, flops = GATES[kind]
        act = tr.pointwise(f"{name}.{kernel}", (gate,), flops, partials=(Partial((0,)),))
        return tr.pointwise(f"{name}.mul", (act, up), ACT_FLOPS[kind] - flops, partials=PRODUCT)

    # -- embedding and head --------------------------------------------------------------------------------------
    def tokens(self) -> STensor:
        return STensor("tokens", ("b", "s"), self.layout(**self.batch_layout()), TOKEN_BYTES)

    def embed(self, tokens: STensor) -> tuple[STensor, STensor]:
        """Token (and learned position) embedding; returns the residual stream and the token table."""
        m, tr = self.point.model, self.tracer
        table = self.param("wte", ("v", "h"), Partition("v"))
        x = tr.embedding("embed", tokens, self.use(table), ("b", "s", "h"))
        if x.dist("tp") == PARTIAL:  # Megatron's VocabParallelEmbedding zeroes the rows of tokens off its shard
            x = tr.pointwise("embed.mask", (x,), 1.0, linear=True)
        x = tr.redistribute(x, self.residual_layout())
        if m.position == "learned":
            pos = tr.embedding("embed_pos", tokens, self.use(self.param("wpe", ("p", "h"))), ("b", "s", "h"))
            x = self.add("embed_sum", x, pos)
        return x, table

    def head(self, x: STensor, table: STensor | None) -> STensor:
        """Final norm, LM head (the token table when tied) and the cross-entropy loss (training) or the logits
        (inference)."""
        hf = self.norm("ln_f", x)
        weight = table if table is not None else self.param("lm_head", ("v", "h"), Partition("v"))
        logits = self.tracer.einsum("lm_head", hf, self.use(weight), ("b", "s", "v"))
        if self.mode != "train":
            return logits
        return self.tracer.loss("loss", logits)
