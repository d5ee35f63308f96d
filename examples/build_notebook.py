"""Builds examples/rag_notebook.ipynb from its source, runs it, and saves it with its outputs.

    python examples/build_notebook.py               # convert, run (a few minutes on 2 CPU cores), save
    python examples/build_notebook.py --no-execute  # convert only, without outputs

The source is examples/rag_notebook.py, a jupytext percent-format script (``# %%`` code
cells, ``# %% [markdown]`` cells) that reviews and linters read as Python. This is
``jupytext --to notebook`` with stable cell ids, then a run in a fresh kernel with
nbclient. The run writes its plots and a results.json into examples/figures/
(PAGEDRAG_FIGURES_DIR elsewhere); tests/test_notebook.py builds and runs the same
notebook and checks the figures in that JSON.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jupytext
import nbformat

EXAMPLES = Path(__file__).resolve().parent
SOURCE = EXAMPLES / "rag_notebook.py"
NOTEBOOK = EXAMPLES / "rag_notebook.ipynb"
CELL_TIMEOUT_S = 900
KERNEL_NAME = "python3"


def build(source: Path = SOURCE) -> nbformat.NotebookNode:
    """The notebook of the percent-format source, without outputs; cell ids are the cells'
    places (``cell-00``...), so that a rebuild changes no id."""
    notebook = jupytext.read(source)
    for index, cell in enumerate(notebook.cells):
        cell["id"] = f"cell-{index:02d}"
    return notebook


def execute(notebook: nbformat.NotebookNode, cwd: Path = EXAMPLES,
            timeout: int = CELL_TIMEOUT_S) -> nbformat.NotebookNode:
    """Run every cell in a fresh kernel, in ``cwd``; raises CellExecutionError on a failing cell."""
    from nbclient import NotebookClient

    client = NotebookClient(notebook, timeout=timeout, kernel_name=KERNEL_NAME, record_timing=False,
                            resources={"metadata": {"path": str(cwd)}})
    client.execute()
    return notebook


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-execute", action="store_true", help="convert the source without running it")
    parser.add_argument("--output", type=Path, default=NOTEBOOK)
    args = parser.parse_args(argv)
    notebook = build()
    if not args.no_execute:
        started = time.perf_counter()
        execute(notebook)
        print(f"executed in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    nbformat.validate(notebook)
    nbformat.write(notebook, args.output)
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
