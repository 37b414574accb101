"""Tensors on a safetensors file's own mapping (``sd_accel.models.mapped_file``): the bytes
safetensors reads, no copy in anonymous memory (a FLUX.1 transformer at FLUX's real width loaded
in bf16 costs a fraction of its file in RSS, asserted in a fresh process), writes never reach the
file, and a truncated or foreign file is a clear error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from sd_accel.core import CheckpointError
from sd_accel.models.mapped_file import open_mapped

ROOT = Path(__file__).resolve().parents[1]


def test_mapped_tensors_are_the_files_bytes_and_writes_stay_private(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {"a.bf16": torch.randn(3, 5, generator=gen).bfloat16(), "b.f32": torch.randn(7, generator=gen),
               "c.f8": torch.randn(4, 4, generator=gen).to(torch.float8_e4m3fn), "d.i64": torch.arange(6),
               "e.f16": torch.randn(2, 3, 4, generator=gen).half(), "f.empty": torch.zeros(0, 3)}
    path = tmp_path / "w.safetensors"
    save_file(tensors, str(path), metadata={"who": "test"})
    before = path.read_bytes()
    with open_mapped(path) as f, safe_open(str(path), framework="pt") as ref:
        assert sorted(f.keys()) == sorted(tensors) and f.metadata == {"who": "test"}
        got = {k: f[k] for k in f.keys()}
        for k in tensors:
            want = ref.get_tensor(k)
            assert got[k].dtype == want.dtype and got[k].shape == want.shape, k
            assert got[k].view(torch.uint8).flatten().tolist() == want.view(torch.uint8).flatten().tolist(), k
    got["a.bf16"].mul_(0)  # after close: the mapping lives on in the tensors; the write is private
    assert float(got["a.bf16"].abs().sum()) == 0.0
    assert path.read_bytes() == before


def test_truncated_and_foreign_files_are_clear_errors(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"x": torch.randn(64, 64)}, str(path))
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="truncated"):
        open_mapped(cut)
    foreign = tmp_path / "model.safetensors"
    foreign.write_bytes(b"PK\x03\x04" + os.urandom(200))  # a zip (a .ckpt renamed)
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        open_mapped(foreign)


_PROBE = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import torch
    from sd_accel.models.checkpoint import read_shapes
    from sd_accel.models.families import get_family, load_family_configs
    from sd_accel.models.flux import flux_prefix, load_transformer, transformer_config
    from sd_accel.pages import FileMaps
    from sd_accel.onnx.export import fp32_on

    def rss():
        f = dict(l.split(":", 1) for l in Path("/proc/self/status").read_text().splitlines() if ":" in l)
        return int(f["VmRSS"].split()[0]) * 1024

    path = Path(sys.argv[1])
    shapes = read_shapes(path)
    prefix = flux_prefix(shapes)
    config = transformer_config(load_family_configs(get_family("flux-dev"))["transformer/config.json"], shapes, prefix)
    import diffusers
    diffusers.FluxTransformer2DModel  # the import's own memory is not the weights'
    before = rss()
    model = load_transformer(path, config, prefix, torch.bfloat16)
    loaded = rss() - before
    maps = FileMaps()
    params = list(model.parameters())
    mapped = sum(p.numel() * p.element_size() for p in params
                 if maps.holds(p.untyped_storage().data_ptr(), p.untyped_storage().nbytes()))
    block = model.transformer_blocks[0]
    with fp32_on(block):
        assert block.attn.to_q.weight.dtype == torch.float32
    maps = FileMaps()
    back = all(maps.holds(p.untyped_storage().data_ptr(), p.untyped_storage().nbytes()) for p in block.parameters())
    print("RESULT " + json.dumps({"loaded": loaded, "mapped": mapped, "total": sum(p.numel() * p.element_size()
                                  for p in params), "back_on_file": back, "dtype": str(params[0].dtype)}))
""")


@pytest.mark.slow
def test_flux_transformer_at_real_width_loads_on_the_file_not_in_memory(tmp_path):
    """FLUX.1's real width (hidden 3072, context 4096), one double and one single block: 0.55G
    parameters, 1.1 GB of bf16. Read with ``get_tensor`` it cost its size in RSS; on the mapping it costs the few casts (the final modulation's
    swap) and the module's bookkeeping."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import random_flux_files as rf
    finally:
        sys.path.pop(0)
    path = tmp_path / "flux1-dev-random.safetensors"
    rf.write_safetensors(path, rf.flux_spec(1, 1), torch.bfloat16, 0.02, 0)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", _PROBE, str(path)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads([x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1][len("RESULT "):])
    assert result["dtype"] == "torch.bfloat16"
    assert result["total"] > 1.0e9
    assert result["mapped"] > 0.95 * result["total"], result  # all but the swapped final modulation
    assert result["back_on_file"], result  # an export's fp32 copy handed back, the file's data kept
    print(f"loaded {result['loaded'] / 2**20:.0f} MiB for {result['total'] / 2**20:.0f} MiB of weights")
    assert result["loaded"] < 0.15 * result["total"], result
