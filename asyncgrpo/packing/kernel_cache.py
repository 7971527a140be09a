"""Where fla-core's autotuning results and the compiled Triton kernels persist between processes.

fla-core autotunes each Triton kernel of the gated delta rule the first time a process runs it
(minutes on an H200 for the whole rule, bench/RESULTS.md), then asks Triton to keep the winning
configuration (`FLA_CACHE_RESULTS`, on unless set to anything but "1"; fla reads it when imported):
Triton writes it, beside the compiled kernels, to its cache folder, keyed by the kernel's source, the
Triton version, the GPU and the shape constants (heads, head dims), not the sequence length. A later
process on the same machine with the same model then finds both and starts in seconds.

Which folder: `TRITON_CACHE_DIR` when set, else Triton's own default,
`$TRITON_HOME/.triton/cache` (TRITON_HOME: the home folder). It has to be set before anything
compiles: torch's inductor, the first time it compiles a kernel (the trainer compiles its decoder
layers), sets TRITON_CACHE_DIR for the whole process to a folder under the system's temporary
directory when it is unset, which a reboot or a fresh container empties. How to warm it once:
docs/models.md, "Gated DeltaNet hybrids".
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)
TRITON_CACHE_DIR = "TRITON_CACHE_DIR"  # Triton's and inductor's cache folder (both read it at each compile)
TRITON_HOME = "TRITON_HOME"  # the folder Triton's default cache is under (.triton/cache)
FLA_CACHE_RESULTS = "FLA_CACHE_RESULTS"  # fla-core: "1" (its default) keeps autotuning results on disk


def default_triton_cache_dir() -> Path:
    """Triton's own default cache folder: $TRITON_HOME/.triton/cache, TRITON_HOME the home folder."""
    return Path(os.environ.get(TRITON_HOME) or Path.home()) / ".triton" / "cache"


def persist_kernel_autotuning(cache_dir: str | os.PathLike | None = None) -> Path:
    """Point Triton's cache (compiled kernels, and fla-core's autotuning results) at a folder the next
    process finds, and keep fla's results on disk; returns the folder (created).

    cache_dir: that folder (sets TRITON_CACHE_DIR); None: TRITON_CACHE_DIR as the user set it, else
    Triton's default (`default_triton_cache_dir`). Call it before the first compile of the process.
    """
    if cache_dir is not None:
        os.environ[TRITON_CACHE_DIR] = str(Path(cache_dir).expanduser())
    else:
        os.environ.setdefault(TRITON_CACHE_DIR, str(default_triton_cache_dir()))
    folder = Path(os.environ[TRITON_CACHE_DIR])
    folder.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault(FLA_CACHE_RESULTS, "1")  # fla's default, in case a release changes it
    if os.environ[FLA_CACHE_RESULTS] != "1":
        logger.warning(
            "%s=%s: fla-core autotunes its kernels again in every process (minutes on a GPU); unset it "
            "to keep the results in %s",
            FLA_CACHE_RESULTS,
            os.environ[FLA_CACHE_RESULTS],
            folder,
        )
    return folder
