"""The decoder's fused-epilogue projections (``model/decoder.py``: qkv with RoPE and the KV
store, gate/up with SiLU-and-multiply) give what its separate ops give: a layer's q, k, v, the
cache it fills and its MLP output, run under Triton's interpreter on the CPU with the GPU path
forced on. ``EngineConfig.fused_epilogues`` turns them off."""

import pytest
import torch

from aspire_ray.model import decoder
from aspire_ray.model.arch import ModelArch
from aspire_ray.tp import single_rank

ARCH = ModelArch(
    model_type="qwen2", num_layers=1, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
    intermediate_size=96, vocab_size=50, rms_norm_eps=1e-6, rope_theta=10000.0,
    rope_scaling=None, max_position_embeddings=128, tie_word_embeddings=True, qkv_bias=True,
    qk_norm=False, eos_token_ids=(0,),
)  # fmt: skip


@pytest.fixture
def layer():
    torch.manual_seed(0)
    layer = decoder.DecoderLayer(ARCH, 0, single_rank())
    for p in layer.parameters():
        p.data.normal_(0, 0.2)
    return layer


def _run(layer, monkeypatch, fused: bool):
    """A 5-token step of the layer: (q, k, v, the cache, the MLP's output)."""
    monkeypatch.setattr(decoder, "fused_ops", lambda x: True)  # the GPU path, interpreted
    monkeypatch.setattr(decoder, "_HALF", (torch.float32,))  # (the interpreter's bf16 dot is off)
    decoder.set_fused_epilogues(layer, fused)
    rotary = decoder.RotaryEmbedding(ARCH.head_dim, ARCH.rope_theta, 128, None)
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(5, ARCH.hidden_size, generator=gen)
    positions = torch.tensor([3, 4, 17, 18, 19])
    cache = torch.zeros(4, 2, 8, ARCH.num_kv_heads, ARCH.head_dim)
    slots = torch.tensor([3, 4, 9, -1, 31])  # a padding token: no slot
    with torch.no_grad():
        q, k, v = layer.self_attn.qkv(h, positions, rotary, None, (cache, slots))
        out = layer.mlp(h)
    return q, k, v, cache, out


def test_fused_projections_give_the_separate_ops_results(layer, monkeypatch):
    calls = []
    real = decoder.fused_epilogue
    monkeypatch.setattr(decoder, "fused_epilogue", lambda x, n: calls.append(n) or real(x, n))
    fused = _run(layer, monkeypatch, True)
    assert len(calls) == 2  # qkv and gate/up took the fused kernels
    separate = _run(layer, monkeypatch, False)
    assert len(calls) == 2  # switched off: never asked
    for got, expected in zip(fused, separate, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert separate[3].abs().sum() > 0


def test_long_steps_keep_the_separate_ops(monkeypatch):
    half = torch.bfloat16
    assert not decoder.fused_epilogue(torch.zeros(5, 8, dtype=half), 256)  # a CPU tensor: never
    monkeypatch.setattr(decoder, "fused_ops", lambda x: True)
    for n in (decoder.QKV_ROPE_MAX_TOKENS, decoder.GATE_UP_SILU_MAX_TOKENS):
        assert decoder.fused_epilogue(torch.zeros(n, 8, dtype=half), n)
        assert not decoder.fused_epilogue(torch.zeros(n + 1, 8, dtype=half), n)
        assert not decoder.fused_epilogue(torch.zeros(n, 8), n)  # float32: tf32 on a GPU


def _random_model(num_layers: int):
    """A random ``num_layers``-layer model of ARCH and a 4-token step for it: (model, ids,
    positions, the layers' caches)."""
    import dataclasses

    torch.manual_seed(0)
    model = decoder.DecoderModel(dataclasses.replace(ARCH, num_layers=num_layers), single_rank())
    for p in model.parameters():
        p.data.normal_(0, 0.2)
    ids, positions = torch.tensor([1, 7, 3, 9]), torch.tensor([0, 1, 2, 3])
    caches = [torch.zeros(4, 2, 8, ARCH.num_kv_heads, ARCH.head_dim) for _ in range(num_layers)]
    return model, ids, positions, caches


class _EchoPlan:
    """Attention stand-in: each query attends to itself (out = q), enough to run the layers."""

    def attend(self, layer, q, k, v, kv_cache, scale):
        return q


def test_fused_mlp_gives_the_separate_ops_hidden_states(monkeypatch):
    # EngineConfig.fused_mlp: each MLP one launch, its partials summed by the next layer's
    # input norm and by the final norm: a 3-layer forward's hidden states as with the MLP's
    # separate kernels (interpreted, the GPU path forced on, float32)

    from aspire_ray.kernels import mlp_partials as mp

    monkeypatch.setattr(decoder, "fused_ops", lambda x: True)
    monkeypatch.setattr(decoder, "_HALF", (torch.float32,))
    # the interpreter's pace: small tiles (the default's 64-wide tiles take minutes there)
    monkeypatch.setattr(mp, "DEFAULT_MLP_CONFIG", mp.MLPConfig(16, 16, 16, 16))
    model, ids, positions, caches = _random_model(3)
    calls = []
    real = mp.mlp_partials
    monkeypatch.setattr(mp, "mlp_partials", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        decoder.set_fused_mlp(model, True)
        fused = model(ids, positions, _EchoPlan(), caches)
        assert len(calls) == 3  # every layer's MLP took the one launch
        decoder.set_fused_mlp(model, False)
        separate = model(ids, positions, _EchoPlan(), caches)
        assert len(calls) == 3
    torch.testing.assert_close(fused, separate, atol=1e-4, rtol=1e-4)


def test_fused_mlp_stays_off_on_several_ranks():
    # a shard's down projection all-reduces its partial sum: the one-launch MLP is for tp = 1
    from aspire_ray.tp.group import TPGroup

    model = decoder.DecoderModel(ARCH, single_rank())
    decoder.set_fused_mlp(model, True)
    mlps = [m for m in model.modules() if isinstance(m, decoder.MLP)]
    assert mlps and all(m.fused_mlp for m in mlps)
    mlps[0].down_proj.tp = TPGroup(rank=0, size=2)
    decoder.set_fused_mlp(model, True)
    assert not mlps[0].fused_mlp


@pytest.mark.parametrize("names", [("o",), ("down",), ("o", "down")])
def test_triton_projections_give_cublas_hidden_states(names, monkeypatch):
    # EngineConfig.triton_projections: the named row-parallel projections through
    # kernels/linear.py (interpreted, the GPU path forced on, float32): a 2-layer forward's
    # hidden states as with F.linear, every named projection of every layer through Triton

    from aspire_ray.kernels import linear
    from aspire_ray.tp import layers as tp_layers

    monkeypatch.setattr(tp_layers, "_triton_fits", lambda x, rows: x.shape[0] <= rows)
    model, ids, positions, caches = _random_model(2)
    shapes = []
    real = linear.triton_linear
    monkeypatch.setattr(linear, "triton_linear",
                        lambda x, w, *a: shapes.append(tuple(w.shape)) or real(x, w, *a))
    with torch.no_grad():
        decoder.set_triton_projections(model, names)
        triton = model(ids, positions, _EchoPlan(), caches)
        expected = {"o": (64, 64), "down": (64, 96)}
        assert sorted(shapes) == sorted([expected[n] for n in names] * 2)
        decoder.set_triton_projections(model, ())
        cublas = model(ids, positions, _EchoPlan(), caches)
        assert len(shapes) == 2 * len(names)  # off: never asked
    torch.testing.assert_close(triton, cublas, atol=1e-4, rtol=1e-4)


def test_triton_projections_only_for_decode_sized_half_steps_on_a_gpu():
    from aspire_ray.tp.layers import _triton_fits

    half = torch.bfloat16
    assert not _triton_fits(torch.zeros(5, 8, dtype=half), 256)  # a CPU tensor: never
    if torch.cuda.is_available():
        x = torch.zeros(256, 8, dtype=half, device="cuda")
        assert _triton_fits(x, 256) and not _triton_fits(x, 255)
        assert not _triton_fits(x.float(), 256)  # float32 keeps cuBLAS


def test_triton_projections_are_named_ones():
    from aspire_ray.config import EngineConfig

    assert EngineConfig(triton_projections=["o", "down"]).triton_projections == ("o", "down")
    with pytest.raises(ValueError, match="triton_projections must name projections of"):
        EngineConfig(triton_projections=("qkv",))
