"""The extension's HTTP routes under the WebUI's rules (issue 15, points 1 and 6).

The stand-in WebUI mounts its own API exactly as A1111 1.8 and both Forges do
(``tests/webui_stub/modules/api/api.py``: ``Api.add_api_route`` with ``Depends(self.auth)`` under
``--api-auth``, created only with ``--api`` or ``--nowebui``), so these tests hold the
extension's routes to the same rules: no routes without the API, the same 401s with auth.
"""

from __future__ import annotations

import sys
from pathlib import Path

STUB = Path(__file__).resolve().parent / "webui_stub"
sys.path.insert(0, str(STUB))
import harness  # noqa: E402
from harness import webui_lean  # noqa: E402, F401  (autouse: see its docstring)

from sd_accel.profiles import Profile  # noqa: E402

STATIC = Profile(batch=1, height=64, width=64)
BAD_PROFILE = {"profile": {"batch": 1, "height": 13, "width": 13}}




def test_routes_carry_the_webuis_api_auth(tmp_path, monkeypatch):
    webui = harness.start(tmp_path, argv=("--api", "--api-auth", "u:p,v:q"))
    client = webui.client()
    # The WebUI's own API and ours answer alike: 401 without or with wrong credentials.
    assert client.get("/sdapi/v1/options").status_code == 401
    assert client.get("/sdapi/v1/options", auth=("u", "p")).status_code == 200
    for method, path, body in (("get", "/sd-accel/engines", None), ("post", "/sd-accel/build", BAD_PROFILE),
                               ("delete", "/sd-accel/engines/x", None)):
        call = getattr(client, method)
        kwargs = {"json": body} if body is not None else {}
        for auth in (None, ("u", "x"), ("nobody", "p")):
            response = call(path, auth=auth, **kwargs) if auth else call(path, **kwargs)
            assert response.status_code == 401, (method, path, auth)
            assert response.headers.get("www-authenticate") == "Basic"
    # A build without credentials is refused before anything runs (no model load, no export).
    from sd_accel.webui import jobs

    called = []
    monkeypatch.setattr(jobs, "build_for_checkpoint", lambda *a, **k: called.append(a) or [])
    assert client.post("/sd-accel/build", json={"profile": STATIC.to_dict()}).status_code == 401
    assert not called
    # With credentials (either user), the handlers answer.
    assert client.get("/sd-accel/engines", auth=("u", "p")).status_code == 200
    assert client.get("/sd-accel/engines", auth=("v", "q")).status_code == 200
    assert client.delete("/sd-accel/engines/x", auth=("u", "p")).status_code == 404
    # The dependency is the WebUI's own (Api.auth), not a copy of its logic.
    routes = {r.path: r for r in webui.app.routes if hasattr(r, "dependencies")}
    ours, theirs = routes["/sd-accel/engines"].dependencies, routes["/sdapi/v1/options"].dependencies
    assert [d.dependency for d in ours] == [d.dependency for d in theirs]
    assert ours[0].dependency.__func__.__qualname__ == "Api.auth"


def test_no_routes_without_the_webuis_api(tmp_path, capsys):
    webui = harness.start(tmp_path, argv=())  # no --api: the WebUI mounts no /sdapi/v1 either
    client = webui.client()
    assert client.get("/sdapi/v1/options").status_code == 404
    assert client.get("/sd-accel/engines").status_code == 404
    assert client.post("/sd-accel/build", json=BAD_PROFILE).status_code in (404, 405)
    assert client.delete("/sd-accel/engines/x").status_code in (404, 405)
    assert "HTTP routes off" in capsys.readouterr().out
    # A1111's built-in Lora extension adds /sdapi/v1/loras (no auth) in every start, --api or not:
    # that is not the WebUI's API, and adds no routes of ours.
    from sd_accel.webui import api

    webui.app.add_api_route("/sdapi/v1/loras", lambda: [], methods=["GET"])
    assert api.register(webui.app) is False
    assert client.get("/sd-accel/engines").status_code == 404
    # --nowebui serves the API (and ours with it), no UI.
    harness.purge()
    webui = harness.start(tmp_path / "nowebui", argv=("--nowebui",))
    assert webui.demo is None
    assert webui.client().get("/sd-accel/engines").status_code == 200


def test_errors_answer_with_a_message_and_the_console_gets_the_traceback(tmp_path, capsys, monkeypatch):
    webui = harness.start(tmp_path)
    client = webui.client()
    # DELETE of an unknown engine: 404, naming the route that lists the names.
    response = client.delete("/sd-accel/engines/no-such-engine")
    assert response.status_code == 404
    assert "no engine named 'no-such-engine'" in response.json()["detail"]
    assert "GET /sd-accel/engines lists their names" in response.json()["detail"]
    # A refused request: a clear 400, nothing built.
    response = client.post("/sd-accel/build", json=BAD_PROFILE)
    assert response.status_code == 400 and "height" in response.json()["detail"]
    response = client.post("/sd-accel/build", json={"profile": STATIC.to_dict(), "components": ["unet", "clip2"]})
    assert response.status_code == 400 and "clip2" in response.json()["detail"]
    response = client.post("/sd-accel/build", json={"profile": STATIC.to_dict(), "precision": "int8"})
    assert response.status_code == 400 and "int8" in response.json()["detail"]
    # A failure inside the build: the client gets the message, the console the traceback.
    from sd_accel.webui import export

    def explode(*args, **kwargs):
        raise RuntimeError("the exporter fell over")

    monkeypatch.setattr(export, "build_loaded", explode)
    capsys.readouterr()
    response = client.post("/sd-accel/build", json={"profile": STATIC.to_dict()})
    assert response.status_code == 500
    assert response.json()["detail"] == "build failed: RuntimeError: the exporter fell over"
    out = capsys.readouterr().out
    assert "sd-accel: build failed:" in out and "Traceback (most recent call last)" in out
    assert "the exporter fell over" in out


def test_api_build_prints_one_line_per_stage(tmp_path, capsys):
    webui = harness.start(tmp_path)
    capsys.readouterr()
    response = webui.client().post("/sd-accel/build", json={"profile": STATIC.to_dict(), "components": ["unet"]})
    assert response.status_code == 200, response.text
    assert response.json()["not_built"] == []
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("sd-accel: API build")]
    stages = [line.split(": ", 2)[-1] for line in lines]
    assert any("exporting" in s for s in stages) and any("validating" in s for s in stages)
    assert lines[-1].startswith("sd-accel: API build done: 1 engine(s)")
    assert len(lines) < 20, lines  # stages, not steps
    assert len(set(stages)) == len(stages)  # no line printed twice
