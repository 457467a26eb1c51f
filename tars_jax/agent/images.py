"""Screenshot preprocessing: resize to the policy's input size."""

from __future__ import annotations

import numpy as np
from PIL import Image


def preprocess(image: np.ndarray, hw: tuple[int, int]) -> np.ndarray:
  """[h, w, 3] uint8 screenshot -> [H, W, 3] uint8 resized with bicubic filtering (PIL).

  Coordinates stay relative (0-1000 grid), so resizing does not change what an action means.
  """
  h, w = hw
  if image.shape[:2] == (h, w):
    return np.ascontiguousarray(image[..., :3])
  return np.asarray(Image.fromarray(image[..., :3]).resize((w, h), Image.BICUBIC), np.uint8)
