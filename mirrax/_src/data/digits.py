"""scikit-learn's bundled handwritten digits (UCI optdigits test set) as a train/test split.

The data ship with scikit-learn, so this works offline: 1797 grayscale 8x8 images of the
digits 0-9, pixel values 0..16.
"""

from __future__ import annotations

import numpy as np

from mirrax import errors


def load_digits(test_fraction: float = 0.2, seed: int = 0):
    """The handwritten digits as float images and int labels, split into train and test.

    Semantics as `sklearn.datasets.load_digits` followed by `sklearn.model_selection.
    train_test_split(..., test_size=test_fraction, random_state=seed, stratify=labels)`, so
    each digit has the same share in both parts and the split is the same on every machine.
    With the defaults: 1437 training and 360 test images.

    Args:
      test_fraction: the share of the 1797 images held out for testing, a float in (0, 1).
      seed: the seed of the split (an int); the same seed gives the same split.

    Returns:
      ((x_train, y_train), (x_test, y_test)): images as float32 arrays of shape (N, 8, 8, 1)
      (height, width, channels) with values in [0, 1] (pixel / 16); labels as int32 arrays
      of shape (N,) with values 0..9.

    Raises:
      ValueError: `test_fraction` is not strictly between 0 and 1.
    """
    if not isinstance(test_fraction, (float, int)) or not 0 < test_fraction < 1:
        raise errors.InvalidArgumentError(
            f"load_digits: test_fraction must be a number strictly between 0 and 1 (the share "
            f"of images held out for testing); received {test_fraction!r}. Use e.g. 0.2."
        )
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not (0 <= seed < 2**32):
        raise errors.InvalidArgumentError(
            f"load_digits: seed must be an int in [0, 2**32) (the seed of the split); received "
            f"{seed!r}. Use e.g. seed=0."
        )
    # Imported here: scikit-learn takes about a second to import, and only this loader needs it.
    from sklearn import datasets, model_selection

    digits = datasets.load_digits()
    images = (digits.images.astype(np.float32) / np.float32(16.0))[..., None]
    labels = digits.target.astype(np.int32)
    x_train, x_test, y_train, y_test = model_selection.train_test_split(
        images, labels, test_size=test_fraction, random_state=seed, stratify=labels
    )
    return (x_train, y_train), (x_test, y_test)
