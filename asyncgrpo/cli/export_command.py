"""`asyncgrpo export CHECKPOINT OUT_DIR`: a checkpoint of either layout as a Hugging Face folder."""

from __future__ import annotations

import re
import sys
import time

from asyncgrpo.checkpoints.export import export_checkpoint
from asyncgrpo.checkpoints.hf_folder import DEFAULT_MAX_FILE_BYTES
from asyncgrpo.errors import ConfigurationError

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """'4GB', '500MB', '2GiB' or a number of bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if match is None or match.group(2).upper() not in _UNITS:
        raise ConfigurationError(f"{text!r} is not a size: write it as 4GB, 500MB, 2GiB or a number of bytes")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def run_export(checkpoint: str, out_dir: str, max_file_size: str | None) -> int:
    try:
        max_file_bytes = parse_size(max_file_size) if max_file_size else DEFAULT_MAX_FILE_BYTES
    except ValueError as error:
        print(f"asyncgrpo export: --max-file-size {error}", file=sys.stderr)
        return 2
    started = time.monotonic()

    def progress(message: str) -> None:
        print(f"asyncgrpo export: {message}", file=sys.stderr, flush=True)

    try:
        export_checkpoint(checkpoint, out_dir, max_file_bytes, progress)
    except (FileNotFoundError, FileExistsError, ValueError) as error:
        print(f"asyncgrpo export: {error}", file=sys.stderr)
        return 2
    print(f"exported {checkpoint} to {out_dir} in {time.monotonic() - started:.1f} s")
    return 0
