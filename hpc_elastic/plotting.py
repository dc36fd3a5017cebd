"""The one way the project draws: matplotlib's pyplot on the Agg backend (files, no screen).

matplotlib is the ``plot`` extra: it is imported when a plot is drawn, and its absence is one clear error.
"""

from __future__ import annotations

import importlib
from typing import Any

from hpc_elastic.errors import HpcElasticError


def pyplot() -> Any:
    """``matplotlib.pyplot`` drawing into files; :class:`HpcElasticError` when matplotlib is not installed."""
    try:
        matplotlib = importlib.import_module("matplotlib")
    except ImportError:
        raise HpcElasticError("plots need matplotlib: pip install 'hpc-elastic[plot]'") from None
    matplotlib.use("Agg")
    return importlib.import_module("matplotlib.pyplot")
