"""The one range grammar (``512``, ``512-768``, ``256-512-768``) and profile tags read back."""

from __future__ import annotations

import argparse

import pytest

from sd_accel.cli_engines import _range_arg
from sd_accel.core import InvalidValue
from sd_accel.profiles import PRESETS, RANGE_GRAMMAR, Profile, format_range, parse_range


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512", (512, 512, 512)),
        ("512-768", (512, 512, 768)),  # MIN-MAX: opt is MIN, as the CLI always read it
        ("256-512-768", (256, 512, 768)),
        (" 256 - 512 - 768 ", (256, 512, 768)),
        (64, (64, 64, 64)),
    ],
)
def test_parse_range_reads_the_grammar(text, expected):
    assert parse_range("height", text) == expected


@pytest.mark.parametrize("text", ["256, 512, 768", "256/512/768", "256 512", "big", "", "-5", "1-2-3-4", "512-",
                                  "5.5", None, True])
def test_parse_range_refuses_other_forms_and_teaches_the_grammar(text):
    with pytest.raises(InvalidValue) as info:
        parse_range("width", text)
    assert "width" in str(info.value) and RANGE_GRAMMAR in str(info.value)


@pytest.mark.parametrize("r", [(1, 1, 1), (1, 1, 4), (256, 512, 512), (512, 640, 768), (77, 77, 154)])
def test_format_range_is_the_inverse_of_parse_range(r):
    assert parse_range("x", format_range(r)) == r


def test_format_range_writes_the_shortest_form():
    assert [format_range(r) for r in ((512, 512, 512), (512, 512, 768), (256, 512, 768))] == [
        "512", "512-768", "256-512-768"]


def test_the_cli_reads_ranges_with_the_same_parser():
    read = _range_arg("height")
    for text in ("512", "512-768", "256-512-768"):
        assert read(text) == parse_range("height", text)
    with pytest.raises(argparse.ArgumentTypeError, match="MIN-OPT-MAX"):
        read("256, 512, 768")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_tags_read_back(name):
    assert Profile.from_tag(PRESETS[name].tag) == PRESETS[name]


def test_from_tag_of_a_dynamic_profile_with_opts():
    p = Profile(batch=(1, 1, 2), height=(64, 64, 136), width=(64, 72, 136), tokens=(77, 77, 154))
    assert Profile.from_tag(p.tag) == p
    # the tag has no token opt: it reads back as min, as MIN-MAX does
    q = Profile(batch=1, height=64, width=64, tokens=(77, 154, 154))
    assert Profile.from_tag(q.tag).tokens == (77, 77, 154)


@pytest.mark.parametrize("tag", ["b1.h64", "static.b1.h64.w64", "nonsense", "", "static.b1-2.h64.w64.t77",
                                 "b1-2.h64-136.w64-136.t77-154.opt1x64", "static.x1.h64.w64.t77",
                                 "static.b1.h60.w64.t77"])
def test_from_tag_refuses_what_no_profile_is_tagged(tag):
    with pytest.raises(InvalidValue, match="not a profile tag"):
        Profile.from_tag(tag)
