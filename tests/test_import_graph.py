"""No import circles in the package (issue 19): every ``import`` statement counts, inside
functions and under ``TYPE_CHECKING`` too, since each is a dependency a reader must follow.
And a light package face: validating a serve config or importing the kernels does not load the
engine (nor, for the config, torch)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import aspire_ray

ROOT = Path(aspire_ray.__file__).parent


def _modules() -> dict[str, Path]:
    """Module name -> source file, the kernels/ and tp/ links included: an editable install's
    aspire_ray/kernels is a symlink, which Path.rglob does not enter (a wheel's is a folder),
    so walk with followlinks, or a checkout's run misses the circles CI's install sees."""
    out = {}
    for folder, _, files in os.walk(ROOT, followlinks=True):
        for file in files:
            if not file.endswith(".py"):
                continue
            path = Path(folder) / file
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(["aspire_ray", *parts])] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports (``from a import b``: a.b if that is a module)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                       for alias in node.names]  # fmt: skip
        else:
            continue
        found |= {t for t in targets if t in modules and t != name}
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circles():
    modules = _modules()
    assert len(modules) > 50
    assert {"aspire_ray.kernels.paged_attention", "aspire_ray.tp.group"} <= set(modules)
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert graph["aspire_ray.engine.engine"] >= {"aspire_ray.engine.scheduler"}
    assert _cycles(graph) == []


def test_driver_side_resolves_names_without_the_weight_loader():
    """The engine and the serving layer find models through ``model.registry`` (names,
    aliases, cached conversions), never through ``model.loader`` (configs and weights, which
    only the worker reads; the in-process executor brings the worker along for tp = 1)."""
    modules = _modules()
    driver = [m for m in modules if m.startswith(("aspire_ray.engine", "aspire_ray.serving"))]
    assert len(driver) > 10
    for name in driver:
        assert "aspire_ray.model.loader" not in _imports(name, modules[name], modules), name
    users = {m for m in driver if "aspire_ray.model.registry" in _imports(m, modules[m], modules)}
    assert users >= {"aspire_ray.engine.engine", "aspire_ray.serving.deployment"}


LIGHT = """
import sys
from aspire_ray.serving.settings import AppArgs
AppArgs.model_validate({"engine": {"model": "smollm2-135m-instruct", "spec_mode": "magicdec"}})
assert "torch" not in sys.modules, "validating a serve config imported torch"
import aspire_ray.kernels, aspire_ray
heavy = [m for m in ("aspire_ray.engine.engine", "aspire_ray.llm", "aspire_ray.worker.worker",
                     "transformers") if m in sys.modules]
assert not heavy, heavy
"""


def test_light_package_face():
    proc = subprocess.run([sys.executable, "-c", LIGHT], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_repo_kernels_dir_never_shadows_the_pypi_kernels_package(tmp_path):
    # transformers >= 5.25 requires the PyPI package `kernels` and imports it; `serve run`
    # puts the repo root on sys.path, where a regular package `kernels/` once won and the
    # import failed (`cannot import name 'CUDAProperties'`), so the README's server never came
    # up. The repo's `kernels/` is a namespace directory: any regular package of that name wins.
    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text("CUDAProperties = 'the PyPI package'\n")
    repo = Path(__file__).resolve().parent.parent  # the checkout (ROOT may be site-packages)
    code = ("import sys; sys.path[:0] = [sys.argv[1], sys.argv[2]]; "
            "import kernels; from kernels import CUDAProperties; print(kernels.__file__); "
            "from aspire_ray.kernels.metadata import PagedKVMeta")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code, str(repo), str(site)],
                         capture_output=True, text=True, cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0, out.stderr
    # this fake, or the real PyPI package where it is installed (as transformers 5.25 does)
    found = Path(out.stdout.strip()).resolve()
    assert found.name == "__init__.py" and repo not in found.parents, found


def test_one_layer_loop():
    """A decoder layer runs as pre-attention -> attention -> post-attention, and only
    ``DecoderModel.span`` calls those pieces: the eager forward, the piecewise graphs and the
    whole-step graphs all run layers through it (issue 19: once, each wrote its own loop)."""
    callers = set()
    for name, path in _modules().items():
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                        and node.func.attr in ("pre_attention", "post_attention"):  # fmt: skip
                    callers.add(f"{name}.{fn.name}")
    assert callers == {"aspire_ray.model.decoder.span"}


def test_the_wheel_lists_every_package():
    # pyproject.toml lists the packages by hand (kernels/ and tp/ are mapped): a subpackage
    # missing there is missing from `pip install .`, which CI's install runs
    import tomllib

    root = Path(__file__).resolve().parents[1]
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])  # fmt: skip
    found = {".".join(p.parent.relative_to(root).parts)
             for p in (root / "aspire_ray").rglob("__init__.py")
             if ".egg-info" not in str(p)}  # fmt: skip
    found |= {"aspire_ray.kernels", "aspire_ray.tp"}  # mapped directories without __init__
    assert found <= listed, f"not in pyproject.toml's packages: {sorted(found - listed)}"
