"""The file a plot goes to is checked before any work: a name matplotlib writes as named, in a directory that
exists; a figure that cannot be written is one ValueError."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc_elastic.plotting import IMAGE_SUFFIXES, image_path, pyplot, save


def test_image_names_are_checked_before_anything_is_drawn(tmp_path: Path) -> None:
    for suffix in IMAGE_SUFFIXES:
        assert image_path(tmp_path / f"plot{suffix}", "--plot") == tmp_path / f"plot{suffix}"
    assert image_path(tmp_path / "PLOT.PNG", "--plot") == tmp_path / "PLOT.PNG"
    for name in ("plot", "plot.txt", ".png", "plot.png.bak"):
        with pytest.raises(ValueError, match=f"--plot '{tmp_path / name}' must be an image file name ending in"):
            image_path(tmp_path / name, "--plot")
    with pytest.raises(ValueError, match="--plot '.' must be an image file name"):
        image_path(Path(""), "--plot")
    with pytest.raises(ValueError, match="does not exist"):
        image_path(tmp_path / "missing" / "plot.png", "--plot")
    (tmp_path / "dir.png").mkdir()
    with pytest.raises(ValueError, match="dir.png' is a directory"):
        image_path(tmp_path / "dir.png", "-o")


def test_every_suffix_is_written_in_its_own_format(tmp_path: Path) -> None:
    for suffix in IMAGE_SUFFIXES:
        figure, axis = pyplot().subplots(figsize=(1, 1))
        axis.plot([0, 1], [1, 0])
        save(figure, tmp_path / f"plot{suffix}", dpi=20)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"plot{s}" for s in IMAGE_SUFFIXES)
    assert (tmp_path / "plot.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "plot.pdf").read_bytes()[:4] == b"%PDF"


def test_a_figure_that_cannot_be_written_is_one_value_error(tmp_path: Path) -> None:
    figure, _ = pyplot().subplots()
    with pytest.raises(ValueError, match="cannot write plot .*gone.*: No such file or directory"):
        save(figure, tmp_path / "gone" / "plot.png", dpi=20)
