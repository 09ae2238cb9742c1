"""Build an offline bundle for a GPU host without network: wheels + model, split in chunks.

    python scripts/offline_bundle.py --out /tmp/bundle --chunk-mb 49
    # copy /tmp/bundle to the host (chunks of <= 49 MB), then there:
    bash /tmp/bundle/install.sh /opt/aspire_site    # prints the PYTHONPATH to export

What goes in: the aspire-ray wheel; Ray without its Java jars and the libraries we do not use
(rllib, tune, train, data) as a .tar.xz; the pure wheels the usual GPU image lacks (pydantic,
fastapi/uvicorn, the Ray Serve dependencies); optionally flashinfer; the default model's GGUF
file and the `gguf` reader. Torch, triton and transformers are expected on the host (they are
multi-GB and come with the image). Every file is split into chunks of at most --chunk-mb and
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


def split(path: Path, chunk: int) -> dict:
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    parts = []
    with path.open("rb") as f:
        i = 0
        while block := f.read(chunk):
            part = path.with_name(f"{path.name}.part{i:03d}")
            part.write_bytes(block)
            parts.append(part.name)
            i += 1
    path.unlink()
    return {"name": path.name, "sha256": digest, "parts": parts}


INSTALL_SH = r"""#!/usr/bin/env bash
# Reassemble, verify and install the bundle into SITE (default /opt/aspire_site).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"; SITE="${1:-/opt/aspire_site}"; WORK="$(mktemp -d)"
python3 - "$HERE" "$WORK" <<'PY'
import hashlib, json, sys, pathlib
here, work = map(pathlib.Path, sys.argv[1:])
for f in json.loads((here / "manifest.json").read_text())["files"]:
    data = b"".join((here / p).read_bytes() for p in f["parts"])
    assert hashlib.sha256(data).hexdigest() == f["sha256"], f["name"]
    (work / f["name"]).write_bytes(data)
PY
mkdir -p "$SITE" "$SITE/models"
python3 -m pip install -q --no-index --no-deps --target "$SITE" "$WORK"/*.whl
for t in "$WORK"/*.tar.xz; do tar -xJf "$t" -C "$SITE"; done
for m in "$WORK"/*.gguf; do [ -e "$m" ] && mv "$m" "$SITE/models/"; done
echo "export PYTHONPATH=$SITE:\${PYTHONPATH:-}"
echo "models in $SITE/models"
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--chunk-mb", type=float, default=49.0)
    p.add_argument("--python-version", default="3.12")
    p.add_argument("--ray-version", default="2.60.0")
    p.add_argument("--flashinfer", action="store_true", help="add flashinfer-python + tvm-ffi")
    p.add_argument("--no-model", action="store_true")
    args = p.parse_args()
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        staging = Path(tmp)
        pip_download([f"ray=={args.ray_version}"], staging, args.python_version)
        slim_ray(next(staging.glob("ray-*.whl")), staging)
        wheels = SERVE_WHEELS + (["flashinfer-python", "apache-tvm-ffi"] if args.flashinfer
                                 else [])
        pip_download(wheels, staging, args.python_version)
        repo = Path(__file__).resolve().parent.parent
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(staging),
                        str(repo)], check=True)
        if not args.no_model:
            from aspire_ray.model.loader import DEFAULT_MODEL, resolve_alias

            shutil.copy(resolve_alias(DEFAULT_MODEL), staging)
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
