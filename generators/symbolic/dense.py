"""Dense decoder modules (GPT: MHA, GeLU MLP, LayerNorm, biases; LLaMA: GQA, SwiGLU, RMSNorm, RoPE) written
once over named dimensions and traced for any degrees and sizes.

Dimensions: b micro-batch (over all DP ranks), s sequence, h hidden, n heads, g kv heads, d head dim, f MLP width,
v vocabulary,
p position-table rows. Parallel axes of the tensors: tp (Megatron: column-parallel QKV and MLP-in, row-parallel
attention-out and MLP-out, vocabulary-parallel embedding and head) and dp (batch split, weights duplicated or,
under ZeRO-3, sharded and all-gathered before use).
"""

from dataclasses import dataclass, field

from dse.spec import DesignPoint
from generators.symbolic.dist import DUP, Dist, Partition
from generators.symbolic.graph import STensor, Tracer, make_layout

NORM_FLOPS = {"rmsnorm": 4.0, "layernorm": 7.0}
ACT_FLOPS = {"gelu": 8.0, "swiglu": 5.0}
ROPE_FLOPS = 3.0
TOKEN_BYTES = 8


@dataclass
class DenseModule:
    """The tracer, the parameters it has created, and the layouts of the residual stream."""

    point: DesignPoint
    tracer: Tracer = field(init=False)
    params: list[STensor] = field(default_factory=list)
    leaf_ids: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        m, p, w = self.point.model, self.point.parallel, self.point.workload
        sizes = {
            "b": w.micro_batch * p.dp,
            "s": w.seq_len,
            "h": m.hidden,
            "n": m.heads,
            "g": max(m.n_kv_heads, p.tp),
            "d": m.d_head,
            "f": m.ffn,
            "v": m.vocab,
            "p": m.max_seq or 1,
        }
        self.tracer = Tracer(sizes, {"tp": p.tp, "dp": p.dp})

    @property
    def itemsize(self) -> int:
        return self.point.model.dtype_bytes

    def residual_layout(self) -> dict[str, Dist]:
        """The residual stream: batch split over dp; sequence split over tp under Megatron SP."""
        return {"dp": Partition("b"), "tp": Partition("s") if self.point.parallel.sp else DUP}

    def activation(self, name: str, dims: tuple[str, ...]) -> STensor:
        return STensor(name, dims, make_layout(**self.residual_layout()), self.itemsize)

    def param(self, name: str, dims: tuple[str, ...], tp: Dist = DUP) -> STensor:
        dp = Partition(dims[0]) if self.point.parallel.zero == 3 else DUP
        t = STensor(name, dims, make_layout(tp=tp, dp=dp), self.itemsize, param=True)
        self.params.append(t)
        self.leaf_ids.add(id(t))
        return t

    def use(self, w: STensor) -> STensor:
        """A parameter in its compute layout: ZeRO-3 gathers it over dp first."""
        return self.tracer.redistribute(w, {"tp": w.dist("tp")})

    def linear(
        self, name: str, x: STensor, w: STensor, out_dims: tuple[str, ...], bias: STensor | None = None
    ) -> STensor:
        y = self.tracer.einsum(name, x, self.use(w), out_dims)
        if bias is not None:
            y = self.tracer.pointwise(f"{name}.bias", (y, self.use(bias)), 1.0, linear=True)
        return y

    def norm(self, name: str, x: STensor) -> STensor:
        m = self.point.model
        weights = [self.param(f"{name}.weight", ("h",))]
        if m.norm == "layernorm":
            weights.append(self.param(f"{name}.bias", ("h",)))
        return self.tracer.norm(name, x, [self.use(w) for w in weights], NORM_FLOPS[m.norm])

    def add(self, name: str, x: STensor, y: STensor) -> STensor:
        return self.tracer.pointwise(name, (x, y), 1.0, linear=True)

    def layer(self, x: STensor) -> STensor:
        m, tr = self.point.model, self.tracer
        col, heads_split = Partition("n"), Partition("g")
        bias = m.bias
        h1 = self.norm("ln1", x)
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
        if m.position == "rope":
            q = tr.pointwise("rope_q", (q,), ROPE_FLOPS)
            k = tr.pointwise("rope_k", (k,), ROPE_FLOPS)
        o = tr.attention("attention", q, k, v)
        a = self.linear("wo", o, self.param("wo", ("n", "d", "h"), col), ("b", "s", "h"))
        x = self.add("residual1", x, a)
        if bias:
            x = tr.pointwise("wo.bias", (x, self.use(self.param("bo", ("h",)))), 1.0, linear=True)
        h2 = self.norm("ln2", x)
        mlp_in = Partition("f")
        if m.activation == "swiglu":
            gate = self.linear("w1", h2, self.param("w1", ("h", "f"), mlp_in), ("b", "s", "f"))
            up = self.linear("w3", h2, self.param("w3", ("h", "f"), mlp_in), ("b", "s", "f"))
            act = tr.pointwise("swiglu", (gate, up), ACT_FLOPS["swiglu"])
        else:
            fc = self.linear(
                "w1",
                h2,
                self.param("w1", ("h", "f"), mlp_in),
                ("b", "s", "f"),
                self.param("b1", ("f",), mlp_in) if bias else None,
            )
            act = tr.pointwise("gelu", (fc,), ACT_FLOPS["gelu"])
        down = self.linear("w2", act, self.param("w2", ("f", "h"), mlp_in), ("b", "s", "h"))
        y = self.add("residual2", x, down)
        if bias:
            y = tr.pointwise("w2.bias", (y, self.use(self.param("b2", ("h",)))), 1.0, linear=True)
        return y

    def tokens(self) -> STensor:
        return STensor("tokens", ("b", "s"), make_layout(dp=Partition("b")), TOKEN_BYTES)

    def embed(self, tokens: STensor) -> tuple[STensor, STensor]:
        """Token (and learned position) embedding; returns the residual stream and the token table."""
        m, tr = self.point.model, self.tracer
        table = self.param("wte", ("v", "h"), Partition("v"))
        x = tr.embedding("embed", tokens, self.use(table), ("b", "s", "h"))
        x = tr.redistribute(x, self.residual_layout())
        if m.position == "learned":
            pos = tr.embedding("embed_pos", tokens, self.use(self.param("wpe", ("p", "h"))), ("b", "s", "h"))
            x = self.add("embed_sum", x, pos)
        return x, table

    def head(self, x: STensor, table: STensor | None) -> STensor:
        """Final norm, LM head (the token table when tied) and the cross-entropy loss."""
        hf = self.norm("ln_f", x)
        weight = table if table is not None else self.param("lm_head", ("v", "h"), Partition("v"))
        logits = self.tracer.einsum("lm_head", hf, self.use(weight), ("b", "s", "v"))
        return self.tracer.loss("loss", logits)
