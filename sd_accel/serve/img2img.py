"""AUTOMATIC1111's ``/sdapi/v1/img2img`` request: a txt2img request plus one init image and its
denoising strength. Inpainting (a mask) and the resize modes other than "just resize" are refused
by name; the image is resized to the request's width and height (the model's size when unset),
as the WebUI's resize mode 0 does, and the answer has the txt2img shape
(:func:`~sd_accel.serve.txt2img.txt2img_answer`).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import math
from typing import Any

from sd_accel.core import InvalidValue
from sd_accel.serve.txt2img import Txt2ImgRequest, parse_txt2img

DEFAULT_STRENGTH = 0.75  # the WebUI's
# img2img fields that only matter to inpainting or to the WebUI's own saving, at values that do nothing.
QUIET = ("include_init_images", "image_cfg_scale", "inpainting_fill", "inpaint_full_res",
         "inpaint_full_res_padding", "inpainting_mask_invert", "mask_blur", "mask_blur_x", "mask_blur_y",
         "initial_noise_multiplier", "latent_mask", "mask_round")


def decode_image(text: Any) -> bytes:
    """The bytes of one base64 image (a bare string or a ``data:image/...;base64,`` URL), checked
    to be an image PIL can read."""
    from PIL import Image, UnidentifiedImageError

    if not isinstance(text, str) or not text:
        raise InvalidValue("img2img field init_images[0] must be a base64-encoded image (a string)")
    data = text.split(",", 1)[1] if text.startswith("data:") else text
    try:
        raw = base64.b64decode(data, validate=True)
        Image.open(io.BytesIO(raw)).verify()
    except (binascii.Error, ValueError, UnidentifiedImageError, OSError) as exc:
        raise InvalidValue(f"img2img field init_images[0] is not a base64-encoded image ({exc})") from None
    return raw


def parse_img2img(body: Any) -> Txt2ImgRequest:
    """Map a WebUI img2img body onto a request whose :meth:`backend_request` carries the init
    image and strength; ``InvalidValue`` names the bad field.

    >>> parse_img2img({"prompt": "a cat", "init_images": []})
    Traceback (most recent call last):
    ...
    sd_accel.core.InvalidValue: img2img field init_images must hold one base64-encoded image; got 0 (sd-accel serve takes one init image per request)
    """
    if not isinstance(body, dict):
        raise InvalidValue(f"the img2img body must be a JSON object, got {type(body).__name__}")
    rest = dict(body)
    images = rest.pop("init_images", None)
    if not isinstance(images, list) or len(images) != 1:
        got = len(images) if isinstance(images, list) else type(images).__name__
        raise InvalidValue(f"img2img field init_images must hold one base64-encoded image; got {got} "
                           "(sd-accel serve takes one init image per request)")
    strength = rest.pop("denoising_strength", DEFAULT_STRENGTH)
    if strength is None:
        strength = DEFAULT_STRENGTH
    if isinstance(strength, bool) or not isinstance(strength, int | float) or not math.isfinite(strength) \
            or not 0 < strength <= 1:
        raise InvalidValue(f"img2img field denoising_strength={strength!r} is not valid; allowed: a number above 0, "
                           "at most 1")
    mask = rest.pop("mask", None)
    if mask not in (None, ""):
        raise InvalidValue("img2img field mask: inpainting is not served by sd-accel serve; leave mask out")
    resize = rest.pop("resize_mode", 0)
    if resize not in (None, 0):
        raise InvalidValue(f"img2img field resize_mode={resize!r}: sd-accel serve resizes the init image to "
                           "width x height (the WebUI's 0, \"Just resize\"); leave it out or send 0")
    for name in QUIET:
        rest.pop(name, None)
    request = parse_txt2img(rest, route="img2img")
    return dataclasses.replace(request, init_image=decode_image(images[0]), strength=float(strength),
                               body=dict(body, init_images=["<image>"]))


__all__ = ["DEFAULT_STRENGTH", "decode_image", "parse_img2img"]
