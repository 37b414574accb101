"""Tokenizer files, written offline into a model's config folder.

CLIP's byte-level BPE files are built from the BPE merges list that OpenAI's CLIP (and
open-clip-torch) ship as ``bpe_simple_vocab_16e6.txt.gz`` (MIT licence). SD 1.x, SD 2.x, both SDXL
encoders, SD3's two CLIPs and FLUX.1's share this vocabulary; they differ only in the pad token,
which lives in each family's ``tokenizer_config.json``.

T5's (SD3's ``tokenizer_3``, FLUX.1's ``tokenizer_2``: the T5 v1.1 SentencePiece vocabulary of
32,100 tokens, Apache-2.0) ships as ``t5_tokenizer.json.gz``, the ``tokenizer.json`` that
``T5TokenizerFast`` reads (the same file ComfyUI keeps in its tree).
"""

from __future__ import annotations

import gzip
import json
from functools import lru_cache
from pathlib import Path

BPE_FILE = Path(__file__).parent / "configs" / "bpe_simple_vocab_16e6.txt.gz"
T5_FILE = Path(__file__).parent / "configs" / "t5_tokenizer.json.gz"
# CLIP uses the first 48894 merges: 49408 tokens = 256 bytes * 2 (+"</w>") + merges + 2 specials.
_N_MERGES = 49152 - 256 - 2


def _bytes_to_unicode() -> dict[int, str]:
    # The reversible byte -> printable character map of GPT-2/CLIP byte-level BPE.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


@lru_cache(maxsize=1)
def clip_vocab_and_merges() -> tuple[dict[str, int], list[str]]:
    """The CLIP vocabulary (token -> id) and merge rules, as CLIPTokenizer's files hold them."""
    lines = gzip.open(BPE_FILE).read().decode("utf-8").split("\n")
    merges = lines[1 : _N_MERGES + 1]
    base = list(_bytes_to_unicode().values())
    tokens = base + [t + "</w>" for t in base] + ["".join(m.split()) for m in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    return {t: i for i, t in enumerate(tokens)}, merges


def write_tokenizer_files(folder: Path) -> None:
    """Write the vocabulary files into a tokenizer folder that already holds its config: CLIP's
    ``vocab.json`` and ``merges.txt``, or T5's ``tokenizer.json`` (by the config's ``tokenizer_class``)."""
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    if str(config.get("tokenizer_class", "")).startswith("T5"):
        (folder / "tokenizer.json").write_bytes(gzip.open(T5_FILE).read())
        return
    vocab, merges = clip_vocab_and_merges()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
