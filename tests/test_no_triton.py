"""Every public entry point imports, and a CPU engine generates, without triton.

A CPU install has no triton (the CPU torch wheel does not bring it; only the `test` and `gpu`
extras do), but the test venv has it, so the check runs in a subprocess where importing it fails
as if it were not installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import aspire_ray

# None in sys.modules: `import triton` raises ModuleNotFoundError and find_spec returns None, as
# when it is not installed. As a sitecustomize on PYTHONPATH it also holds in child processes.
BLOCKER = "import sys\n\nsys.modules['triton'] = None\n"

TINY = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
            max_position_embeddings=2048)  # fmt: skip

SCRIPT = """
import importlib.util, json, sys

assert importlib.util.find_spec("triton") is None, "the triton blocker is not active"
import aspire_ray
from aspire_ray import LLM, SamplingParams
from aspire_ray.cli import main
from aspire_ray.serving.app import build_server
from aspire_ray.serving.deployment import build_app
from aspire_ray.serving.settings import AppArgs

engine = dict(model="dummy", load_format="dummy", hf_overrides=json.loads(sys.argv[1]),
              spec_mode="aspire", calibrate="off", num_pages=64,
              spec_options=dict(k_min=2, recent_pages=1))
build_app({"engine": engine})  # what `serve run` calls: validates, imports Ray Serve
app, server_engine = build_server(AppArgs.model_validate({"engine": engine}))  # the replica
server_engine.shutdown()
llm = LLM(**{k: v for k, v in engine.items() if k != "spec_options"}, **engine["spec_options"])
params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
out = llm.generate([list(range(1, 70))], params)[0]
assert len(out.token_ids) == 12, out
assert out.metrics.drafted > 0, "no speculation ran"
assert sys.modules.get("triton") is None

# The GPU default is the Triton backend: without triton it fails naming the package rather
# than fall back to the torch reference (a device name only: no GPU is touched).
from aspire_ray.attention import BackendUnavailableError, get_backend
try:
    get_backend("auto", "cuda")
    raise AssertionError("the Triton backend was chosen without triton")
except BackendUnavailableError as e:
    assert e.package == "triton" and "pip install triton" in str(e), e
print("generated", out.token_ids)
"""


def test_entry_points_and_cpu_generation_without_triton(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    env = dict(os.environ)
    # the aspire_ray this process imported (installed, or a checkout), not whatever cwd holds
    package_root = str(Path(aspire_ray.__file__).resolve().parent.parent)
    paths = [str(tmp_path), package_root, env.get("PYTHONPATH")]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(TINY)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "generated" in proc.stdout
