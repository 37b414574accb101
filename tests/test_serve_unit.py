"""sd-accel serve without Ray: config, the WebUI request mapping, grouping, the batch queue, the
HTTP app over a stand-in backend, and one replica in-process on the tiny model."""

from __future__ import annotations

import asyncio
import base64
import collections
import io
import json
import threading
import time

import pytest

from sd_accel.core import InvalidValue
from sd_accel.serve.batching import (
    Abandoned,
    Batcher,
    BatchKey,
    Job,
    QueueFull,
    engine_batch_limit,
    take_group,
)
from sd_accel.serve.config import TOKEN_ENV, ServeConfig, load_config_file, make_config
from sd_accel.serve.txt2img import parse_txt2img, txt2img_answer

K64 = BatchKey(64, 64, 4, 7.0, None)

# --------------------------------------------------------------------------- config


def test_config_rejects_bad_values_naming_the_field():
    with pytest.raises(InvalidValue, match=r"ServeConfig\.num_replicas=0"):
        ServeConfig(num_replicas=0)
    with pytest.raises(InvalidValue, match=r"ServeConfig\.batch_wait_ms=-1"):
        ServeConfig(batch_wait_ms=-1)
    with pytest.raises(InvalidValue, match="max_ongoing_requests=2 .*at least max_batch_size"):
        ServeConfig(max_batch_size=4, max_ongoing_requests=2)
    with pytest.raises(InvalidValue, match=r"AccelConfig\.precision='fp64'"):
        ServeConfig(accel={"precision": "fp64"})
    with pytest.raises(InvalidValue, match="AccelConfig fields are"):
        ServeConfig(accel={"precison": "fp16"})
    with pytest.raises(InvalidValue, match="unknown serve config fields"):
        ServeConfig.from_dict({"replicas": 2})
    with pytest.raises(InvalidValue, match="Profile.height"):
        ServeConfig(build_profiles=[{"batch": 1, "height": 60, "width": 64}])


def test_config_defaults_engines_on_and_hides_token(tmp_path):
    c = ServeConfig(accel={"sampler": "Euler a"}, engine_dir=str(tmp_path), token="s3cret")
    assert c.accel.engines is True and c.accel.sampler == "Euler a"
    assert c.accel.engine_dir == str(tmp_path.resolve())
    assert "s3cret" not in repr(c)
    assert not c.open_to_network
    assert ServeConfig(host="0.0.0.0").open_to_network
    # to_dict / from_dict round trip is how the replicas get their config
    again = ServeConfig.from_dict(c.to_dict())
    assert again.accel == c.accel and again.token == "s3cret"


def test_config_file_yaml_and_json_then_overrides(tmp_path, monkeypatch):
    y = tmp_path / "serve.yaml"
    y.write_text("model: builtin:tiny-sd15\nnum_replicas: 2\naccel: {sampler: Euler a}\nmax_batch_size: 2\n")
    j = tmp_path / "serve.json"
    j.write_text(json.dumps({"port": 9001, "batch_wait_ms": 10}))
    assert load_config_file(j) == {"port": 9001, "batch_wait_ms": 10}
    monkeypatch.setenv(TOKEN_ENV, "from-env")
    c = make_config(y, num_replicas=3, port=None, accel={"precision": "fp32", "sampler": None})
    assert (c.num_replicas, c.max_batch_size, c.port) == (3, 2, 8000)
    assert c.accel.sampler == "Euler a" and c.accel.precision == "fp32" and c.accel.engines
    assert c.token == "from-env"
    assert make_config(token="given").token == "given"
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(InvalidValue, match="must hold a mapping"):
        load_config_file(bad)
    with pytest.raises(InvalidValue, match="does not exist"):
        load_config_file(tmp_path / "missing.yaml")


def test_cli_serve_arguments_reach_the_config(tmp_path, monkeypatch):
    from sd_accel.cli import build_parser
    from sd_accel.serve.cli import config_from_args

    monkeypatch.delenv(TOKEN_ENV, raising=False)
    f = tmp_path / "s.yaml"
    f.write_text("max_batch_size: 2\nnum_cpus: 2\n")
    args = build_parser().parse_args(["serve", "--config", str(f), "--port", "9100", "--token", "t",
                                      "--no-engines", "--sampler", "Euler a", "--engine-dir", str(tmp_path)])
    assert args.func.__module__ == "sd_accel.serve.cli"
    c = config_from_args(args)
    assert (c.port, c.token, c.max_batch_size, c.num_cpus, c.host) == (9100, "t", 2, 2, "127.0.0.1")
    assert c.accel.engines is False and c.accel.sampler == "Euler a"
    assert c.engine_dir == str(tmp_path.resolve())


# --------------------------------------------------------------------------- WebUI request mapping


def test_txt2img_maps_webui_fields_onto_generation_params():
    req = parse_txt2img({"prompt": "a cat", "negative_prompt": "dog", "steps": 7, "cfg_scale": 5,
                         "width": 64, "height": 72, "seed": 11, "sampler_name": "euler a", "batch_size": 2,
                         "n_iter": 2, "restore_faces": False, "styles": [], "save_images": False,
                         "my_extension_field": 1})
    p = req.params
    assert (p.prompt, p.negative_prompt, p.steps, p.cfg, p.width, p.height, p.seed, p.batch) == \
        ("a cat", "dog", 7, 5, 64, 72, 11, 4)
    assert p.sampler == "euler a" and (req.batch_size, req.n_iter) == (2, 2)
    assert req.ignored == ("my_extension_field",)
    # seed -1 is drawn at once, so the answer can report it; the WebUI's defaults otherwise
    d = parse_txt2img({})
    assert d.params.prompt == "" and 0 <= d.params.seed and d.params.batch == 1 and d.params.width is None
    assert parse_txt2img({"sampler_name": "DPM++ 2M", "scheduler": "Karras"}).params.sampler == "DPM++ 2M Karras"


@pytest.mark.parametrize("body, reason", [
    ({"width": 100}, r"GenerationParams\.width=100 .*multiple of 8"),
    ({"height": 0}, r"GenerationParams\.height=0"),
    ({"steps": 0}, r"GenerationParams\.steps=0 .*from 1 to 150"),
    ({"steps": 151}, r"GenerationParams\.steps=151"),
    ({"steps": "20"}, r"txt2img field steps='20' is not valid; allowed: an integer"),
    ({"sampler_name": "Eulr a"}, "unknown sampler 'Eulr a'; closest matches: Euler a"),
    ({"cfg_scale": -1}, r"GenerationParams\.cfg=-1"),
    ({"batch_size": 40, "n_iter": 2}, "80 images; at most 64"),
    ({"n_iter": 0}, "n_iter=0"),
    ({"enable_hr": True}, "enable_hr=true is not supported"),
    ({"alwayson_scripts": {"ADetailer": {"args": [True]}}}, "alwayson_scripts.ADetailer is not supported"),
    ([1, 2], "must be a JSON object"),
])
def test_txt2img_refuses_bad_requests_with_the_reason(body, reason):
    with pytest.raises(InvalidValue, match=reason):
        parse_txt2img(body)


def test_txt2img_answer_is_the_webui_shape():
    req = parse_txt2img({"prompt": "p", "seed": 3, "batch_size": 2, "width": 64, "height": 64})
    result = {"images": [b"\x89PNG1", b"\x89PNG2"], "seeds": [3, 4], "infotexts": ["i3", "i4"], "width": 64,
              "height": 64, "sampler": "Euler a", "model": "m", "call_sizes": [2], "replica": "r1", "seconds": 1.0}
    ans = txt2img_answer(req, result)
    assert [base64.b64decode(i) for i in ans["images"]] == result["images"]
    assert ans["parameters"]["seed"] == 3 and ans["parameters"]["batch_size"] == 2
    info = json.loads(ans["info"])
    assert info["all_seeds"] == [3, 4] and info["infotexts"] == ["i3", "i4"] and info["sd_model_name"] == "m"
    assert info["sd_accel"]["call_sizes"] == [2]
    assert txt2img_answer(parse_txt2img({"send_images": False}), result)["images"] == []


# --------------------------------------------------------------------------- grouping


def _job(key, prompt, seeds):
    return Job(key, prompt, None, list(seeds))


def test_take_group_never_mixes_keys_and_splits_large_jobs():
    other = BatchKey(64, 64, 4, 5.0, None)  # only the guidance differs: still incompatible
    q = collections.deque([_job(K64, "a", [1, 2, 3]), _job(other, "b", [9]), _job(K64, "c", [4, 5]),
                           _job(K64, "d", [6])])
    first = take_group(q, lambda k: 4)
    assert [(i.prompt, i.seed) for i in first] == [("a", 1), ("a", 2), ("a", 3), ("c", 4)]
    assert {i.job.key for i in first} == {K64}
    second = take_group(q, lambda k: 4)  # "c" is half done; "b" is now the oldest
    assert [(i.prompt, i.seed) for i in second] == [("b", 9)]
    third = take_group(q, lambda k: 4)
    assert [(i.prompt, i.seed) for i in third] == [("c", 5), ("d", 6)]
    assert not q and take_group(q, lambda k: 4) == []
    big = collections.deque([_job(K64, "x", range(5))])
    assert [len(take_group(big, lambda k: 2)) for _ in range(3)] == [2, 2, 1]


class _Fake:
    """A pipeline stand-in: records each call; image = (prompt, seed)."""

    def __init__(self, delay: float = 0.0, fail: bool = False):
        self.calls: list[list[tuple[str, int]]] = []
        self.delay = delay
        self.fail = fail
        self.started = threading.Event()

    def __call__(self, key, items, should_stop):
        self.started.set()
        self.calls.append([(i.prompt, i.seed) for i in items])
        end = time.monotonic() + self.delay
        while time.monotonic() < end:
            if should_stop():
                raise Abandoned("gone")
            time.sleep(0.01)
        if self.fail:
            raise RuntimeError("the pipeline broke")
        return [(i.prompt, i.seed, key) for i in items]


def _run(coro):
    return asyncio.run(coro)


def test_batcher_merges_compatible_requests_into_one_call():
    fake = _Fake()
    b = Batcher(fake, limit=lambda k: 4, wait_s=0.2, max_pending_images=16)

    async def main():
        jobs = [_job(K64, f"p{i}", [i]) for i in range(3)] + [_job(BatchKey(64, 64, 8, 7.0, None), "q", [7, 8])]
        done = await asyncio.gather(*(b.submit(j) for j in jobs))
        return done

    done = _run(main())
    assert sorted(len(c) for c in fake.calls) == [2, 3]  # one call per key, never mixed
    for job in done:
        assert [img[:2] for img in job.images] == [(job.prompt, s) for s in job.seeds]
        assert all(img[2] == job.key for img in job.images)
    assert done[0].call_sizes == [3] and done[3].call_sizes == [2]
    assert b.stats()["images_per_call"] == {2: 1, 3: 1}


def test_batcher_waits_at_most_batch_wait():
    fake = _Fake()
    b = Batcher(fake, limit=lambda k: 8, wait_s=0.05, max_pending_images=16)

    async def main():
        start = time.perf_counter()
        await b.submit(_job(K64, "alone", [1]))
        return time.perf_counter() - start

    assert _run(main()) < 1.0
    assert fake.calls == [[("alone", 1)]]


def test_batcher_bounded_queue_and_cancel_frees_the_slot():
    fake = _Fake(delay=0.5)
    b = Batcher(fake, limit=lambda k: 1, wait_s=0.0, max_pending_images=2)

    async def main():
        running = asyncio.create_task(b.submit(_job(K64, "run", [1])))
        while not fake.started.is_set():
            await asyncio.sleep(0.01)
        waiting = asyncio.create_task(b.submit(_job(K64, "wait", [2, 3])))
        await asyncio.sleep(0.05)
        with pytest.raises(QueueFull, match="retry in"):
            await b.submit(_job(K64, "over", [4]))
        waiting.cancel()  # its client went away
        await asyncio.sleep(0.05)
        assert b.pending_images() == 0
        late = await b.submit(_job(K64, "late", [5]))  # room again
        await running
        big = await b.submit(_job(K64, "big", [6, 7, 8]))  # larger than the bound: taken when alone
        assert len(big.images) == 3
        return late

    late = _run(main())
    assert [c[0][0] for c in fake.calls] == ["run", "late", "big", "big", "big"]  # the cancelled job never ran
    assert late.images[0][:2] == ("late", 5)
    assert b.stats()["cancelled_requests"] == 1


def test_batcher_stops_a_call_whose_requests_all_went_away_and_reports_failures():
    fake = _Fake(delay=5.0)
    b = Batcher(fake, limit=lambda k: 4, wait_s=0.0, max_pending_images=8)

    async def main():
        task = asyncio.create_task(b.submit(_job(K64, "x", [1])))
        while not fake.started.is_set():
            await asyncio.sleep(0.01)
        start = time.perf_counter()
        task.cancel()
        while b.stats()["aborted_calls"] == 0 and time.perf_counter() - start < 3:
            await asyncio.sleep(0.02)
        return time.perf_counter() - start

    assert _run(main()) < 2.0  # stopped at a step boundary, not after the 5 s call
    broken = Batcher(_Fake(fail=True), limit=lambda k: 4, wait_s=0.0, max_pending_images=8)
    with pytest.raises(RuntimeError, match="the pipeline broke"):
        _run(broken.submit(_job(K64, "y", [1])))
    assert broken.stats()["failed_calls"] == 1


def test_engine_batch_limit_reads_the_engines_and_halves_for_guidance():
    class H:
        def __init__(self, shapes):
            self.shapes, self.broken = shapes, None

    class E:
        def __init__(self, *handles):
            self.handles = list(handles)

    class M:
        def __init__(self, engines):
            self.engines = engines

    unet_engine = H({"sample": ((1, 4, 8, 8), (4, 4, 8, 8), (8, 4, 8, 8)), "timestep": ((1,), (4,), (8,))})
    vae_engine = H({"latent": ((1, 4, 8, 8), (2, 4, 8, 8), (3, 4, 8, 8))})

    class Pipe:
        vae_scale_factor = 8

    Pipe.unet = M({"unet": E(unet_engine)})
    Pipe.vae = M({"vae_decoder": E(vae_engine), "vae_encoder": E()})

    assert engine_batch_limit(Pipe, K64) == 3  # the VAE's 3 is below the UNet's 8 / 2
    assert engine_batch_limit(Pipe, BatchKey(64, 64, 4, 1.0, None)) == 3
    Pipe.vae = None
    assert engine_batch_limit(Pipe, K64) == 4
    assert engine_batch_limit(Pipe, BatchKey(64, 64, 4, 1.0, None)) == 8  # no guidance: no doubling
    assert engine_batch_limit(Pipe, BatchKey(128, 128, 4, 7.0, None)) is None  # no engine for this size

    class Torch:
        unet = object()

    assert engine_batch_limit(Torch, K64) is None


# --------------------------------------------------------------------------- the HTTP app


class _Backend:
    def __init__(self, behaviour=None, delay=0.0):
        self.calls = []
        self.behaviour = behaviour
        self.delay = delay
        self.cancelled = False

    async def generate(self, request):
        self.calls.append(request)
        try:
            await asyncio.sleep(self.delay)
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        if self.behaviour is not None:
            raise self.behaviour
        n = request["batch"]
        return {"images": [b"png"] * n, "seeds": [request["seed"] + i for i in range(n)], "infotexts": ["t"] * n,
                "width": request["width"] or 64, "height": request["height"] or 64, "sampler": "Euler",
                "model": "m", "call_sizes": [n], "replica": "r", "seconds": 0.0}

    async def health(self):
        return {"ok": True}


def _client(backend, **config):
    from fastapi.testclient import TestClient

    from sd_accel.serve.app import build_app

    return TestClient(build_app(ServeConfig(**config), backend))


def test_app_token_is_checked_on_every_route():
    backend = _Backend()
    c = _client(backend, token="tok")
    routes = [("get", "/sd-accel/health"), ("get", "/sd-accel/engines"), ("get", "/sdapi/v1/samplers"),
              ("get", "/docs"), ("get", "/openapi.json"), ("get", "/no/such/route"), ("post", "/sdapi/v1/txt2img"),
              ("post", "/sdapi/v1/img2img")]
    for method, path in routes:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "tok"}):
            r = getattr(c, method)(path, headers=headers, **({"json": {}} if method == "post" else {}))
            assert r.status_code == 401, (path, headers)
            assert r.headers["www-authenticate"].startswith("Bearer")
    assert backend.calls == []
    ok = {"Authorization": "Bearer tok"}
    assert c.get("/sd-accel/health", headers=ok).json() == {"ok": True}
    assert any(s["name"] == "Euler a" for s in c.get("/sdapi/v1/samplers", headers=ok).json())
    r = c.post("/sdapi/v1/txt2img", headers=ok, json={"prompt": "x", "seed": 5, "batch_size": 2})
    assert r.status_code == 200 and json.loads(r.json()["info"])["all_seeds"] == [5, 6]


def test_app_img2img_sends_the_init_image_and_refuses_a_bad_one_before_the_backend():
    import base64

    from PIL import Image

    backend = _Backend()
    c = _client(backend)
    buffer = io.BytesIO()
    Image.new("RGB", (16, 16), "red").save(buffer, "PNG")
    image = base64.b64encode(buffer.getvalue()).decode("ascii")
    for body in ({"prompt": "x"}, {"prompt": "x", "init_images": ["bm90IGFuIGltYWdl"]},
                 {"prompt": "x", "init_images": [image], "mask": image},
                 {"prompt": "x", "init_images": [image], "steps": "20"}):  # (a txt2img field: named as img2img's)
        r = c.post("/sdapi/v1/img2img", json=body)
        assert r.status_code == 422 and "img2img field" in r.json()["detail"], (body, r.json())
    assert backend.calls == []
    r = c.post("/sdapi/v1/img2img", json={"prompt": "x", "seed": 5, "init_images": [f"data:image/png;base64,{image}"],
                                          "denoising_strength": 0.4})
    assert r.status_code == 200, r.json()
    (sent,) = backend.calls
    assert sent["init_image"] == buffer.getvalue() and sent["strength"] == 0.4
    assert r.json()["parameters"]["init_images"] == ["<image>"]  # the answer does not echo the image back


def test_app_bad_requests_get_422_and_never_reach_the_backend():
    backend = _Backend()
    c = _client(backend)
    for body in ({"width": 63}, {"steps": 0}, {"sampler_name": "nope"}, {"enable_hr": True}):
        r = c.post("/sdapi/v1/txt2img", json=body)
        assert r.status_code == 422 and r.json()["detail"], body
    assert c.post("/sdapi/v1/txt2img", content=b"{not json", headers={"content-type": "application/json"}).status_code == 422
    assert backend.calls == []


# Each malformed body: raw bytes (JSON that json.dumps would not write) or an object, and the
# field the 422 must name. Types are checked before values: none of these may reach a validator
# that fails with a TypeError (a 500).
_DEEP = 100_000
BAD_BODIES = [
    ({"sampler_name": 123}, "sampler_name=123"),
    ({"sampler_name": ["Euler a"]}, "sampler_name="),
    ({"sampler_name": {}}, "sampler_name={}"),
    ({"sampler_name": True}, "sampler_name=true"),
    ({"sampler_index": 5}, "sampler_index=5"),
    ({"sampler_name": "Euler", "scheduler": 5}, "scheduler=5"),
    ({"sampler_name": 5, "scheduler": "Karras"}, "sampler_name=5"),
    ({"prompt": 5}, "prompt=5"),
    ({"prompt": None}, "prompt=null"),
    ({"negative_prompt": ["x"]}, "negative_prompt="),
    ({"steps": "20"}, "steps='20'"),
    ({"steps": 20.5}, "steps=20.5"),
    ({"steps": True}, "steps=true"),
    ({"cfg_scale": "7"}, "cfg_scale='7'"),
    (b'{"cfg_scale": NaN}', "cfg_scale=nan"),
    (b'{"my_field": [1, Infinity]}', r"my_field\[1\]=inf"),
    ({"width": "64"}, "width='64'"),
    ({"height": [64]}, "height="),
    ({"seed": 1.5}, "seed=1.5"),
    ({"batch_size": "2"}, "batch_size='2'"),
    ({"n_iter": "2"}, "n_iter='2'"),
    ({"send_images": "yes"}, "send_images='yes'"),
    ({"enable_hr": "yes"}, "enable_hr='yes'"),
    (b"[" * _DEEP + b"]" * _DEEP, "nested at most"),
    (b'{"prompt": "x", "extra": ' + b"[" * _DEEP + b"]" * _DEEP + b"}", "nested at most"),
    ({"styles": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["s"]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}, "styles.* nests deeper"),
    ({"alwayson_scripts": {"a": {"args": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}}},
     "alwayson_scripts.a.args.* nests deeper"),
    ([1, 2], "must be a JSON object"),
    (b'"a string"', "must be a JSON object"),
    (b"null", "must be a JSON object"),
    (b"", "must be a JSON object"),
    (b"\xff\xfe", "must be a JSON object"),
    (b"{not json", "must be a JSON object"),
]


@pytest.mark.parametrize("body, names", BAD_BODIES, ids=[str(i) for i in range(len(BAD_BODIES))])
def test_app_every_malformed_body_gets_a_422_naming_the_field(body, names):
    import re

    backend = _Backend()
    c = _client(backend)
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = c.post("/sdapi/v1/txt2img", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 422, (r.status_code, r.text[:300])
    assert r.headers["content-type"] == "application/json"
    detail = r.json()["detail"]
    assert re.search(names, detail), detail
    assert len(detail) < 400  # a huge or deep value is named, not echoed
    assert backend.calls == []


def test_app_refuses_a_body_over_the_limit_before_reading_it():
    backend = _Backend()
    c = _client(backend, max_request_bytes=4096)
    big = json.dumps({"prompt": "x" * 5000}).encode()
    r = c.post("/sdapi/v1/txt2img", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "at most 4096" in r.json()["detail"]

    def chunked():  # no Content-Length: the limit holds while reading
        for _ in range(10):
            yield b" " * 1000
        yield b"{}"

    r = c.post("/sdapi/v1/txt2img", content=chunked(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "more than 4096" in r.json()["detail"]
    assert backend.calls == []
    assert c.post("/sdapi/v1/txt2img", json={"prompt": "x" * 3000}).status_code == 200
    assert ServeConfig().max_request_bytes == 1 << 20
    with pytest.raises(InvalidValue, match="max_request_bytes=10 "):
        ServeConfig(max_request_bytes=10)


def test_app_maps_busy_dead_and_slow_backends():
    from sd_accel.serve.app import Busy, Unavailable

    r = _client(_Backend(Busy("full")), retry_after_s=2.5).post("/sdapi/v1/txt2img", json={})
    assert r.status_code == 503 and r.headers["retry-after"] == "3"
    r = _client(_Backend(Unavailable("replica died"))).post("/sdapi/v1/txt2img", json={})
    assert r.status_code == 503 and "replica died" in r.json()["detail"] and "retry-after" in r.headers
    r = _client(_Backend(InvalidValue("not covered"))).post("/sdapi/v1/txt2img", json={})
    assert r.status_code == 422
    r = _client(_Backend(RuntimeError("Traceback ...\n  more\nRuntimeError: out of memory"))).post(
        "/sdapi/v1/txt2img", json={})
    assert r.status_code == 500 and r.json()["detail"] == "generation failed: RuntimeError: out of memory"
    slow = _Backend(delay=10)
    start = time.perf_counter()
    r = _client(slow, request_timeout_s=0.3).post("/sdapi/v1/txt2img", json={})
    assert r.status_code == 504 and time.perf_counter() - start < 5
    assert slow.cancelled  # the timed-out request was cancelled, freeing its slot


def test_app_lists_engines(tmp_path):
    c = _client(_Backend(), engine_dir=str(tmp_path))
    data = c.get("/sd-accel/engines").json()
    assert data["engine_dir"] == str(tmp_path.resolve()) and data["engines"] == []


# --------------------------------------------------------------------------- one replica, in-process


@pytest.fixture(scope="module")
def replica(tiny_factory):
    from sd_accel import AccelConfig, accelerate
    from sd_accel.serve.replica import ModelServer

    pipe = accelerate(tiny_factory("sd15"), AccelConfig(sampler="Euler a"))
    return ModelServer(ServeConfig(accel={"sampler": "Euler a", "engines": False}, batch_wait_ms=200,
                                   max_batch_size=4, num_cpus=1), pipe=pipe)


def _pixels(png: bytes):
    from PIL import Image

    img = Image.open(io.BytesIO(png))
    return img, list(img.getdata())


def assert_same_image(a: bytes, b: bytes) -> None:
    """Equal up to float rounding: torch's CPU kernels may sum in another order for another batch
    size, which moves a rare pixel by one level (the ORT engines gave bit-equal images)."""
    import numpy as np

    x = np.asarray(_pixels(a)[0], dtype=np.int16)
    y = np.asarray(_pixels(b)[0], dtype=np.int16)
    assert x.shape == y.shape
    diff = np.abs(x - y)
    assert diff.max() <= 1 and (diff > 0).mean() < 0.01, (diff.max(), (diff > 0).mean())


def test_replica_batched_image_equals_the_solo_one(replica):
    req = {"prompt": "a red cube", "steps": 3, "cfg": 7.0, "width": 64, "height": 64, "seed": 42, "batch": 1}
    solo = asyncio.run(replica.generate(req))
    assert solo["call_sizes"] == [1]

    async def together():
        others = [dict(req, prompt=f"other {i}", seed=100 + i) for i in range(2)]
        return await asyncio.gather(replica.generate(req), *(replica.generate(o) for o in others))

    results = asyncio.run(together())
    assert results[0]["call_sizes"] == [3]  # the three shared one call
    img, _ = _pixels(results[0]["images"][0])
    assert_same_image(results[0]["images"][0], solo["images"][0])
    assert img.size == (64, 64) and "Seed: 42" in img.info["parameters"] and "Euler a" in img.info["parameters"]
    others = {tuple(_pixels(r["images"][0])[1]) for r in results}
    assert len(others) == 3  # distinct seeds, distinct images
    st = replica.stats()
    assert st["images_per_call"].get(3) == 1 and 6 in st["unet_batches"]  # 3 images, guidance doubles


def test_replica_seeds_within_a_request_follow_the_webui(replica):
    req = {"prompt": "x", "steps": 2, "cfg": 7.0, "width": 64, "height": 64, "seed": 7, "batch": 2}
    out = asyncio.run(replica.generate(req))
    assert out["seeds"] == [7, 8] and len(out["images"]) == 2
    single = asyncio.run(replica.generate(dict(req, seed=8, batch=1)))
    assert_same_image(out["images"][1], single["images"][0])
    with pytest.raises(InvalidValue, match="steps"):
        asyncio.run(replica.generate(dict(req, steps=0)))


def test_app_admits_a_burst_up_to_capacity_and_refuses_the_rest():
    import httpx

    from sd_accel.serve.app import build_app

    backend = _Backend(delay=0.5)
    app = build_app(ServeConfig(num_replicas=1, max_batch_size=2, max_ongoing_requests=2, max_queued_requests=1,
                                retry_after_s=1), backend)

    async def burst():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            return await asyncio.gather(*(c.post("/sdapi/v1/txt2img", json={"seed": i}) for i in range(6)))

    codes = sorted(r.status_code for r in asyncio.run(burst()))
    assert codes == [200, 200, 200, 503, 503, 503]  # 2 in the replica + 1 queued; the rest told to retry
    assert len(backend.calls) == 3


def test_a_sampler_that_is_not_a_string_is_an_invalid_value_everywhere():
    from sd_accel.generate import GenerationParams
    from sd_accel.samplers import resolve

    for bad in (5, ["Euler"], {}, True):
        with pytest.raises(InvalidValue, match=r"GenerationParams\.sampler="):
            GenerationParams(sampler=bad)
        with pytest.raises(InvalidValue, match="sampler name .* allowed: a string"):
            resolve(bad)
    with pytest.raises(InvalidValue, match="schedule type 5"):
        resolve("Euler", 5)


def test_replica_says_once_that_clip_ignores_the_end_of_a_long_prompt(replica, caplog):
    from sd_accel.serve.replica import PROMPT_SCAN_CHARS, clip_prompt

    huge = "a red cube on a table, " * 20_000  # ~460 kB
    kept, dropped = clip_prompt(replica.tokenizer, huge)
    assert dropped and len(kept) <= PROMPT_SCAN_CHARS and huge.startswith(kept)
    assert clip_prompt(replica.tokenizer, "a red cube") == ("a red cube", False)
    assert clip_prompt(replica.tokenizer, "a red cube, " * 40)[1]  # > 75 tokens, < the scan length

    req = {"prompt": huge, "steps": 2, "cfg": 7.0, "width": 64, "height": 64, "seed": 3, "batch": 1}
    replica._said_truncation = False
    with caplog.at_level("WARNING", logger="sd_accel"):
        out = asyncio.run(replica.generate(req))
        again = asyncio.run(replica.generate(dict(req, negative_prompt="blurry")))
    said = [r for r in caplog.records if "CLIP reads" in r.getMessage()]
    assert len(said) == 1  # once per replica, not per call
    assert not any("truncated because CLIP" in r.getMessage() for r in caplog.records)  # diffusers' own
    assert len(out["warnings"]) == 1 and out["warnings"][0].startswith("prompt is longer than the 75 tokens")
    assert again["warnings"] == out["warnings"]
    # what ran is what CLIP reads of the whole prompt; the infotext keeps the prompt as sent
    short = asyncio.run(replica.generate(dict(req, prompt=" ".join(huge.split()[:200]))))
    assert_same_image(out["images"][0], short["images"][0])
    assert short["warnings"] == out["warnings"]
    assert huge.strip() in out["infotexts"][0]
    plain = asyncio.run(replica.generate(dict(req, prompt="a red cube")))
    assert plain["warnings"] == []


def test_replica_reports_the_webui_name_of_the_models_own_scheduler(tiny_factory):
    from sd_accel.serve.replica import ModelServer

    server = ModelServer(ServeConfig(accel={"engines": False}, num_cpus=1), pipe=tiny_factory("sd15"))
    out = asyncio.run(server.generate({"prompt": "x", "steps": 2, "width": 64, "height": 64, "seed": 1}))
    assert out["sampler"] == "PLMS" and "Sampler: PLMS," in out["infotexts"][0]  # not PNDMScheduler
    server.batcher.close()


def test_resources_a_cluster_cannot_give_are_refused_before_deploying():
    from sd_accel.serve.deployment import resource_shortfall

    cpu_box = [{"Alive": True, "Resources": {"CPU": 2.0, "memory": 1e9}}]
    assert resource_shortfall(ServeConfig(), cpu_box) is None
    why = resource_shortfall(ServeConfig(num_gpus=1), cpu_box)  # the README's example on a CPU machine
    assert "1 replica(s) of 1 CPU and 1 GPU each do not fit" in why and "0 CPU" not in why
    assert "this cluster has no GPU: leave --num-gpus out" in why
    why = resource_shortfall(ServeConfig(num_replicas=3, num_cpus=1), cpu_box)
    assert "2 replica(s) fit" in why and "no GPU" not in why
    two_gpus = [{"Alive": True, "Resources": {"CPU": 8.0, "GPU": 1.0}}, {"Alive": False, "Resources": {"GPU": 4.0}},
                {"Resources": {"CPU": 8.0, "GPU": 1.0}}]
    assert resource_shortfall(ServeConfig(num_replicas=2, num_gpus=1), two_gpus) is None
    assert "0 replica(s) fit" in resource_shortfall(ServeConfig(num_gpus=2), two_gpus)  # no single node has 2
    assert resource_shortfall(ServeConfig(num_cpus=0, num_replicas=5), cpu_box) is None


def test_build_missing_builds_the_batch_range_batching_needs_and_a_cap_is_said(tiny_factory, monkeypatch, caplog):
    from sd_accel.serve import replica as replica_mod
    from sd_accel.serve.deployment import build_profiles_for

    pipe = tiny_factory("sd15")
    (profile,) = build_profiles_for(ServeConfig(max_batch_size=4), pipe)
    assert profile["batch"] == [1, 1, 4] and profile["height"] == [512, 512, 512]  # static-512, batch 1-4
    assert build_profiles_for(ServeConfig(max_batch_size=1), pipe)[0]["batch"] == [1, 1, 1]
    assert build_profiles_for(ServeConfig(build_preset="static-512"), pipe) is None  # the preset as asked
    given = [{"batch": 2, "height": 64, "width": 64}]
    assert build_profiles_for(ServeConfig(build_profiles=given), pipe) == given

    # engines whose batch range stops below max_batch_size: said at start-up, with the fix
    monkeypatch.setattr(replica_mod, "engine_batch_limit", lambda pipe, key: 1)
    with caplog.at_level("WARNING", logger="sd_accel"):
        server = replica_mod.ModelServer(ServeConfig(accel={"engines": False}, max_batch_size=4, num_cpus=1), pipe=pipe)
    server.batcher.close()
    assert "batching is capped at 1 image(s) per call" in caplog.text and "batch [1, 1, 4]" in caplog.text
    monkeypatch.setattr(replica_mod, "engine_batch_limit", lambda pipe, key: None)  # torch: no cap
    assert server.batch_cap_note() is None


def test_a_drain_finishes_running_requests_within_the_grace_and_answers_the_rest_503():
    import httpx

    from sd_accel.serve.app import build_app

    class Slow(_Backend):
        async def generate(self, request):  # seed 1: quick, seed 2: past any grace period
            self.delay = 0.3 if request["seed"] == 1 else 30
            return await super().generate(request)

    backend = Slow()
    app = build_app(ServeConfig(retry_after_s=1), backend)

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as c:
            running = [asyncio.ensure_future(c.post("/sdapi/v1/txt2img", json={"seed": s})) for s in (1, 2)]
            while len(backend.calls) < 2:  # both reached the backend
                await asyncio.sleep(0.01)
            drain = asyncio.ensure_future(app.state.lifecycle.drain(1.0))
            await asyncio.sleep(0)
            late = await c.post("/sdapi/v1/txt2img", json={"seed": 3})
            health = await c.get("/sd-accel/health")
            return await asyncio.gather(*running), late, health, await drain

    (quick, slow), late, health, drained = asyncio.run(scenario())
    assert quick.status_code == 200  # finished within the grace period
    assert slow.status_code == 503 and "shut down before this request finished" in slow.json()["detail"]
    assert backend.cancelled  # its work was cancelled, not left running
    assert late.status_code == 503 and "shutting down" in late.json()["detail"] and late.headers["retry-after"] == "1"
    assert health.status_code == 503 and health.json()["status"] == "shutting down"
    assert drained == {"running": 2, "cut_short": 1}
    assert len(backend.calls) == 2  # the late one never reached the backend


def test_the_batch_wait_defaults_to_none_where_batching_was_not_measured_to_help(replica):
    from types import SimpleNamespace

    from sd_accel.serve.replica import default_batch_wait_ms

    def pipe(device="cpu", *backends):
        handles = [SimpleNamespace(record=SimpleNamespace(key=SimpleNamespace(backend=b))) for b in backends]
        unet = SimpleNamespace(engines={"unet": SimpleNamespace(handles=handles)}) if backends else SimpleNamespace()
        return SimpleNamespace(device=device, unet=unet)

    assert default_batch_wait_ms(pipe("cuda:0"))[0] == 50
    assert default_batch_wait_ms(pipe("cpu", "onnxruntime"))[0] == 50
    wait, why = default_batch_wait_ms(pipe("cpu", "openvino"))
    assert wait == 0 and why.startswith("openvino engines on the CPU")
    assert default_batch_wait_ms(pipe("cpu")) == (0, "PyTorch on the CPU, where batching was not measured to help")
    assert ServeConfig().batch_wait_ms is None and ServeConfig(batch_wait_ms=30).batch_wait_ms == 30
    assert replica.batch_wait_ms == 200  # given: kept


def test_replica_img2img_on_sd15_resizes_the_init_image(replica):
    """SD 1.5's img2img pipeline takes the size from its image: the init image is resized to the
    request's, and the strength cuts the steps as in the WebUI."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (40, 72), "blue").save(buffer, "PNG")
    req = {"prompt": "a red cube", "steps": 4, "cfg": 7.0, "width": 64, "height": 64, "seed": 1, "batch": 1,
           "init_image": buffer.getvalue(), "strength": 0.5}
    before = sum(replica.stats()["unet_batches"].values())
    out = asyncio.run(replica.generate(req))
    img, _ = _pixels(out["images"][0])
    assert img.size == (64, 64) and "Denoising strength: 0.5" in img.info["parameters"]
    assert sum(replica.stats()["unet_batches"].values()) - before == 2  # 4 steps x 0.5
