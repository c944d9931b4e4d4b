"""Source witness for benchmark records: which code, which packages, which device produced them.

Contract. :func:`source_witness` returns a JSON-ready dict:

- ``commit``: ``git rev-parse HEAD`` of the checkout holding this package, or None;
- ``dirty_tracked``: how many tracked files differ from that commit, or None;
- ``packages``: versions of jax, jaxlib, numpy, gguf and bloomery_jax (None when one is absent);
- ``device``: platform, device kind and count of ``jax.devices()``; ``python``: its version;
- ``xla_flags``: the ``XLA_FLAGS`` the compiler ran under ("" when unset): they change the code;
- ``source_digest``: a hash of this package's files as they are on disk (:func:`source_digest`),
  which names the code where git cannot: a copied tree whose ``.git`` is another commit's (the
  GPU machine's). :func:`commit_digest` gives the same hash for a commit, to find which one it was.

None means *unknown* (no git, not a checkout, git failed): a count that cannot be read is never
reported as 0, since 0 would claim a clean tree. :func:`describe` renders it on one line with
"unknown" in those places. Git is run with ``--no-optional-locks`` so a benchmark never takes
the index lock from someone committing in the same checkout.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import subprocess
from pathlib import Path

PACKAGES = ("jax", "jaxlib", "numpy", "gguf", "bloomery-jax")


def _git(repo: Path, *args: str) -> str | None:
    try:
        res = subprocess.run(["git", "--no-optional-locks", "-C", str(repo), *args], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout if res.returncode == 0 else None


def git_state(repo: str | os.PathLike | None = None) -> tuple[str | None, int | None]:
    """(commit, number of dirty tracked files) of ``repo`` (default: this package's checkout)."""
    repo = Path(repo) if repo is not None else Path(__file__).resolve().parent.parent
    top = _git(repo, "rev-parse", "--show-toplevel")
    if top is None:
        return None, None
    # Only trust a checkout that really holds this package (not some enclosing repository).
    if repo.resolve() != Path(top.strip()).resolve() and not (repo / ".git").exists():
        return None, None
    head = _git(repo, "rev-parse", "HEAD")
    status = _git(repo, "status", "--porcelain", "--untracked-files=no")
    commit = head.strip() if head else None
    # Without a commit (no HEAD: an empty or copied repository) "clean" means nothing: unknown.
    if commit is None or status is None:
        return commit, None
    return commit, sum(1 for line in status.splitlines() if line.strip())


PACKAGE_DIR = Path(__file__).resolve().parent
SKIPPED = ("__pycache__",)  # folders of compiled copies, not source


def _is_source(rel: str) -> bool:
    """Is the package file at ``rel`` (a posix path) part of the digest?"""
    return not rel.endswith(".pyc") and not set(SKIPPED) & set(rel.split("/"))


def _digest(files) -> str:
    """sha256 over (relative path, bytes) pairs in path order; 16 hex digits."""
    h = hashlib.sha256()
    for rel, data in sorted(files):
        h.update(rel.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    return h.hexdigest()[:16]


def source_digest(package_dir: str | os.PathLike | None = None) -> str:
    """The digest of every file under ``package_dir`` (default: this package) but ``SKIPPED``
    folders and ``.pyc`` files, by path relative to the package's parent."""
    root = Path(package_dir) if package_dir is not None else PACKAGE_DIR
    files = []
    for path in root.rglob("*"):
        rel = path.relative_to(root.parent).as_posix()
        if path.is_file() and _is_source(rel):
            files.append((rel, path.read_bytes()))
    return _digest(files)


def commit_digest(commit: str, repo: str | os.PathLike | None = None, package: str = PACKAGE_DIR.name) -> str | None:
    """:func:`source_digest` of ``package`` as committed in ``commit`` (None when git cannot say)."""
    repo = Path(repo) if repo is not None else PACKAGE_DIR.parent
    names = _git(repo, "ls-tree", "-r", "--name-only", commit, package)
    if names is None:
        return None
    files = []
    for rel in filter(_is_source, names.splitlines()):
        res = subprocess.run(["git", "--no-optional-locks", "-C", str(repo), "show", f"{commit}:{rel}"],
                             capture_output=True, timeout=10)
        if res.returncode != 0:
            return None
        files.append((rel, res.stdout))
    return _digest(files)


def package_versions() -> dict[str, str | None]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    if out.get("bloomery-jax") is None:
        from . import __version__

        out["bloomery-jax"] = __version__
    return out


def device_info() -> dict[str, object]:
    try:
        import jax

        devs = jax.devices()
        return {"platform": devs[0].platform, "kind": devs[0].device_kind, "count": len(devs)}
    except Exception as e:  # a broken backend is itself worth recording
        return {"platform": None, "kind": None, "count": None, "error": f"{type(e).__name__}: {e}"}


def source_witness(repo: str | os.PathLike | None = None) -> dict[str, object]:
    """The witness dict (see the module docstring)."""
    commit, dirty = git_state(repo)
    return {"commit": commit, "dirty_tracked": dirty, "packages": package_versions(), "device": device_info(),
            "python": platform.python_version(), "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "gemv_tuned": gemv_tuned_file(), "source_digest": source_digest()}


def gemv_tuned_file() -> object:
    """The launch configs ``BLOOMERY_GEMV_TUNED`` names, as read (a run under them is another
    engine's timing than the committed tables'); None when unset."""
    path = os.environ.get("BLOOMERY_GEMV_TUNED")
    if not path:
        return None
    try:
        with open(path) as f:
            return {"path": path, "entries": json.load(f)}
    except (OSError, ValueError) as e:
        return {"path": path, "error": f"{type(e).__name__}: {e}"}


def describe(w: dict[str, object]) -> str:
    """One line: ``commit abc123def456 (2 dirty tracked files) | jax 0.11.2 ... | cpu: cpu x1``."""
    def unknown(v):
        return "unknown" if v is None else v

    commit = unknown(w["commit"])
    commit = commit[:12] if commit != "unknown" else commit
    dirty = w["dirty_tracked"]
    dirty_s = "unknown dirty state" if dirty is None else f"{dirty} dirty tracked file{'s' if dirty != 1 else ''}"
    pkgs = " ".join(f"{k} {unknown(v)}" for k, v in w["packages"].items())
    d = w["device"]
    return (f"commit {commit} ({dirty_s}) | source {w.get('source_digest')} | {pkgs} | "
            f"{unknown(d.get('platform'))}: {unknown(d.get('kind'))} x{unknown(d.get('count'))}")
