"""Shape profiles: the range of requests an engine serves, and the presets users pick from.

A profile is in the user's terms (images per prompt, pixel height and width, prompt tokens);
each component turns it into min/opt/max shapes for its own inputs (the UNet's batch doubles
for classifier-free guidance, its latents are 1/8 of the image, and so on).

One grammar writes a range everywhere a person types one (the CLI's ``--batch/--height/--width/
--tokens``, the panel's range boxes): ``512`` (static), ``512-768`` (min-max, opt = min) or
``256-512-768`` (min-opt-max). :func:`parse_range` reads it, :func:`format_range` writes it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from sd_accel.core import InvalidValue

Range = tuple[int, int, int]
TOKEN_CHUNK = 77  # 75 prompt tokens + start + end; longer prompts come in multiples of 77
DIMENSIONS = ("batch", "height", "width", "tokens")
RANGE_GRAMMAR = "N (static), MIN-MAX (opt = MIN) or MIN-OPT-MAX, e.g. 512, 512-768 or 256-512-768"

_RANGE = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?(?:-\s*(\d+)\s*)?$")


def parse_range(name: str, text: str | int) -> Range:
    """A range as people type it: ``N``, ``MIN-MAX`` (opt = MIN) or ``MIN-OPT-MAX``.

    ``name`` (``"height"``, ...) only names the range in the error. Values are not checked
    here: :class:`Profile` says what is wrong with them (order, multiples of 8, ...).

    >>> parse_range("height", "512"), parse_range("height", "512-768"), parse_range("height", "256-512-768")
    ((512, 512, 512), (512, 512, 768), (256, 512, 768))
    >>> parse_range("height", "256, 512, 768")
    Traceback (most recent call last):
    ...
    sd_accel.core.InvalidValue: cannot read the height range '256, 512, 768': write N (static), MIN-MAX (opt = MIN) or MIN-OPT-MAX, e.g. 512, 512-768 or 256-512-768
    """
    if isinstance(text, int) and not isinstance(text, bool):
        return text, text, text
    match = _RANGE.match(text) if isinstance(text, str) else None
    if match is None:
        raise InvalidValue(f"cannot read the {name} range {text!r}: write {RANGE_GRAMMAR}")
    lo, second, third = (None if v is None else int(v) for v in match.groups())
    if second is None:
        return lo, lo, lo
    if third is None:
        return lo, lo, second
    return lo, second, third


def format_range(r: Range) -> str:
    """The inverse of :func:`parse_range`: the shortest text that reads back as ``r``.

    >>> format_range((512, 512, 512)), format_range((512, 512, 768)), format_range((256, 512, 768))
    ('512', '512-768', '256-512-768')
    """
    lo, opt, hi = r
    if lo == opt == hi:
        return str(lo)
    return f"{lo}-{hi}" if opt == lo else f"{lo}-{opt}-{hi}"


def _range(name: str, value: Any) -> Range:
    if isinstance(value, int):
        value = (value, value, value)
    try:
        lo, opt, hi = (int(v) for v in value)
    except (TypeError, ValueError):
        raise InvalidValue(f"Profile.{name} must be an int or a (min, opt, max) tuple, got {value!r}") from None
    if not 0 < lo <= opt <= hi:
        raise InvalidValue(f"Profile.{name} needs 0 < min <= opt <= max, got {(lo, opt, hi)}")
    return lo, opt, hi


@dataclass(frozen=True)
class Profile:
    """min/opt/max for batch, height, width (pixels) and tokens. Static when min == opt == max.

    >>> Profile(batch=(1, 1, 2), height=(64, 64, 136), width=(64, 64, 136), tokens=(77, 77, 154)).tag
    'b1-2.h64-136.w64-136.t77-154.opt1x64x64'
    >>> Profile(batch=1, height=1024, width=1024, text=(128, 256, 512)).tag
    'b1.h1024.w1024.t77.l128-512.opt1x1024x1024'
    """

    batch: Range
    height: Range
    width: Range
    tokens: Range = (TOKEN_CHUNK, TOKEN_CHUNK, TOKEN_CHUNK)
    # T5's sequence length (SD3 / SD3.5, FLUX.1: ``max_sequence_length``), any number up to 512;
    # None: the pipeline's default (SD3 256, FLUX.1 512). Their CLIPs stay at 77 (``tokens``).
    # Tagged ``.l256`` when given.
    text: Range | None = None
    # False: the UNet runs one row per image (CFG <= 1: Turbo, LCM-LoRA at CFG 1), so a static
    # engine of batch b takes b rows, not 2b. A guidance-embedded (LCM-distilled) UNet never
    # doubles, whatever this says. Tagged ``.nocfg``.
    cfg: bool = True

    def __post_init__(self) -> None:
        for name in ("batch", "height", "width", "tokens"):
            object.__setattr__(self, name, _range(name, getattr(self, name)))
        if self.text is not None:
            object.__setattr__(self, "text", _range("text", self.text))
        for name in ("height", "width"):
            bad = [v for v in getattr(self, name) if v % 8]
            if bad:
                raise InvalidValue(f"Profile.{name} values must be multiples of 8 pixels, got {getattr(self, name)}")
        if any(v % TOKEN_CHUNK for v in (self.tokens[0], self.tokens[2])):
            raise InvalidValue(f"Profile.tokens min and max must be multiples of {TOKEN_CHUNK}, got {self.tokens}")

    @classmethod
    def of(cls, value: Profile | dict[str, Any]) -> Profile:
        """A profile from a ``Profile`` or a dict such as ``dict(batch=(1, 1, 2), height=512, ...)``."""
        if isinstance(value, Profile):
            return value
        if not isinstance(value, dict):
            raise InvalidValue(f"a profile must be a Profile or a dict, got {type(value).__name__}")
        unknown = set(value) - {"batch", "height", "width", "tokens", "text", "cfg"}
        if unknown:
            raise InvalidValue(f"unknown profile fields {sorted(unknown)}; use batch, height, width, tokens "
                               "(and text, cfg)")
        missing = {"batch", "height", "width"} - set(value)
        if missing:
            raise InvalidValue(f"profile dict lacks {sorted(missing)}")
        return cls(**value)

    @property
    def static(self) -> bool:
        return all(r[0] == r[2] for r in (self.batch, self.height, self.width, self.tokens, self.text or (0, 0, 0)))

    @property
    def tag(self) -> str:
        """A short readable name, used in engine file names."""

        def part(letter: str, r: Range) -> str:
            return f"{letter}{r[0]}" if r[0] == r[2] else f"{letter}{r[0]}-{r[2]}"

        body = ".".join(part(k[0], getattr(self, k)) for k in ("batch", "height", "width", "tokens"))
        if self.text is not None:
            body += "." + part("l", self.text)
        suffix = "" if self.cfg else ".nocfg"
        if self.static:
            return "static." + body + suffix
        return f"{body}.opt{self.batch[1]}x{self.height[1]}x{self.width[1]}{suffix}"

    @classmethod
    def from_tag(cls, tag: str) -> Profile:
        """The profile a :attr:`tag` names (engine folders, for Rebuild). InvalidValue if none does.

        The tag does not hold the tokens' opt: it is taken as min, as ``MIN-MAX`` ranges do.

        >>> Profile.from_tag("b1-2.h64-136.w64-136.t77-154.opt1x64x64").height
        (64, 64, 136)
        >>> Profile.from_tag("static.b1.h1024.w1024.t77.l256").text
        (256, 256, 256)
        """
        body, opt_text = tag, None
        cfg = not body.endswith(".nocfg")
        body = body.removesuffix(".nocfg")
        if body.startswith("static."):
            body = body[len("static."):]
        else:
            body, _, opt_text = body.rpartition(".opt")
        parts = body.split(".")
        text = parse_range("text", parts.pop()[1:]) if len(parts) == len(DIMENSIONS) + 1 and parts[-1][:1] == "l" \
            else None
        try:
            if len(parts) != len(DIMENSIONS) or [p[:1] for p in parts] != [d[0] for d in DIMENSIONS]:
                raise InvalidValue("not b.h.w.t")
            ranges = {d: parse_range(d, p[1:]) for d, p in zip(DIMENSIONS, parts, strict=True)}
            if opt_text is not None:
                opts = [int(v) for v in opt_text.split("x")]
                for d, value in zip(DIMENSIONS[:3], opts, strict=True):
                    ranges[d] = (ranges[d][0], value, ranges[d][2])
            profile = cls(**ranges, text=text, cfg=cfg)
        except ValueError:
            profile = None
        if profile is None or profile.tag != tag:
            raise InvalidValue(
                f"{tag!r} is not a profile tag (like 'static.b1.h512.w512.t77' or "
                "'b1-4.h512-768.w512-768.t77-154.opt1x512x512'); give the ranges instead"
            )
        return profile

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: list(getattr(self, k)) for k in ("batch", "height", "width", "tokens")}
        if self.text is not None:
            out["text"] = list(self.text)
        if not self.cfg:
            out["cfg"] = False
        return out


PRESETS: dict[str, Profile] = {
    "static-512": Profile(batch=1, height=512, width=512),
    "static-768": Profile(batch=1, height=768, width=768),
    "static-1024": Profile(batch=1, height=1024, width=1024),
    "dynamic-256-512": Profile(batch=(1, 1, 4), height=(256, 512, 512), width=(256, 512, 512), tokens=(77, 77, 154)),
    "dynamic-512-768": Profile(batch=(1, 1, 4), height=(512, 512, 768), width=(512, 512, 768), tokens=(77, 77, 154)),
    "dynamic-768-1024": Profile(
        batch=(1, 1, 4), height=(768, 1024, 1024), width=(768, 1024, 1024), tokens=(77, 77, 154)
    ),
}


def preset(name: str) -> Profile:
    try:
        return PRESETS[name]
    except KeyError:
        raise InvalidValue(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}") from None


def default_preset(family: str) -> str:
    """SDXL, SD3 / SD3.5 and FLUX.1 default to static 1024 (their native size); SD 2.x 768-v to 768;
    others to 512."""
    native = {"sdxl": "static-1024", "sd2-v": "static-768", "sd3": "static-1024", "flux-dev": "static-1024",
              "flux-schnell": "static-1024"}
    return native.get(family, "static-512")
