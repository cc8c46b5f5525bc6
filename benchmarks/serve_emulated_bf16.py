"""`tokenmill serve` with the CPU kernels built with their AVX512-BF16 instructions emulated
(tests/bf16_emulation.h), on a CPU with AVX-512 but without BF16: the fused decoder and its bursts then run,
so their behaviour (how streamed tokens arrive, for one) can be measured there. Times are the
emulation's, several times a real BF16 CPU's: compare ratios, not absolute figures.

    python benchmarks/serve_emulated_bf16.py [MODEL] --dtype bfloat16 [serve flags]

With PYTHONPATH pointing at another checkout, that checkout's engine and kernels are served.
"""

from __future__ import annotations

import importlib.util
import os
import sys

_CONFTEST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "conftest.py")


def main() -> None:
    os.environ["TOKENMILL_TEST_EMULATE_BF16"] = "1"
    # Loading the tests' conftest builds the emulated kernels of the tokenmill that imports first and
    # installs them as its kernel module.
    spec = importlib.util.spec_from_file_location("tokenmill_test_conftest", _CONFTEST)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    from tokenmill.cli import main as cli

    sys.argv = ["tokenmill", "serve", *sys.argv[1:]]
    cli()


if __name__ == "__main__":
    main()
