"""sd-accel serve on a real local Ray (2 CPUs), Serve on 127.0.0.1, the tiny SD 1.5 model at 64x64
with ONNX Runtime engines built by ``build_missing`` in a temporary engine folder.

One Serve application is shared by the whole module (Ray and the replica take ~30 s to start);
the test that kills the replica runs last.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import socket
import time

import pytest

pytest.importorskip("ray.serve", reason="needs Ray Serve: pip install 'sd-accel[serve]'")
httpx = pytest.importorskip("httpx", reason="needs httpx (comes with the dev extra)")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TOKEN = "test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SIZE = 64
# Capacity: 4 requests in the replica (one batch of 4) + 2 waiting at the ingress's handle.
MAX_BATCH, MAX_ONGOING, MAX_QUEUED = 4, 4, 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    import ray
    from ray import serve as rserve

    from sd_accel.serve import ServeConfig, serve

    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=128 * 2**20, log_to_driver=False)
    config = ServeConfig(
        model="builtin:tiny-sd15",
        engine_dir=str(tmp_path_factory.mktemp("serve-engines")),
        accel={"backend": "onnxruntime"},
        port=_free_port(),
        token=TOKEN,
        num_replicas=1,
        num_cpus=1,
        max_batch_size=MAX_BATCH,
        batch_wait_ms=300,
        max_ongoing_requests=MAX_ONGOING,
        max_queued_requests=MAX_QUEUED,
        retry_after_s=2,
        request_timeout_s=120,
        build_missing=True,
        build_profiles=[{"batch": [1, 2, MAX_BATCH], "height": SIZE, "width": SIZE}],
    )
    try:
        srv = serve(config, blocking=False)
        yield srv
    finally:
        rserve.shutdown()
        ray.shutdown()


def _body(seed: int, prompt: str = "a red cube", steps: int = 4, **extra):
    return {"prompt": prompt, "steps": steps, "width": SIZE, "height": SIZE, "seed": seed, "cfg_scale": 7, **extra}


async def _post_all(url: str, bodies: list[dict], timeout: float = 120) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=timeout) as client:
        return await asyncio.gather(*(client.post(url + "/sdapi/v1/txt2img", headers=AUTH, json=b) for b in bodies))


def _image(b64: str):
    from PIL import Image

    img = Image.open(io.BytesIO(base64.b64decode(b64)))
    img.load()
    return img


def test_token_is_enforced_on_every_route(server):
    with httpx.Client(timeout=30) as c:
        for method, path in [("get", "/sd-accel/health"), ("get", "/sd-accel/engines"), ("get", "/sdapi/v1/samplers"),
                             ("get", "/docs"), ("get", "/openapi.json"), ("get", "/nothing/here"),
                             ("post", "/sdapi/v1/txt2img")]:
            kwargs = {"json": _body(1)} if method == "post" else {}
            for headers in ({}, {"Authorization": "Bearer nope"}):
                r = getattr(c, method)(server.url + path, headers=headers, **kwargs)
                assert r.status_code == 401, (path, headers, r.text)
        health = c.get(server.url + "/sd-accel/health", headers=AUTH)
        assert health.status_code == 200 and health.json()["ok"] and health.json()["replicas"]["RUNNING"] == 1


def test_engines_route_lists_the_engines_build_missing_made(server):
    with httpx.Client(timeout=30) as c:
        data = c.get(server.url + "/sd-accel/engines", headers=AUTH).json()
    components = {e["component"] for e in data["engines"]}
    assert {"clip", "unet", "vae_decoder"} <= components
    assert all(e["backend"] == "onnxruntime" and e["status"] == "ok" for e in data["engines"])


def test_bad_requests_get_422_without_reaching_the_replica(server):
    before = server.stats()["requests"]
    with httpx.Client(timeout=30) as c:
        for body, reason in [(_body(1, width=60), "width=60"), (_body(1, steps=0), "steps=0"),
                             (_body(1, sampler_name="Eulr a"), "unknown sampler")]:
            r = c.post(server.url + "/sdapi/v1/txt2img", headers=AUTH, json=body)
            assert r.status_code == 422 and reason in r.json()["detail"], r.text
    assert server.stats()["requests"] == before


def test_concurrent_clients_get_their_own_distinct_images_in_batches(server):
    n = MAX_ONGOING  # all fit in the replica at once
    # no bound on the time: batching is asserted below by the call sizes, not by a CPU's speed
    responses = asyncio.run(_post_all(server.url, [_body(1000 + i, prompt=f"prompt {i}") for i in range(n)]))
    assert [r.status_code for r in responses] == [200] * n, [r.text[:200] for r in responses]
    pixels = set()
    sizes = []
    for i, r in enumerate(responses):
        data = r.json()
        info = json.loads(data["info"])
        assert info["all_seeds"] == [1000 + i] and info["prompt"] == f"prompt {i}"
        img = _image(data["images"][0])
        assert img.size == (SIZE, SIZE)
        assert f"Seed: {1000 + i}" in img.info["parameters"] and f"prompt {i}" in img.info["parameters"]
        pixels.add(img.tobytes())
        sizes += info["sd_accel"]["call_sizes"]
    assert len(pixels) == n  # distinct seeds and prompts: distinct images
    assert max(sizes) > 1  # they shared pipeline calls
    stats = server.stats()
    assert max(stats["images_per_call"]) > 1
    # the engine saw batches above one image's cond+uncond pair, and nothing fell back to torch
    assert max(stats["unet_batches"]) > 2
    assert stats["engines"]["unet"]["engine_calls"] > 0 and stats["engines"]["unet"]["torch_calls"] == 0


def test_a_batched_image_equals_the_solo_one(server):
    solo = asyncio.run(_post_all(server.url, [_body(77, prompt="solo")]))[0]
    assert solo.status_code == 200
    assert json.loads(solo.json()["info"])["sd_accel"]["call_sizes"] == [1]
    together = asyncio.run(_post_all(server.url, [_body(77, prompt="solo")] +
                                     [_body(500 + i, prompt=f"company {i}") for i in range(2)]))
    assert [r.status_code for r in together] == [200, 200, 200]
    assert json.loads(together[0].json()["info"])["sd_accel"]["call_sizes"] == [3]
    a = _image(solo.json()["images"][0])
    b = _image(together[0].json()["images"][0])
    assert a.tobytes() == b.tobytes()  # ONNX Runtime engines: bit-equal


def test_overload_gives_503_with_retry_after_and_loses_nothing_accepted(server):
    before = server.stats()["images_made"]
    n = 16
    responses = asyncio.run(_post_all(server.url, [_body(2000 + i, steps=8) for i in range(n)]))
    codes = [r.status_code for r in responses]
    ok = [r for r in responses if r.status_code == 200]
    busy = [r for r in responses if r.status_code == 503]
    assert len(ok) + len(busy) == n, codes
    assert busy, codes  # more than the replica and the queue hold
    assert len(ok) >= MAX_ONGOING, codes
    assert all(r.headers.get("retry-after") == "2" for r in busy)
    for r in ok:  # every accepted request got its own image
        seed = json.loads(r.json()["info"])["all_seeds"][0]
        assert f"Seed: {seed}" in _image(r.json()["images"][0]).info["parameters"]
    assert server.stats()["images_made"] - before == len(ok)


# 16 images of 150 steps: four calls of 4 images, several seconds even for the tiny model.
LONG = {"steps": 150, "batch_size": 16}


def test_a_client_that_goes_away_frees_its_slot(server):
    before = server.stats()
    # The client gives up after a second, long before its images are done.
    with pytest.raises(httpx.ReadTimeout), httpx.Client(timeout=1.0) as c:
        c.post(server.url + "/sdapi/v1/txt2img", headers=AUTH, json=_body(3, **LONG))
    start = time.perf_counter()
    deadline = start + 30
    while time.perf_counter() < deadline:
        s = server.stats()
        if s["aborted_calls"] > before["aborted_calls"] or s["cancelled_requests"] > before["cancelled_requests"]:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"the abandoned request kept its slot: {s}")
    r = asyncio.run(_post_all(server.url, [_body(4)]))[0]
    assert r.status_code == 200
    assert time.perf_counter() - start < 30


def test_a_killed_replica_errors_its_request_and_comes_back(server):
    import ray

    old = server.stats()["replica"]
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if "SdAccelModel" in a["name"] and old in a["name"]]
    assert len(names) == 1, names

    calls_before = server.stats()["calls"]

    async def kill_during_request():
        async with httpx.AsyncClient(timeout=60) as client:
            pending = asyncio.create_task(
                client.post(server.url + "/sdapi/v1/txt2img", headers=AUTH, json=_body(5, **LONG)))
            # Kill once the first of its four calls is done: the request is surely on the replica.
            deadline = time.perf_counter() + 30
            while (await asyncio.to_thread(server.stats))["calls"] == calls_before and time.perf_counter() < deadline:
                await asyncio.sleep(0.1)
            assert not pending.done(), "the request finished before the kill; make it longer"
            ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
            return await pending

    start = time.perf_counter()
    r = asyncio.run(kill_during_request())
    assert r.status_code == 503 and "retry" in r.json()["detail"].lower(), r.text
    assert time.perf_counter() - start < 30  # an error, not a hang
    with httpx.Client(timeout=60) as c:  # at once: Serve's own status still counts the dead replica RUNNING
        h = c.get(server.url + "/sd-accel/health", headers=AUTH)
    assert h.status_code == 503 and not h.json()["ok"], h.text
    deadline = time.perf_counter() + 120
    with httpx.Client(timeout=60) as c:
        while time.perf_counter() < deadline:
            h = c.get(server.url + "/sd-accel/health", headers=AUTH)
            if h.status_code == 200:
                r = c.post(server.url + "/sdapi/v1/txt2img", headers=AUTH, json=_body(6))
                if r.status_code == 200:
                    break
            time.sleep(1)
        else:
            pytest.fail("the replica did not come back within 120 s")
    assert json.loads(r.json()["info"])["sd_accel"]["replica"] != old


@pytest.mark.slow
def test_a_local_ray_listens_on_loopback_only():
    """The service listens on 127.0.0.1 by default: so do the ports of the local Ray it starts."""
    import subprocess
    import sys

    code = ("import ray\nfrom sd_accel.serve.config import ServeConfig\nfrom sd_accel.serve.deployment import init_ray\n"
            "init_ray(ServeConfig(object_store_mb=80))\nprint('node', ray.util.get_node_ip_address())\nray.shutdown()\n")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert "node 127.0.0.1" in out.stdout, out.stdout + out.stderr[-2000:]


def test_the_build_worker_is_gone_once_the_engines_are_built(server):
    """--build-missing runs as a one-shot Ray task: its worker process (the pipeline and the
    build's heap) exits after the build instead of idling in Ray's pool for the service's life."""
    import psutil

    from sd_accel.serve.deployment import LAST_BUILD

    def alive(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    pid = LAST_BUILD["worker_pid"]
    deadline = time.monotonic() + 60  # Ray reaps the worker shortly after the task returns
    while alive(pid):
        assert time.monotonic() < deadline, f"the build worker {pid} is still alive"
        time.sleep(0.2)
    assert server.stats()["requests"] >= 0  # the service itself is still up


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGTERM", "Ctrl-C"])
def test_shutdown_answers_every_request_and_leaves_no_process(how):
    """``sd-accel serve`` stopped with requests in flight, by SIGTERM (a process manager) or by
    SIGINT: every request gets an answer (after
    SIGTERM the drain's 503: they run past the grace period), it exits, and no process of its own
    is left."""
    import signal
    import subprocess
    import sys

    import psutil

    def started_as():
        # Ctrl-C: a terminal's foreground job, SIGINT at its default (the suite itself may run as a
        # shell's background job, which ignores SIGINT, and the service would inherit that).
        # SIGTERM: such a background job, which keeps ignoring SIGINT and says so.
        signal.signal(signal.SIGINT, signal.SIG_DFL if how == "Ctrl-C" else signal.SIG_IGN)

    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    cmd = [sys.executable, "-m", "sd_accel.cli", "serve", "--no-engines", "--port", str(port), "--num-cpus", "1",
           "--shutdown-grace-s", "2", "--max-batch-size", "1", "--batch-wait-ms", "0"]
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, preexec_fn=started_as)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        with httpx.Client(timeout=10) as c:
            while True:
                assert proc.poll() is None, proc.stdout.read()
                assert time.monotonic() < deadline, "sd-accel serve did not come up"
                try:
                    if c.get(url + "/sd-accel/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
        ours = psutil.Process(proc.pid).children(recursive=True)
        assert any("raylet" in " ".join(p.cmdline()) for p in ours)  # the local Ray is ours

        async def in_flight():
            async with httpx.AsyncClient(timeout=120) as client:
                body = {"prompt": "x", "steps": 150, "width": 256, "height": 256}
                pending = [asyncio.create_task(client.post(url + "/sdapi/v1/txt2img", json=dict(body, seed=i)))
                           for i in range(3)]
                await asyncio.sleep(2.0)  # they reached the replica; each runs for many seconds
                assert not any(p.done() for p in pending)
                if how == "SIGTERM":
                    proc.send_signal(signal.SIGTERM)
                else:  # a terminal's Ctrl-C: SIGINT to the whole process group, Ray's processes too
                    os.killpg(proc.pid, signal.SIGINT)
                return await asyncio.gather(*pending, return_exceptions=True)

        answers = asyncio.run(in_flight())
        assert all(isinstance(a, httpx.Response) for a in answers), answers  # no dropped connection
        assert {a.status_code for a in answers} <= {200, 503}
        said = [(a.status_code, a.text[:300]) for a in answers]
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out[-3000:]
        # the drain cut them short (150 steps outlast the 2 s grace)
        assert all("shut down before this request finished" in a.text for a in answers), said
        assert "answered 503" in out
        assert ("SIGINT is ignored" in out) == (how == "SIGTERM"), out[:2000]
        _, alive = psutil.wait_procs(ours, timeout=15)
        alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not alive, [" ".join(p.cmdline())[:80] for p in alive]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
