"""Stop tokens listed only in a HF directory's ``generation_config.json`` (as Llama 3 Instruct
lists 128001, 128008, 128009 beside config.json's 128001) stop generation."""

from __future__ import annotations

import json
import shutil

from conftest import make_tiny_model

from aspire_ray import LLM, SamplingParams
from aspire_ray.model import loader
from aspire_ray.model.arch import ModelArch


def _llama3_style_dir(path, config_eos: int, generation_eos: list[int]):
    make_tiny_model(path, "llama")
    cfg = json.loads((path / "config.json").read_text())
    cfg["eos_token_id"] = config_eos
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 0, "eos_token_id": generation_eos}))
    return path


def test_generation_config_stop_tokens_join_the_config_eos(tmp_path):
    model_dir = _llama3_style_dir(tmp_path, 201, [201, 208, 209])
    arch = ModelArch.from_hf_config(loader.load_hf_config(model_dir))
    assert arch.eos_token_ids == (201, 208, 209)
    # An explicit override still wins.
    cfg = loader.load_hf_config(model_dir, {"eos_token_id": 5})
    assert ModelArch.from_hf_config(cfg).eos_token_ids == (5,)


def test_without_generation_config_the_config_eos_stays(tmp_path):
    model_dir = _llama3_style_dir(tmp_path, 201, [])
    (model_dir / "generation_config.json").unlink()
    assert ModelArch.from_hf_config(loader.load_hf_config(model_dir)).eos_token_ids == (201,)


def test_generation_stops_on_a_generation_config_token(tmp_path, tiny_model_dir):
    prompt = [3, 14, 15, 92, 65, 35]
    greedy = SamplingParams(max_tokens=16, temperature=0.0)
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), model_dir)  # its config has no eos at all
    llm = LLM(str(model_dir), num_pages=64, calibrate="off")
    free = llm.generate([prompt], greedy)[0].token_ids
    llm.shutdown()
    # A token the model emits at step 3 (and not before) becomes a chat stop token.
    stop_at = next(i for i in range(2, len(free)) if free[i] not in free[:i])
    (model_dir / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [250, free[stop_at]]}))
    llm = LLM(str(model_dir), num_pages=64, calibrate="off")
    out = llm.generate([prompt], greedy)[0]
    llm.shutdown()
    assert out.finish_reason == "stop"
    assert out.token_ids == free[:stop_at + 1]
