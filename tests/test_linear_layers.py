"""`GatedDeltaNet` and `KimiDeltaAttention` against transformers' modules (Qwen3-Next's and
Qwen3.5's `GatedDeltaNet`, Kimi Linear's `KimiLinearDeltaAttention`), float32, with the
torch weights copied into ours by the mappings below; packed documents against each
document run alone; finite gradients; a `LayerStack` of them; the rules table's split of
their weights; bad input.

transformers runs its torch fallbacks here (no flash-linear-attention): the chunked rule
(chunks of 64) and `F.conv1d`. Ours runs its own chunked rule with chunks of 16, so a
sequence of 37 ends in a partial chunk on both sides.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import make_mesh, need_devices, rel_err, segment_ids_from_lengths
from hf_helpers import hf_modules
from jax.sharding import PartitionSpec as P

import eqx_longctx as el
from eqx_longctx.nn import DecoderBlock, GatedDeltaNet, KimiDeltaAttention, LayerStack, SwiGLU

TOL = 1e-5  # float32, relative (max abs error / max abs reference)
DIM, SEQ, CHUNK = 32, 37, 16

# name: (value heads, key heads, key head dim, value head dim)
GDN_SHAPES = {"gva": (4, 2, 8, 6), "equal_heads": (2, 2, 8, 8)}


def _np(t):
    return t.detach().numpy().astype(np.float32)


def _randomize(torch, module, seed):
    """Random weights of unit-scale outputs; decays and norms away from their defaults
    (a norm at 1 or a zero bias would hide one mapped into the wrong place)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "A_log" in name:
                p.copy_(torch.log(torch.rand(p.shape, generator=gen) * 4 + 0.5))
            elif "dt_bias" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            elif "conv1d" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            else:  # a Linear [out, in]
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
    return module.eval()


def _heads(w, h):
    """A torch Linear weight `[h * d, embed]` as `[embed, h, d]`."""
    return w.T.reshape(w.shape[1], h, -1)


def gdn_from_torch(module, kind: str) -> GatedDeltaNet:
    """Our layer with the weights of transformers' Qwen3-Next (`kind="qwen3_next"`) or
    Qwen3.5 (`"qwen3_5"`) `GatedDeltaNet`."""
    hv, hk = module.num_v_heads, module.num_k_heads
    dk, dv = module.head_k_dim, module.head_v_dim
    sd = {n: _np(p) for n, p in module.named_parameters()}
    embed = sd["out_proj.weight"].shape[0]
    if kind == "qwen3_next":  # per key head: [q, k, v (r heads), z (r heads)]; then [b, a]
        r = hv // hk
        qkvz = sd["in_proj_qkvz.weight"].T.reshape(embed, hk, -1)
        q, k, v, z = np.split(qkvz, np.cumsum([dk, dk, r * dv]), axis=-1)
        v, z = v.reshape(embed, hv, dv), z.reshape(embed, hv, dv)
        b, a = np.split(sd["in_proj_ba.weight"].T.reshape(embed, hk, 2 * r), 2, axis=-1)
        b, a = b.reshape(embed, hv), a.reshape(embed, hv)
    else:  # [q | k | v] over all heads, then z, b, a apart
        qkv = sd["in_proj_qkv.weight"]
        q, k, v = np.split(qkv, np.cumsum([hk * dk, hk * dk]), axis=0)
        q, k, v = _heads(q, hk), _heads(k, hk), _heads(v, hv)
        z, b, a = (
            _heads(sd["in_proj_z.weight"], hv),
            sd["in_proj_b.weight"].T,
            sd["in_proj_a.weight"].T,
        )
    conv = sd["conv1d.weight"][:, 0]
    cq, ck, cv = np.split(conv, np.cumsum([hk * dk, hk * dk]), axis=0)
    layer = GatedDeltaNet(
        embed, hv, hk, dk, dv, key=jax.random.PRNGKey(0), conv_size=conv.shape[1],
        norm_eps=module.layer_norm_epsilon, chunk=CHUNK,
    )  # fmt: skip
    new = dict(
        wq=q, wk=k, wv=v, wz=z, wb=b, wa=a, conv_q=cq.reshape(hk, dk, -1),
        conv_k=ck.reshape(hk, dk, -1), conv_v=cv.reshape(hv, dv, -1), a_log=sd["A_log"],
        dt_bias=sd["dt_bias"], norm=sd["norm.weight"],
        wo=sd["out_proj.weight"].T.reshape(hv, dv, embed),
    )  # fmt: skip
    return _replace(layer, new)


def kda_from_torch(module) -> KimiDeltaAttention:
    """Our layer with the weights of transformers' `KimiLinearDeltaAttention`."""
    h, d = module.num_heads, module.head_dim
    sd = {n: _np(p) for n, p in module.named_parameters()}
    embed = sd["o_proj.weight"].shape[0]
    rank = sd["forget_gate.f_a_proj.weight"].shape[0]
    conv = sd["conv1d.weight"][:, 0]
    layer = KimiDeltaAttention(
        embed, h, d, key=jax.random.PRNGKey(0), gate_rank=rank, conv_size=conv.shape[1],
        norm_eps=module.layer_norm_epsilon, chunk=CHUNK,
    )  # fmt: skip
    cq, ck, cv = (c.reshape(h, d, -1) for c in np.split(conv, 3, axis=0))
    new = dict(
        wq=_heads(sd["q_proj.weight"], h), wk=_heads(sd["k_proj.weight"], h),
        wv=_heads(sd["v_proj.weight"], h), conv_q=cq, conv_k=ck, conv_v=cv,
        f_a=sd["forget_gate.f_a_proj.weight"].T,
        f_b=sd["forget_gate.f_b_proj.weight"].T.reshape(rank, h, d),
        dt_bias=sd["forget_gate.dt_bias"].reshape(h, d),
        a_log=sd["forget_gate.A_log"].reshape(h), wb=sd["b_proj.weight"].T,
        g_a=sd["g_a_proj.weight"].T, g_b=sd["g_b_proj.weight"].T.reshape(rank, h, d),
        norm=sd["o_norm.weight"], wo=sd["o_proj.weight"].T.reshape(h, d, embed),
    )  # fmt: skip
    return _replace(layer, new)


def _replace(layer, new: dict):
    for name, value in new.items():
        old = getattr(layer, name)
        assert old.shape == value.shape, (name, old.shape, value.shape)
    names = list(new)
    return eqx.tree_at(
        lambda m: [getattr(m, n) for n in names], layer, [jnp.asarray(new[n]) for n in names]
    )


def build(kind: str, shape: str = "gva", seed: int = 0):
    """`(torch module, our layer)` of a tiny float32 config."""
    torch, transformers = hf_modules()
    if kind == "kimi_linear":
        from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

        config = transformers.KimiLinearConfig(
            hidden_size=DIM, num_hidden_layers=1,
            linear_attn_config={"num_heads": 2, "head_dim": 8, "short_conv_kernel_size": 4,
                                "kda_layers": [1], "full_attn_layers": []},
        )  # fmt: skip
        module = _randomize(torch, KimiLinearDeltaAttention(config, 0), seed)
        return module, kda_from_torch(module)
    hv, hk, dk, dv = GDN_SHAPES[shape]
    fields = dict(
        hidden_size=DIM, linear_num_value_heads=hv, linear_num_key_heads=hk,
        linear_key_head_dim=dk, linear_value_head_dim=dv, num_hidden_layers=1,
        layer_types=["linear_attention"],
    )  # fmt: skip
    if kind == "qwen3_next":
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

        module = Qwen3NextGatedDeltaNet(transformers.Qwen3NextConfig(**fields), 0)
    else:
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

        module = Qwen3_5GatedDeltaNet(transformers.Qwen3_5TextConfig(**fields), 0)
    module = _randomize(torch, module, seed)
    return module, gdn_from_torch(module, kind)


def inputs(batch=2, seq=SEQ, seed=1):
    return np.random.default_rng(seed).normal(size=(batch, seq, DIM)).astype(np.float32)


def positions(x):
    return jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])


CASES = [("qwen3_next", "gva"), ("qwen3_next", "equal_heads"), ("qwen3_5", "gva")]
CASES += [("kimi_linear", "-")]


@pytest.mark.parametrize(("kind", "shape"), CASES)
def test_against_transformers(kind, shape):
    torch, _ = hf_modules()
    module, layer = build(kind, shape)
    x = inputs()
    with torch.no_grad():
        expected = module(torch.from_numpy(x)).numpy()
    out = eqx.filter_jit(layer)(jnp.asarray(x), positions(x))
    err = rel_err(out, expected)
    assert out.shape == expected.shape and out.dtype == jnp.float32
    assert err <= TOL, f"{kind}-{shape}: relative error {err:.2e}"


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_gradients(kind):
    """Every weight gets a finite, nonzero gradient (packed rows, a partial last chunk)."""
    if kind == "gdn":
        layer = GatedDeltaNet(DIM, 4, 2, 8, 6, key=jax.random.PRNGKey(0), chunk=CHUNK)
    else:
        layer = KimiDeltaAttention(DIM, 2, 8, key=jax.random.PRNGKey(0), chunk=CHUNK)
    x = jnp.asarray(inputs())
    seg = jnp.asarray(segment_ids_from_lengths([[9, 1, 27], [37]]))

    def loss(layer, x):
        return jnp.sum(layer(x, positions(x), seg) ** 2)

    grads = eqx.filter_jit(eqx.filter_grad(loss))(layer, x)
    leaves = jax.tree.leaves(eqx.filter(grads, eqx.is_array))
    assert len(leaves) >= 13 and all(bool(jnp.all(jnp.isfinite(g))) for g in leaves)
    assert all(float(jnp.max(jnp.abs(g))) > 0 for g in leaves), "a weight gets no gradient"


@pytest.mark.parametrize("kind", ["qwen3_next", "kimi_linear"])
def test_packed_documents(kind):
    """A packed row equals its documents run one by one: the convolution's window and the
    recurrent state restart at each document (transformers has no document resets)."""
    _, layer = build(kind)
    lengths = [[9, 1, 20, 7], [37]]
    seg = segment_ids_from_lengths(lengths)
    x = jnp.asarray(inputs())
    out = eqx.filter_jit(layer)(x, positions(x), jnp.asarray(seg))
    expected = np.zeros(out.shape, np.float32)
    for row, docs in enumerate(lengths):
        start = 0
        for n in docs:
            piece = x[row : row + 1, start : start + n]
            expected[row, start : start + n] = np.asarray(layer(piece, positions(piece))[0])
            start += n
    assert rel_err(out, expected) <= TOL


def test_layer_stack_and_cache_protocol():
    """A scanned stack of decoder blocks runs either layer (positions passed, unused); the
    cache protocol: no per-token entries, fixed-size states heads first."""
    gdn = lambda k: GatedDeltaNet(DIM, 4, 2, 8, 6, key=k, chunk=CHUNK)  # noqa: E731
    kda = lambda k: KimiDeltaAttention(DIM, 2, 8, key=k, chunk=CHUNK)  # noqa: E731
    x = jnp.asarray(inputs(seq=20))
    for make in (gdn, kda):

        def block(k, make=make):
            k1, k2 = jax.random.split(k)
            return DecoderBlock(make(k1), SwiGLU(DIM, 48, key=k2), dim=DIM)

        stack = LayerStack(block, 2, key=jax.random.PRNGKey(0))
        out = eqx.filter_jit(stack)(x, positions(x), None)
        assert out.shape == x.shape and bool(jnp.all(jnp.isfinite(out)))
    layer = gdn(jax.random.PRNGKey(0))
    assert layer.cache_shapes() == () and layer.window is None and layer.cache_split_heads
    assert layer.cache_state_shapes() == ((4, 8, 6), (2, 8, 3), (2, 8, 3), (4, 6, 3))
    kda_layer = kda(jax.random.PRNGKey(0))
    assert kda_layer.cache_state_shapes() == ((2, 8, 8),) + ((2, 8, 3),) * 3


def test_rules_table_splits_heads():
    """Every weight's logical axes are in the rules table: heads (value and key) split over
    the tensor axis, the embedding over fsdp, kernels and ranks whole."""
    need_devices(4)
    mesh = make_mesh((2, 2), ("context", "tensor"))
    spec = el.ShardingSpec(mesh, batch_axis=None, tensor_axis="tensor", fsdp_axis="context")
    gdn = GatedDeltaNet(DIM, 4, 2, 8, 6, key=jax.random.PRNGKey(0), spec=spec)
    specs = el.param_pspecs(gdn)
    assert specs.wq == P("context", "tensor", None) and specs.wv == P("context", "tensor", None)
    assert specs.conv_q == P("tensor", None, None) and specs.a_log == P("tensor")
    assert specs.wo == P("tensor", None, "context") and specs.norm == P(None)
    kda = KimiDeltaAttention(DIM, 2, 8, key=jax.random.PRNGKey(0), spec=spec)
    specs = el.param_pspecs(kda)
    assert specs.f_a == P("context", None) and specs.f_b == P(None, "tensor", None)
    assert specs.dt_bias == P("tensor", None)


def test_bad_input():
    layer = GatedDeltaNet(DIM, 4, 2, 8, 6, key=jax.random.PRNGKey(0))
    x = jnp.asarray(inputs(seq=8))
    with pytest.raises(ValueError, match=r"\[batch, seq, embed\] with embed = 32"):
        layer(x[..., :16], positions(x))
    with pytest.raises(ValueError, match="multiple of n_key_heads"):
        GatedDeltaNet(DIM, 3, 2, 8, 6, key=jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="needs head_dim > 0"):
        KimiDeltaAttention(DIM, 2, 0, key=jax.random.PRNGKey(0))
    with pytest.raises(TypeError, match="ShardingSpec"):
        KimiDeltaAttention(DIM, 2, 8, key=jax.random.PRNGKey(0), spec="ring")  # pyright: ignore[reportArgumentType]
    need_devices(2)
    mesh = make_mesh((1, 2), ("context", "tensor"))
    spec = el.ShardingSpec(mesh, batch_axis=None, tensor_axis="tensor")
    with pytest.raises(ValueError, match="divisible by 2"):
        GatedDeltaNet(DIM, 3, 1, 8, 6, key=jax.random.PRNGKey(0), spec=spec)


def test_rule_impl_follows_the_block_impl():
    """The layers run the rule on the XLA path when their attention is told to ("xla", an
    `XlaBlockImpl`, or a spec whose `impl` is "xla"); otherwise the rule's own resolver
    picks (`None`)."""
    from eqx_longctx.attention import XlaBlockImpl
    from eqx_longctx.nn._delta_parts import rule_impl

    need_devices(2)
    xla_spec = el.ShardingSpec(make_mesh((2,), ("context",)), impl="xla")
    auto_spec = el.ShardingSpec(make_mesh((2,), ("context",)))
    assert rule_impl("xla", None) == rule_impl(XlaBlockImpl(), None) == "xla"
    assert rule_impl(None, xla_spec) == "xla"
    assert rule_impl("pallas", xla_spec) is None  # the call's impl wins over the spec's
    assert rule_impl(None, auto_spec) is None and rule_impl(None, None) is None


@pytest.mark.parametrize("kind", ["gdn", pytest.param("kda", marks=pytest.mark.slow)])
def test_zigzag_ring_matches_one_device(kind):
    """Under ring / zig-zag on (data 2, context 4), packed documents crossing devices: the
    output and the gradients (weights and input) equal one device's."""
    need_devices(8)
    spec = el.ShardingSpec(make_mesh((2, 4), ("data", "context")), "ring", "zigzag")
    key = jax.random.PRNGKey(0)
    if kind == "gdn":
        make = lambda s: GatedDeltaNet(DIM, 4, 2, 8, 6, key=key, chunk=8, spec=s)  # noqa: E731
    else:
        make = lambda s: KimiDeltaAttention(DIM, 2, 8, key=key, chunk=8, spec=s)  # noqa: E731
    x = jnp.asarray(inputs(seq=48))
    seg = jnp.asarray(segment_ids_from_lengths([[9, 1, 20, 18], [48]]))
    ct = jnp.asarray(inputs(seq=48, seed=2))
    lay = lambda a: el.to_layout(a, spec, axis=1)  # noqa: E731

    def loss(layer, x, seg, natural):
        out = layer(x, positions(x), seg)
        out = jnp.asarray(out if natural else el.from_layout(out, spec, axis=1))
        return jnp.sum(out * ct), out

    grad = eqx.filter_jit(eqx.filter_value_and_grad(loss, has_aux=True))
    (_, ref), (ref_grads) = grad(make(None), x, seg, True)
    with jax.set_mesh(spec.mesh):
        (_, out), grads = grad(make(spec), lay(x), lay(seg), False)
    assert rel_err(out, ref) <= TOL
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        assert rel_err(g, r) <= TOL
