"""Control hints made without weights: the Canny edge map ControlNet's canny models were trained on.

OpenCV is not a dependency; this is Canny (Gaussian blur, Sobel gradients, non-maximum
suppression along the gradient, double threshold, hysteresis) in numpy and scipy, with
``cv2.Canny``'s default thresholds as sd-webui-controlnet uses them (100, 200 on 0..255).

>>> from PIL import Image
>>> canny(Image.new("RGB", (512, 512), "white")).size   # or Image.open("photo.png")
(512, 512)
"""

from __future__ import annotations

import numpy as np
from PIL import Image

from sd_accel.core import InvalidValue

PREPROCESSORS = ("none", "canny")


def canny(image: Image.Image, low: float = 100.0, high: float = 200.0) -> Image.Image:
    """The Canny edges of ``image`` as an RGB image (white edges on black), the size of ``image``."""
    from scipy import ndimage

    if not 0 <= low <= high:
        raise InvalidValue(f"canny thresholds need 0 <= low <= high, got low={low}, high={high}")
    gray = np.asarray(image.convert("L"), dtype=np.float64)
    smooth = ndimage.gaussian_filter(gray, sigma=1.4)
    gx = ndimage.sobel(smooth, axis=1)
    gy = ndimage.sobel(smooth, axis=0)
    # cv2's L1 magnitude on a 3x3 Sobel of 0..255 values: the same scale its thresholds are in
    mag = np.abs(gx) + np.abs(gy)
    angle = (np.rad2deg(np.arctan2(gy, gx)) + 180.0) % 180.0
    # non-maximum suppression: keep a pixel only where it beats both neighbours along its gradient
    padded = np.pad(mag, 1)
    h, w = mag.shape
    def at(dy: int, dx: int) -> np.ndarray:
        return padded[1 + dy : 1 + dy + h, 1 + dx : 1 + dx + w]
    keep = np.zeros_like(mag, dtype=bool)
    for lo_a, hi_a, (dy, dx) in ((0, 22.5, (0, 1)), (157.5, 180.1, (0, 1)), (22.5, 67.5, (1, 1)),
                                 (67.5, 112.5, (1, 0)), (112.5, 157.5, (1, -1))):
        sector = (angle >= lo_a) & (angle < hi_a)
        keep |= sector & (mag >= at(dy, dx)) & (mag >= at(-dy, -dx))
    thin = np.where(keep, mag, 0.0)
    strong = thin >= high
    weak = thin >= low
    # hysteresis: weak pixels count where their 8-connected region holds a strong one
    labels, n = ndimage.label(weak, structure=np.ones((3, 3)))
    if n:
        hit = np.zeros(n + 1, dtype=bool)
        hit[np.unique(labels[strong])] = True
        hit[0] = False
        edges = hit[labels]
    else:
        edges = np.zeros_like(weak)
    out = (edges * 255).astype(np.uint8)
    return Image.fromarray(np.stack([out] * 3, axis=-1))


def synthetic_edges(size: tuple[int, int], seed: int = 0) -> Image.Image:
    """A made-up edge map of ``size`` (width, height): white outlines of a few circles and a line
    on black, as a Canny map looks. For runs that need a control image and have none (int8
    calibration of ControlNet engines, benchmarks); ``seed`` moves and resizes the shapes.

    >>> synthetic_edges((64, 48)).size
    (64, 48)
    """
    from PIL import ImageDraw

    rng = np.random.default_rng(seed)
    w, h = size
    img = Image.new("RGB", (w, h))
    draw = ImageDraw.Draw(img)
    cx, cy = (w // 2, h // 2) if seed == 0 else (int(rng.integers(w // 4, 3 * w // 4 + 1)),
                                                 int(rng.integers(h // 4, 3 * h // 4 + 1)))
    for i in range(1, 5):
        r = min(w, h) * i // 10
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), outline="white", width=2)
    draw.line((0, h - 1, w - 1, 0) if seed % 2 == 0 else (0, 0, w - 1, h - 1), fill="white", width=2)
    return img


def preprocess(image: Image.Image, name: str) -> Image.Image:
    """``image`` through the preprocessor ``name`` (``none``: as given, in RGB)."""
    if name == "none":
        return image.convert("RGB")
    if name == "canny":
        return canny(image)
    raise InvalidValue(f"unknown control preprocessor {name!r}: use one of {', '.join(PREPROCESSORS)} "
                       "(other hints: give the hint image itself)")
