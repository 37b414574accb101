"""``modules/api/api.py``: the WebUI's own API, with its ``--api-auth`` exactly as A1111 1.8 and
both Forges apply it.

``Api.__init__`` reads ``user:password[,user:password...]`` from ``cmd_opts.api_auth`` and adds
every ``/sdapi/v1`` route through ``add_api_route``, which passes
``dependencies=[Depends(self.auth)]`` when auth is on; ``auth`` checks HTTP basic credentials
with ``compare_digest`` and answers 401 with ``WWW-Authenticate: Basic`` otherwise. ``webui.py``
creates the Api only with ``--api`` (``webui()``) or ``--nowebui`` (``api_only()``), before
``app_started_callback``.
"""

from __future__ import annotations

from secrets import compare_digest

from fastapi import Depends, FastAPI, HTTPException
from fastapi.security import HTTPBasic, HTTPBasicCredentials

from modules import shared


class Api:
    def __init__(self, app: FastAPI, queue_lock):
        if shared.cmd_opts.api_auth:
            self.credentials = {}
            for auth in shared.cmd_opts.api_auth.split(","):
                user, password = auth.split(":")
                self.credentials[user] = password
        self.app = app
        self.queue_lock = queue_lock
        self.add_api_route("/sdapi/v1/options", self.get_config, methods=["GET"])
        self.add_api_route("/sdapi/v1/sd-models", self.get_sd_models, methods=["GET"])

    def add_api_route(self, path: str, endpoint, **kwargs):
        if shared.cmd_opts.api_auth:
            return self.app.add_api_route(path, endpoint, dependencies=[Depends(self.auth)], **kwargs)
        return self.app.add_api_route(path, endpoint, **kwargs)

    def auth(self, credentials: HTTPBasicCredentials = Depends(HTTPBasic())):  # noqa: B008  (the WebUI's code)
        if credentials.username in self.credentials:
            if compare_digest(credentials.password, self.credentials[credentials.username]):
                return True
        raise HTTPException(status_code=401, detail="Incorrect username or password", headers={"WWW-Authenticate": "Basic"})

    def get_config(self):
        return dict(shared.opts.data)

    def get_sd_models(self):
        from modules import sd_models

        return [{"title": x.title, "model_name": x.model_name, "hash": x.shorthash} for x in sd_models.checkpoints_list.values()]
