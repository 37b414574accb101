"""ControlNet units in ``sd-accel serve`` for FLUX.1 and SD3 (issue 45, the service):
sd-webui-controlnet's ``alwayson_scripts.controlnet`` units name a FLUX.1 / SD3 ControlNet folder
of ``controlnet_dir``; ``--build-missing`` builds the net's engine and the residual-taking
transformer (``transformer_control``); a request's unit runs on both engines, matches the
service's PyTorch picture, batches with like requests (FLUX.1: no CFG rows; SD3: cond + uncond),
and a FLUX.1 union net takes its control type as ``union_control_type``. Tiny models, random
weights, ONNX Runtime fp32."""

from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
import pytest
from PIL import Image

from sd_accel import EngineCache, load_pipeline, stats
from sd_accel.core import InvalidValue
from sd_accel.serve.config import ServeConfig
from sd_accel.serve.controlnet_units import parse_controlnet_units
from sd_accel.serve.deployment import _build_task
from sd_accel.serve.replica import ModelServer

from support.transformer_nets import flux_net, sd3_net

TEXT = {"flux": 512, "sd3": 256}  # the T5 length each pipeline asks for by default
REQUEST = {"prompt": "a red cube", "steps": 2, "cfg": 3.5, "width": 64, "height": 64, "seed": 1, "batch": 1}


def _hint_b64() -> str:
    image = Image.fromarray((np.random.RandomState(0).rand(64, 64, 3) * 255).astype("uint8"))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def _units(**unit) -> list[dict]:
    args = {"model": "net [0123abcd]", "image": _hint_b64(), "module": "none", "weight": 0.9, **unit}
    return [u.to_dict() for u in parse_controlnet_units({"controlnet": {"args": [args]}})]


def _server(family: str, folder, engines, on: bool) -> ModelServer:
    accel = {"engines": True, "engine_dir": str(engines), "backend": "onnxruntime"} if on else {"engines": False}
    return ModelServer(ServeConfig(model=f"builtin:tiny-{family}", controlnet_dir=str(folder), accel=accel,
                                   batch_wait_ms=300, max_batch_size=2, num_cpus=1))


@pytest.fixture(scope="module", params=sorted(TEXT))
def service(request, tmp_path_factory):
    family = request.param
    root = tmp_path_factory.mktemp(f"serve-cn-{family}")
    transformer = load_pipeline(f"builtin:tiny-{family}").transformer
    net = flux_net(transformer, 0, modes=3) if family == "flux" else sd3_net(transformer, 0)
    net.save_pretrained(root / "nets" / "net")
    config = ServeConfig(model=f"builtin:tiny-{family}", controlnet_dir=str(root / "nets"),
                         engine_dir=str(root / "engines"), accel={"backend": "onnxruntime", "precision": "fp32"},
                         max_batch_size=2, build_profiles=[{"batch": [1, 1, 2], "height": 64, "width": 64,
                                                            "text": TEXT[family]}])
    _build_task(config.to_dict())
    built = {r.key.component for r in EngineCache(root / "engines").list()}
    assert {"controlnet", "transformer_control", "transformer"} <= built, built
    return family, root


def _unit_for(family: str) -> list[dict]:
    return _units(union_control_type="depth") if family == "flux" else _units()


@pytest.mark.slow
def test_a_unit_runs_on_the_net_and_transformer_engines_as_in_pytorch(service):
    family, root = service
    on = _server(family, root / "nets", root / "engines", on=True)
    units = _unit_for(family)
    answer = asyncio.run(on.generate(dict(REQUEST, controlnet=units)))
    used = stats(on.control_pipe(("net",)))
    assert used["controlnet"]["engine_calls"] == 2 and used["controlnet"]["torch_calls"] == 0, used
    assert used["transformer_control"]["engine_calls"] == 2, used
    assert used["transformer_control"]["torch_calls"] == 0, used
    assert 'ControlNet 0: "Module: none, Model: net' in answer["infotexts"][0]

    torch_answer = asyncio.run(_server(family, root / "nets", root / "engines", on=False).generate(
        dict(REQUEST, controlnet=units)))
    plain = asyncio.run(on.generate(REQUEST))

    def pixels(png: bytes) -> np.ndarray:
        return np.asarray(Image.open(io.BytesIO(png)), dtype=np.int16)

    engine, reference = pixels(answer["images"][0]), pixels(torch_answer["images"][0])
    assert np.abs(engine - reference).max() <= 2  # the engines' picture is PyTorch's (8-bit rounding aside)
    assert np.abs(engine - pixels(plain["images"][0])).mean() > 1  # and the unit changed it


@pytest.mark.slow
def test_like_requests_with_the_same_unit_share_one_call(service):
    """Two requests with equal units make one batch-2 call, on the engines: FLUX.1's transformer
    takes one row per image (guidance is an input), SD3's cond and uncond rows (its net's too)."""
    family, root = service
    server = _server(family, root / "nets", root / "engines", on=True)
    units = _unit_for(family)

    async def two():
        return await asyncio.gather(server.generate(dict(REQUEST, controlnet=units)),
                                    server.generate(dict(REQUEST, seed=2, controlnet=units)))

    first, second = asyncio.run(two())
    assert first["call_sizes"] == second["call_sizes"] == [2]
    rows = 4 if family == "sd3" else 2
    assert server.stats()["unet_batches"] == {rows: REQUEST["steps"]}
    used = stats(server.control_pipe(("net",)))
    assert used["transformer_control"]["engine_calls"] == 2 and used["transformer_control"]["torch_calls"] == 0


def test_union_control_types_are_checked_against_the_net(service):
    family, root = service
    server = _server(family, root / "nets", root / "engines", on=False)
    if family == "flux":  # a union net: the type is needed, and must be one it has
        with pytest.raises(InvalidValue, match="is a union ControlNet"):
            asyncio.run(server.generate(dict(REQUEST, controlnet=_units())))
        with pytest.raises(InvalidValue, match="past the net's 3 control types"):
            asyncio.run(server.generate(dict(REQUEST, controlnet=_units(union_control_type="pose"))))
    else:  # a plain net takes none
        with pytest.raises(InvalidValue, match="this net is not one"):
            asyncio.run(server.generate(dict(REQUEST, controlnet=_units(union_control_type=2))))
    with pytest.raises(InvalidValue, match="not a FLUX.1 union control type"):
        _units(union_control_type="scribble")
    with pytest.raises(InvalidValue, match="not in this service's controlnet_dir"):
        asyncio.run(server.generate(dict(REQUEST, controlnet=_units(model="other"))))


def test_union_control_type_names_and_numbers():
    assert _units(union_control_type="Depth")[0]["union_mode"] == 2
    assert _units(union_control_type=5)[0]["union_mode"] == 5
    assert _units(union_control_type="Unknown")[0]["union_mode"] is None  # sd-webui-controlnet's default
    assert _units()[0]["union_mode"] is None
