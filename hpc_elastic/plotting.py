"""The one way the project draws: matplotlib's pyplot on the Agg backend (files, no screen).

matplotlib is the ``plot`` extra: it is imported when a plot is drawn, and its absence is one clear error.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from hpc_elastic.errors import HpcElasticError
from hpc_elastic.files import check_output_file


def pyplot() -> Any:
    """``matplotlib.pyplot`` drawing into files; :class:`HpcElasticError` when matplotlib is not installed."""
    try:
        matplotlib = importlib.import_module("matplotlib")
    except ImportError:
        raise HpcElasticError("plots need matplotlib: pip install 'hpc-elastic[plot]'") from None
    matplotlib.use("Agg")
    return importlib.import_module("matplotlib.pyplot")


#: the names a plot may be written under: the suffix chooses the format, and matplotlib's Agg canvas writes each
IMAGE_SUFFIXES = (".png", ".pdf", ".svg", ".svgz", ".jpg", ".jpeg", ".tif", ".tiff", ".webp", ".eps", ".ps")


def image_path(path: Path, option: str) -> Path:
    """``path`` checked as the file a plot will be written to, before any work is done: a name with one of
    :data:`IMAGE_SUFFIXES` (matplotlib would add ``.png`` to any other, so the file named would not be the one
    written), and :func:`~hpc_elastic.files.check_output_file`; ``ValueError`` naming ``option`` otherwise."""
    if path.suffix.lower() not in IMAGE_SUFFIXES or not path.stem:
        raise ValueError(f"{option} {str(path)!r} must be an image file name ending in {', '.join(IMAGE_SUFFIXES)}")
    return check_output_file(path, option)


def save(figure: Any, path: Path, *, dpi: int) -> None:
    """Write ``figure`` (from :func:`pyplot`) to ``path`` and close it; ``ValueError`` when it cannot be written."""
    try:
        figure.savefig(path, dpi=dpi)
    except OSError as exc:
        raise ValueError(f"cannot write plot {str(path)!r}: {exc.strerror or exc}") from None
    finally:
        pyplot().close(figure)
