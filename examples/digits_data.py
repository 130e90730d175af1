"""The handwritten digits the examples train on: 1797 images of 8x8 pixel counts (0..16).

``data/digits.csv.gz`` is the test set of the UCI "Optical Recognition of Handwritten Digits"
dataset (E. Alpaydin and C. Kaynak, 1998, CC BY 4.0:
https://archive.ics.uci.edu/dataset/80), as scikit-learn ships it for ``load_digits``: one row
per image, its 64 pixel counts row by row, then its label. It is committed here so that the
examples download nothing and need no scikit-learn.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parent / "data" / "digits.csv.gz"


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """``(images, labels)``: float64 ``[1797, 8, 8]`` pixel counts and int64 ``[1797]`` labels.

    >>> images, labels = load_digits()
    >>> images.shape, images.max(), labels[:5].tolist()
    ((1797, 8, 8), np.float64(16.0), [0, 1, 2, 3, 4])
    """
    table = np.loadtxt(DATA, delimiter=",")
    return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(np.int64)
