"""``attention_options``: the triton backend's kernel settings, from the engine config."""

import pytest

from aspire_ray.attention import get_backend
from aspire_ray.config import EngineConfig
from aspire_ray.serving.settings import EngineArgs

triton = pytest.importorskip("triton")


def test_options_reach_the_triton_kernels():
    backend = get_backend("triton", "cpu", {"concurrent_launches": False, "waves": 4.0})
    assert backend.config.concurrent_launches is False and backend.config.waves == 4.0
    assert get_backend("triton", "cpu").config.concurrent_launches is True


def test_bad_options_are_named():
    with pytest.raises(ValueError, match="unknown attention_options.*'wavez'"):
        get_backend("triton", "cpu", {"wavez": 4.0})
    with pytest.raises(ValueError, match="settings of the 'triton' backend"):
        get_backend("torch", "cpu", {"waves": 4.0})
    with pytest.raises(ValueError, match="attention_options must map"):
        EngineConfig(attention_options=[("waves", 4.0)])


def test_serve_settings_carry_them():
    args = EngineArgs(attention_options={"concurrent_launches": False})
    assert args.to_engine_config().attention_options == {"concurrent_launches": False}
